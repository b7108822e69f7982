"""The pipeline's own errors; like every library error (moe.errors) they carry their exit code."""

from __future__ import annotations

from moe.errors import EXIT_CODES, MoeError, exit_code_of  # noqa: F401 - exit_code_of: the one policy


class PipelineError(MoeError, RuntimeError):
    """Bad input or a failed stage; the message names the key, file or job at fault."""


class SubmissionRefused(PipelineError):
    """The scheduler refused the job (sbatch failed): nothing ran, so no run history is kept."""


class JobFailed(PipelineError):
    """A training job (local processes or Slurm) ended in failure. A worker's own exit code
    for bad input (2), a non-finite loss (3) or a checkpoint problem (4) is passed on, and
    so is 128 + N for a run stopped by signal N."""

    exit_code = EXIT_CODES["job_failed"]

    def __init__(self, message: str, worker_code: int | None = None) -> None:
        super().__init__(message)
        if worker_code in (2, 3, 4) or (worker_code is not None and 128 < worker_code < 160):
            self.exit_code = worker_code
