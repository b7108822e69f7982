"""Errors the CLI turns into one clear line and a meaningful exit code."""

from __future__ import annotations


class PipelineError(RuntimeError):
    """Bad input or a failed stage; the message names the key, file or job at fault."""

    exit_code = 2


class JobFailed(PipelineError):
    """A training job (local processes or Slurm) ended in failure. A worker's own exit code
    for bad input (2), a non-finite loss (3) or a checkpoint problem (4) is passed on, and
    so is 128 + N for a run stopped by signal N."""

    exit_code = 5

    def __init__(self, message: str, worker_code: int | None = None) -> None:
        super().__init__(message)
        if worker_code in (2, 3, 4) or (worker_code is not None and 128 < worker_code < 160):
            self.exit_code = worker_code


EXIT_CODES = {
    "ok": 0,
    "unexpected": 1,
    "bad_input": 2,
    "nonfinite_loss": 3,
    "checkpoint": 4,
    "job_failed": 5,
}
