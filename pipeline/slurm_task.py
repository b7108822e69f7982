"""What runs in every task of a Slurm training job (submitted through submitit).

Each task joins torch.distributed from Slurm's environment
(``submitit.helpers.TorchDistributedEnvironment``), trains with automatic resume from the
latest checkpoint, and on USR2 (Slurm's warning before the time limit, or a preemption
notice) checkpoints at the next step boundary; global rank 0 then requeues the job with
``scontrol requeue`` and the restarted job resumes exactly where it stopped. Requeues are
counted here (Slurm's ``SLURM_RESTART_COUNT``), not by submitit, whose USR2 handler ours
replaces: at ``slurm.max_requeues`` the job stops with REQUEUE_LIMIT_EXIT instead.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

from pipeline.executors.base import TrainJob

log = logging.getLogger("pipeline.slurm")
REQUEUE_EXIT = 75
REQUEUE_LIMIT_EXIT = 5  # "a training job failed" (pipeline.errors.EXIT_CODES)


class SlurmTrainTask:
    """A picklable callable; submitit runs it once per task."""

    def __init__(self, spec_path: str) -> None:
        self.spec_path = spec_path

    def __call__(self) -> dict:
        import submitit

        from moe.train.preemption import StopRequest
        from pipeline import worker

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stdout, force=True)
        for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            os.environ.pop(var, None)  # never inherit the submitting shell's
        env = submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
        _set_threads(env.local_world_size)
        stop = StopRequest().install([signal.SIGUSR2])  # replaces submitit's own USR2 handler
        job = TrainJob.read(self.spec_path)
        code, summary = worker.run_and_report(job, stop=stop, lock=True)
        if code != 0:
            raise SystemExit(code)
        if summary.get("preempted"):
            requeue_or_stop(job, env.rank, summary["steps"])
        return summary

    def checkpoint(self, *args, **kwargs):  # submitit hook; unused: our USR2 handler replaces it
        return None


def restart_count() -> int:
    """How often Slurm has requeued this job (any cause); unset before the first requeue."""
    value = os.environ.get("SLURM_RESTART_COUNT", "0")
    return int(value) if value.isdigit() else 0


def requeue_or_stop(job: TrainJob, rank: int, step: int) -> None:
    """After a stop checkpoint: below ``job.max_requeues`` rank 0 requeues the job and every
    task waits to be ended; at the limit every task exits with REQUEUE_LIMIT_EXIT and rank 0
    says so in its log, on stderr (the line `moe submit --wait` reports) and in MLflow."""
    job_id = os.environ["SLURM_JOB_ID"]
    done, limit = restart_count(), job.max_requeues
    if limit is not None and done >= limit:
        if rank == 0:
            message = (f"slurm.max_requeues={limit} reached: job {job_id} was requeued {done} times; "
                       f"not requeueing again. The checkpoint at step {step} resumes with `moe submit`")
            log.error(message)
            print(f"error: {message}", file=sys.stderr, flush=True)
            _record_stop(job, message)
        raise SystemExit(REQUEUE_LIMIT_EXIT)
    if rank == 0:
        log.warning("checkpoint written at step %d; requeueing slurm job %s (requeue %d of %s)",
                    step, job_id, done + 1, limit if limit is not None else "unlimited")
        subprocess.run(["scontrol", "requeue", job_id], check=True)
    time.sleep(600)  # Slurm ends this allocation; the requeued job resumes from the checkpoint
    raise SystemExit(REQUEUE_EXIT)


def _record_stop(job: TrainJob, message: str) -> None:
    """The reason as an MLflow tag; the run ends FAILED (here, or by a waiting `moe submit`)."""
    if not job.mlflow_run_id:
        return
    from pipeline.redact import redact
    from pipeline.worker import _finalize_mlflow, job_uri

    try:
        from pipeline.tracking import mlflow_client, within_deadline

        # job.mlflow_uri is redacted (job.json keeps no password): the full one is in the environment
        within_deadline(lambda: mlflow_client(job_uri(job)).set_tag(job.mlflow_run_id, "moe.stop_reason", message), "tagging")
    except Exception as exc:  # tracking is best effort from a job
        print(f"warning: could not tag MLflow run {job.mlflow_run_id}: {redact(str(exc))}", file=sys.stderr)
    _finalize_mlflow(job, ok=False)


def _set_threads(tasks_on_node: int) -> None:
    """One intra-op thread pool per task sized to its CPUs (no oversubscription)."""
    import torch

    cpus = os.environ.get("SLURM_CPUS_PER_TASK")
    if cpus is None and os.environ.get("SLURM_CPUS_ON_NODE"):
        cpus = str(max(1, int(os.environ["SLURM_CPUS_ON_NODE"]) // max(1, tasks_on_node)))
    if cpus:
        os.environ.setdefault("OMP_NUM_THREADS", cpus)
        torch.set_num_threads(int(cpus))
