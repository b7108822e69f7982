"""Errors the CLI turns into one clear line and a meaningful exit code."""

from __future__ import annotations


class PipelineError(RuntimeError):
    """Bad input or a failed stage; the message names the key, file or job at fault."""

    exit_code = 2


class JobFailed(PipelineError):
    """A training job (local processes or Slurm) ended in failure."""

    exit_code = 5


EXIT_CODES = {
    "ok": 0,
    "unexpected": 1,
    "bad_input": 2,
    "nonfinite_loss": 3,
    "checkpoint": 4,
    "job_failed": 5,
}
