"""What runs in every task of a Slurm training job (submitted through submitit).

Each task joins torch.distributed from Slurm's environment
(``submitit.helpers.TorchDistributedEnvironment``), trains with automatic resume from the
latest checkpoint, and on USR2 (Slurm's warning before the time limit, or a preemption
notice) checkpoints at the next step boundary; global rank 0 then requeues the job with
``scontrol requeue`` and the restarted job resumes exactly where it stopped. Requeues are
counted here (Slurm's ``SLURM_RESTART_COUNT``), not by submitit, whose USR2 handler ours
replaces: at ``slurm.max_requeues`` the job stops instead (pipeline.requeue).
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from moe.errors import MoeError, error_line
from pipeline.requeue import requeue_or_stop
from pipeline.train_job import TrainJob


class SlurmTrainTask:
    """A picklable callable; submitit runs it once per task."""

    def __init__(self, spec_path: str) -> None:
        self.spec_path = spec_path

    def __call__(self) -> dict:
        import submitit

        from moe.train.preemption import StopRequest
        from pipeline import worker
        from pipeline.verbosity import configure_logging

        configure_logging(logging.INFO, stream=sys.stdout, log_file_format=True)
        for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            os.environ.pop(var, None)  # never inherit the submitting shell's
        env = submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
        _set_threads(env.local_world_size)
        stop = StopRequest().install([signal.SIGUSR2])  # replaces submitit's own USR2 handler
        job = _read_job(self.spec_path)
        code, summary = worker.run_and_report(job, stop=stop, lock=True)
        if code != 0:
            raise SystemExit(code)
        if summary.get("preempted"):
            requeue_or_stop(job, env.rank, summary["steps"])
        return summary

    def checkpoint(self, *args, **kwargs):  # submitit hook; unused: our USR2 handler replaces it
        return None


def _read_job(spec_path: str) -> TrainJob:
    """The job spec, or one `error:` line naming it and the task's exit code (not a traceback)."""
    try:
        return TrainJob.read(spec_path)
    except MoeError as exc:
        print(error_line(str(exc)), file=sys.stderr, flush=True)
        raise SystemExit(exc.exit_code) from None


def _set_threads(tasks_on_node: int) -> None:
    """One intra-op thread pool per task sized to its CPUs (no oversubscription); an
    OMP_NUM_THREADS the job was given wins (several node daemons may share one host's cores)."""
    import torch

    cpus = os.environ.get("SLURM_CPUS_PER_TASK")
    if cpus is None and os.environ.get("SLURM_CPUS_ON_NODE"):
        cpus = str(max(1, int(os.environ["SLURM_CPUS_ON_NODE"]) // max(1, tasks_on_node)))
    if cpus:
        given = os.environ.setdefault("OMP_NUM_THREADS", cpus)
        torch.set_num_threads(int(given) if given.isdigit() and int(given) > 0 else int(cpus))
