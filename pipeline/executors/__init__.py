"""Executors run a training job somewhere: local processes or a Slurm job (one seam)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.executors.base import Executor, JobResult, TrainJob
from pipeline.executors.local import LocalExecutor

if TYPE_CHECKING:
    from pipeline.params import PipelineConfig

__all__ = ["Executor", "JobResult", "LocalExecutor", "TrainJob", "build_executor", "world_size"]


def build_executor(cfg: PipelineConfig) -> Executor:
    if cfg.executor.kind == "local":
        return LocalExecutor()
    if cfg.executor.kind == "slurm":
        from pipeline.executors.slurm import SlurmExecutor

        return SlurmExecutor(cfg.slurm, cfg.container)
    raise ValueError(f"executor.kind: unknown executor {cfg.executor.kind!r}")


def world_size(cfg: PipelineConfig) -> int:
    if cfg.executor.kind == "slurm":
        return cfg.slurm.nodes * cfg.slurm.tasks_per_node
    return cfg.executor.nprocs
