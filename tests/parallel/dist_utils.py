"""Run a function on N gloo (or, on GPUs, NCCL) ranks (fresh processes, free port); collect
what each returns."""

from __future__ import annotations

import contextlib
import os
import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moe.parallel.env import free_port


def _entry(rank: int, world: int, port: int, out_dir: str, fn, args, backend: str = "gloo") -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)})
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world)
        result = fn(rank, world, *args)
        torch.save({"ok": True, "result": result}, Path(out_dir) / f"{rank}.pt")
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()}, Path(out_dir) / f"{rank}.pt")
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world: int, *args, backend: str = "gloo"):
    """fn(rank, world, *args) on every rank; returns the list of results (rank order)."""
    with tempfile.TemporaryDirectory() as out:
        port = free_port()
        with contextlib.suppress(mp.ProcessRaisedException):
            mp.start_processes(_entry, args=(world, port, out, fn, args, backend), nprocs=world, join=True, start_method="spawn")
        results = []
        for r in range(world):
            path = Path(out) / f"{r}.pt"
            if not path.exists():
                raise AssertionError(f"rank {r} died without a result")
            got = torch.load(path, weights_only=False)
            if not got["ok"]:
                raise AssertionError(f"rank {r} failed:\n{got['error']}")
            results.append(got["result"])
        return results
