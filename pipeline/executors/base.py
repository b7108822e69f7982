"""The executor seam: what runs a training job (pipeline/train_job.py), and its result."""

from __future__ import annotations

import dataclasses
from typing import Protocol

from pipeline.train_job import TrainJob


@dataclasses.dataclass
class JobResult:
    ok: bool
    exit_code: int
    log_path: str
    message: str = ""
    job_id: str | None = None


class Executor(Protocol):
    def run(self, job: TrainJob) -> JobResult: ...
