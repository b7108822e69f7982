"""After a stop checkpoint in a Slurm job: requeue it, or stop at ``slurm.max_requeues``.

Requeues are counted here (Slurm's ``SLURM_RESTART_COUNT``, every requeue of the job whatever
its cause), not by submitit, whose USR2 handler ours replaces: at the limit every task exits
with REQUEUE_LIMIT_EXIT instead, and rank 0 says so in its log, on stderr (the line
`moe submit --wait` reports) and in MLflow.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

from moe.errors import EXIT_CODES, error_line
from pipeline.train_job import TrainJob

log = logging.getLogger("pipeline.slurm")
REQUEUE_EXIT = 75
REQUEUE_LIMIT_EXIT = EXIT_CODES["job_failed"]


def restart_count() -> int:
    """How often Slurm has requeued this job (any cause); unset before the first requeue."""
    value = os.environ.get("SLURM_RESTART_COUNT", "0")
    return int(value) if value.isdigit() else 0


def requeue_or_stop(job: TrainJob, rank: int, step: int) -> None:
    """Below ``job.max_requeues`` rank 0 requeues the job and every task waits to be ended; at
    the limit every task exits with REQUEUE_LIMIT_EXIT."""
    job_id = os.environ["SLURM_JOB_ID"]
    done, limit = restart_count(), job.max_requeues
    if limit is not None and done >= limit:
        if rank == 0:
            message = (
                f"slurm.max_requeues={limit} reached: job {job_id} was requeued {done} times; "
                f"not requeueing again. The checkpoint at step {step} resumes with `moe submit`"
            )
            log.error(message)
            print(error_line(message), file=sys.stderr, flush=True)
            _record_stop(job, message)
        raise SystemExit(REQUEUE_LIMIT_EXIT)
    if rank == 0:
        log.warning(
            "checkpoint written at step %d; requeueing slurm job %s (requeue %d of %s)",
            step,
            job_id,
            done + 1,
            limit if limit is not None else "unlimited",
        )
        subprocess.run(["scontrol", "requeue", job_id], check=True)
    time.sleep(600)  # Slurm ends this allocation; the requeued job resumes from the checkpoint
    raise SystemExit(REQUEUE_EXIT)


def _record_stop(job: TrainJob, message: str) -> None:
    """The reason as an MLflow tag; the run ends FAILED (here, or by a waiting `moe submit`)."""
    if not job.mlflow_run_id:
        return
    from pipeline.tracking.job import close_job_run, tag_job_run

    tag_job_run(job, {"moe.stop_reason": message})
    close_job_run(job, ok=False)
