"""One training process of a job: ``python -m pipeline.worker <run_dir>/job.json``.

Launched by every executor (local processes, Slurm tasks). torch.distributed is joined from
the environment; only global rank 0 writes metrics (JSON lines and MLflow) and the summary.
Exit codes as ``python -m moe.train``: 2 bad config/data, 3 non-finite loss, 4 checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any

from moe.config import ExperimentConfig
from moe.errors import MoeError, error_line
from moe.reader import Bool, FileFormatError, Int, Map, Nullable, Num, Str, read_json
from moe.train.sinks import ConsoleSink, JsonlSink, read_metric_rows
from pipeline.run_lock import RunLock
from pipeline.tracking.job import close_job_run
from pipeline.train_job import TrainJob

# summary.json as run() writes it (TrainSummary; a non-finite number as null)
SUMMARY_SCHEMA = Map(
    required={"steps": Int(0), "start_step": Int(0)},
    optional={
        "final_loss": Nullable(Num()),
        "losses": Map(other=Nullable(Num()), keys=Str(20, r"[0-9]+")),
        "last_metrics": Map(other=Nullable(Num()), max_keys=100_000),
        "tokens_per_step": Int(0),
        "params_total": Int(0),
        "params_active": Int(0),
        "checkpoint": Nullable(Str(4096)),
        "preempted": Bool(),
        "already_finished": Bool(),
    },
)

_HELD: list[RunLock] = []  # the run lock lives as long as this process
PARENT_PID_ENV = "MOE_PARENT_PID"  # set by the local executor, which holds the run lock


def die_with_parent() -> None:
    """A worker of the local executor ends when its launcher does, even on kill -9 (Linux)."""
    parent = os.environ.get(PARENT_PID_ENV)
    if not parent or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != int(parent):  # the launcher died before prctl
        os._exit(1)


def run(job: TrainJob, stop=None) -> dict:
    """Train; return the summary (rank 0 also writes it)."""
    from moe.train.process import train

    cfg = ExperimentConfig.from_dict(job.config).validate()
    resolved = job.resolved  # resolved once where the job was built; the layout checks the world size
    sinks: list = [ConsoleSink(), JsonlSink(job.metrics_path)]
    if job.mlflow_run_id:
        from pipeline.tracking.job import MlflowSink, job_uri
        from pipeline.tracking.provenance import inventory_tags

        sink = MlflowSink(job_uri(job), job.mlflow_run_id, Path(job.run_dir) / "mlflow-fallback.jsonl", job.mlflow_flush_every)
        sinks.append(sink)
        if int(os.environ.get("RANK", "0")) == 0:
            sink.set_tags(inventory_tags())  # what this job actually ran in (its image)
    callbacks = []
    if cfg.train.eval_every and job.eval_inputs:  # the tasks tokenised at launch (pipeline.eval.inloop), read here
        from moe.train.callbacks.in_loop_eval import in_loop_eval_callback

        val = job.eval_inputs.get("val")
        callbacks.append(in_loop_eval_callback(cfg, job.eval_inputs.get("requests"), val if val and Path(val).is_dir() else None))
    trainer, fitted = train(cfg, sinks, callbacks, stop, resolved=resolved)
    summary = dataclasses.asdict(fitted)
    if summary["steps"] == summary["start_step"] and not summary["preempted"]:
        summary = finished_summary(job, summary)
    if trainer.env.is_main and not summary["preempted"]:
        from pipeline.outputs import write_atomic

        write_atomic(job.summary_path, json.dumps(_finite(summary), indent=2, default=str))
    return summary


def _finite(value: Any) -> Any:
    """NaN and inf as null: JSON has no such numbers (and the reader refuses them)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def read_summary(path: Path) -> dict[str, Any]:
    """A job's summary.json, every field checked (FileFormatError names the field)."""
    return read_json(path, SUMMARY_SCHEMA)


def finished_summary(job: TrainJob, summary: dict) -> dict:
    """A rerun of a finished run trains nothing: report the run as it finished (its earlier
    summary, else the final loss from metrics.jsonl) rather than an empty one."""
    summary["already_finished"] = True
    try:
        earlier = read_summary(job.summary_path)
        if earlier.get("steps") == summary["steps"] and earlier.get("final_loss") is not None:
            return {**earlier, "already_finished": True}
    except FileFormatError:
        pass
    if job.metrics_path.is_file():
        for row in read_metric_rows(job.metrics_path):
            if row.get("step") == summary["steps"] and isinstance(row.get("loss"), (int, float)):
                summary["final_loss"] = row["loss"]
    return summary


def run_and_report(job: TrainJob, stop=None, lock: bool = False) -> tuple[int, dict]:
    """(exit code, summary): expected failures print one `error:` line to stderr. ``lock``:
    global rank 0 holds the run directory's lock until the process ends (a Slurm job, whose
    submitter has gone; under the local executor the launching process holds it)."""

    rank = int(os.environ.get("RANK", "0"))

    def body() -> dict:
        if lock and rank == 0:
            _HELD.append(RunLock(job.run_dir, job.checkpoint_dir).acquire(f"training job {job.spec_path}"))
        summary = run(job, stop)
        if rank == 0 and not summary["preempted"]:
            close_job_run(job, ok=True)
        return summary

    from moe.train.process import run_process

    code, summary, message = run_process(body)
    if message is None:
        return code, summary
    from pipeline.console import without_unsafe_advice

    print(error_line(without_unsafe_advice(message)), file=sys.stderr, flush=True)
    if rank == 0:
        close_job_run(job, ok=False)
    return code, {}


def interrupted_once() -> None:
    """Ctrl-C reaches a local worker twice (from the terminal, and forwarded by the launcher):
    the first stops the run, the second must not break its teardown into a second traceback."""
    import signal

    def stop(signum, frame):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, stop)


def main(argv: list[str] | None = None) -> int:
    """Entry of local processes and of plain-sbatch tasks (slurm/train.sbatch). Under Slurm,
    USR2 means: checkpoint at the next step, then requeue."""

    argv = sys.argv[1:] if argv is None else argv
    interrupted_once()
    die_with_parent()
    from pipeline.verbosity import configure_logging

    configure_logging(logging.INFO, stream=sys.stdout, log_file_format=True)
    stop = None
    slurm = bool(os.environ.get("SLURM_JOB_ID")) and not os.environ.get(PARENT_PID_ENV)
    if slurm:
        import signal

        from moe.train.preemption import StopRequest

        stop = StopRequest().install([signal.SIGUSR2])
    try:
        job = TrainJob.read(argv[0])
    except MoeError as exc:  # a job spec that is not one of ours: one line, its exit code
        print(error_line(str(exc)), file=sys.stderr, flush=True)
        return exc.exit_code
    try:
        code, summary = run_and_report(job, stop, lock=slurm)
    except KeyboardInterrupt:  # Ctrl-C: the launcher says so, in one line
        return 130
    if code == 0 and summary.get("preempted"):
        from pipeline.requeue import requeue_or_stop

        requeue_or_stop(job, int(os.environ.get("RANK", "0")), summary["steps"])
    return code


if __name__ == "__main__":
    sys.exit(main())
