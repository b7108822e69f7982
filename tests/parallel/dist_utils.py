"""Run a function on N gloo (or, on GPUs, NCCL) ranks (fresh processes, free port:
moe.parallel.spawn); collect what each returns."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from moe.parallel.spawn import RanksFailed
from moe.parallel.spawn import run_ranks as spawn_and_wait


def _entry(rank: int, world: int, out_dir: str, fn, args, backend: str = "gloo") -> None:
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world)
        torch.save(fn(rank, world, *args), Path(out_dir) / f"{rank}.pt")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world: int, *args, backend: str = "gloo"):
    """fn(rank, world, *args) on every rank; returns the list of results (rank order)."""
    with tempfile.TemporaryDirectory() as out:
        try:
            spawn_and_wait(_entry, world, out, fn, args, backend)
        except RanksFailed as exc:
            raise AssertionError(str(exc)) from None
        return [torch.load(Path(out) / f"{r}.pt", weights_only=False) for r in range(world)]
