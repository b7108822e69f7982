"""Process-group setup from the launcher's environment (torchrun-style or Slurm)."""

from __future__ import annotations

import dataclasses
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from moe.hardware import configure_cuda_allocator


def free_port() -> int:
    """A TCP port free on this host now (for a process group's rendezvous on 127.0.0.1)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def pick_device(preference: str, local_rank: int = 0, key: str = "train.device") -> torch.device:
    """``key``: the setting ``preference`` came from, named when it cannot be met."""
    if preference == "cpu" or (preference == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError(f"{key} is 'cuda' but no CUDA device is available")
    configure_cuda_allocator()
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def init_distributed(device_preference: str = "auto", timeout_s: float = 600.0) -> DistEnv:
    """Join the process group described by RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT
    (gloo on CPU, NCCL on GPU); a lone process needs none of them."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(device_preference, local_rank)
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    return DistEnv(rank=rank, world_size=world, local_rank=local_rank, device=device)


def shutdown_distributed(clean: bool = True) -> None:
    """Tear down NVSHMEM (collectively only after a clean run: ``clean=False`` when this rank
    failed, so that it never waits in a collective the others will not reach) and the group."""
    import sys

    if "moe.parallel.transport" in sys.modules:  # NVSHMEM goes first: its teardown is collective
        sys.modules["moe.parallel.transport"].shutdown(clean=clean)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
