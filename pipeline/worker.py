"""One training process of a job: ``python -m pipeline.worker <run_dir>/job.json``.

Launched by every executor (local processes, Slurm tasks). torch.distributed is joined from
the environment; only global rank 0 writes metrics (JSON lines and MLflow) and the summary.
Exit codes as ``python -m moe.train``: 2 bad config/data, 3 non-finite loss, 4 checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys

from moe.config import ConfigError, ExperimentConfig
from moe.data import TokenDataError
from moe.parallel.env import shutdown_distributed
from moe.train.checkpoint import CheckpointError
from moe.train.determinism import set_environment
from moe.train.sinks import ConsoleSink, JsonlSink
from moe.train.trainer import NonFiniteLossError, Trainer
from pipeline.executors.base import TrainJob


def run(job: TrainJob, stop=None) -> dict:
    """Train; return the summary (rank 0 also writes it)."""
    cfg = ExperimentConfig.from_dict(job.config).validate()
    if cfg.train.deterministic:  # before anything starts CUDA or NCCL
        set_environment()
    sinks: list = [ConsoleSink(), JsonlSink(job.metrics_path)]
    if job.mlflow_run_id:
        from pathlib import Path

        from pipeline.tracking import MlflowSink, inventory_tags

        sink = MlflowSink(job_uri(job), job.mlflow_run_id, Path(job.run_dir) / "mlflow-fallback.jsonl", job.mlflow_flush_every)
        sinks.append(sink)
        if int(os.environ.get("RANK", "0")) == 0:
            sink.set_tags(inventory_tags())  # what this job actually ran in (its image)
    trainer = Trainer(cfg, sinks=sinks)
    summary = dataclasses.asdict(trainer.fit(stop=stop))
    if trainer.env.is_main and not summary["preempted"]:
        job.summary_path.write_text(json.dumps(summary, indent=2, default=str))
    return summary


def run_and_report(job: TrainJob, stop=None) -> tuple[int, dict]:
    """(exit code, summary): expected failures print one `error:` line to stderr."""

    rank = int(os.environ.get("RANK", "0"))
    try:
        summary = run(job, stop)
        if rank == 0 and not summary["preempted"]:
            _finalize_mlflow(job, ok=True)
        return 0, summary
    except (ConfigError, TokenDataError, FileNotFoundError) as exc:
        code, message = 2, str(exc)
    except NonFiniteLossError as exc:
        code, message = 3, str(exc)
    except CheckpointError as exc:
        code, message = 4, str(exc)
    finally:
        shutdown_distributed()
    print(f"error: {message}", file=sys.stderr, flush=True)
    if rank == 0:
        _finalize_mlflow(job, ok=False)
    return code, {}


def job_uri(job: TrainJob) -> str | None:
    """The tracking URI with its password, which job.json holds redacted: from the environment."""
    from pipeline.redact import unredact

    return unredact(job.mlflow_uri, os.environ.get("MOE_MLFLOW_TRACKING_URI"), os.environ.get("MLFLOW_TRACKING_URI"))


def _finalize_mlflow(job: TrainJob, ok: bool) -> None:
    if not (job.mlflow_finalize and job.mlflow_run_id) or job.mlflow_run_id.startswith("offline-"):
        return
    try:
        from mlflow.tracking import MlflowClient

        from pipeline.tracking import bound_http

        bound_http()
        client = MlflowClient(job_uri(job))
        client.set_terminated(job.mlflow_run_id, "FINISHED" if ok else "FAILED")
        if job.summary_path.is_file():
            client.log_artifact(job.mlflow_run_id, str(job.summary_path))
    except Exception as exc:  # tracking is best effort from a job
        from pipeline.redact import redact

        print(f"warning: could not close MLflow run {job.mlflow_run_id}: {redact(str(exc))}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Entry of local processes and of plain-sbatch tasks (slurm/train.sbatch). Under Slurm,
    USR2 means: checkpoint at the next step, then requeue."""

    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stdout)
    stop = None
    if os.environ.get("SLURM_JOB_ID"):
        import signal

        from moe.train.preemption import StopRequest

        stop = StopRequest().install([signal.SIGUSR2])
    code, summary = run_and_report(TrainJob.read(argv[0]), stop)
    if code == 0 and summary.get("preempted"):
        from pipeline.slurm_task import requeue_and_wait

        requeue_and_wait(int(os.environ.get("RANK", "0")))
    return code


if __name__ == "__main__":
    sys.exit(main())
