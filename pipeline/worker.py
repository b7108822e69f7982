"""One training process of a job: ``python -m pipeline.worker <run_dir>/job.json``.

Launched by every executor (local processes, Slurm tasks). torch.distributed is joined from
the environment; only global rank 0 writes metrics (JSON lines and MLflow) and the summary.
Exit codes as ``python -m moe.train``: 2 bad config/data, 3 non-finite loss, 4 checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys

from moe.config import ConfigError, ExperimentConfig
from moe.data import TokenDataError
from moe.parallel.env import shutdown_distributed
from moe.train.checkpoint import CheckpointError
from moe.train.sinks import ConsoleSink, JsonlSink
from moe.train.trainer import NonFiniteLossError, Trainer
from pipeline.executors.base import TrainJob


def run(job: TrainJob) -> int:
    cfg = ExperimentConfig.from_dict(job.config).validate()
    sinks: list = [ConsoleSink(), JsonlSink(job.metrics_path)]
    if job.mlflow_run_id:
        from pathlib import Path

        from pipeline.tracking import MlflowSink

        sinks.append(MlflowSink(job.mlflow_uri, job.mlflow_run_id, Path(job.run_dir) / "mlflow-fallback.jsonl", job.mlflow_flush_every))
    trainer = Trainer(cfg, sinks=sinks)
    summary = trainer.fit()
    if trainer.env.is_main:
        job.summary_path.write_text(json.dumps(dataclasses.asdict(summary), indent=2, default=str))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stdout)
    try:
        return run(TrainJob.read(argv[0]))
    except (ConfigError, TokenDataError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    except NonFiniteLossError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 3
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 4
    finally:
        shutdown_distributed()


if __name__ == "__main__":
    sys.exit(main())
