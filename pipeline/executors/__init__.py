"""Executors run a training job somewhere: local processes or a Slurm job (one seam)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.executors.base import Executor, JobResult

if TYPE_CHECKING:
    from pipeline.executors.local import LocalExecutor
    from pipeline.params import PipelineConfig

__all__ = ["Executor", "JobResult", "LocalExecutor", "build_executor", "world_size"]


def __getattr__(name: str):
    # The local executor starts ranks with torch's launcher: imported when used, so that the
    # config commands (`moe params`, `moe submit --dry-run`) answer without loading torch.
    if name == "LocalExecutor":
        from pipeline.executors.local import LocalExecutor

        return LocalExecutor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_executor(cfg: PipelineConfig) -> Executor:
    if cfg.executor.kind == "local":
        from pipeline.executors.local import LocalExecutor

        return LocalExecutor()
    if cfg.executor.kind == "slurm":
        from pipeline.executors.slurm import SlurmExecutor

        return SlurmExecutor(cfg.slurm, cfg.container)
    raise ValueError(f"executor.kind: unknown executor {cfg.executor.kind!r}")


def world_size(cfg: PipelineConfig) -> int:
    if cfg.executor.kind == "slurm":
        return cfg.slurm.nodes * cfg.slurm.tasks_per_node
    return cfg.executor.nprocs
