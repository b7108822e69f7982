"""Executors run a training job somewhere: local processes now, Slurm next (one seam)."""

from pipeline.executors.base import Executor, JobResult, TrainJob
from pipeline.executors.local import LocalExecutor

__all__ = ["Executor", "JobResult", "LocalExecutor", "TrainJob", "build_executor"]


def build_executor(kind: str) -> Executor:
    if kind == "local":
        return LocalExecutor()
    raise ValueError(f"executor.kind: unknown executor {kind!r}")
