"""The executor seam: a training job description and its result."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from moe.config import ResolvedLayout


@dataclasses.dataclass
class TrainJob:
    """Everything a worker process needs; written to ``<run_dir>/job.json``."""

    config: dict[str, Any]  # ExperimentConfig.to_dict()
    run_dir: str
    nprocs: int = 1
    mlflow_uri: str | None = None
    mlflow_run_id: str | None = None
    mlflow_flush_every: int = 50
    # The job ends its MLflow run itself (when nobody waits for it, e.g. `moe submit`).
    mlflow_finalize: bool = False
    # Slurm: requeues after a stop signal before the job gives up (None: no limit).
    max_requeues: int | None = None
    # In-loop evaluation's inputs (pipeline.eval.inloop.eval_inputs), when train.eval_every > 0.
    eval_inputs: dict[str, Any] | None = None
    # The config's layout on nprocs processes (ResolvedLayout.to_dict()), resolved once where the
    # job was built; the worker hands it to the layout, which checks only the world size.
    layout: dict[str, Any] | None = None

    @property
    def resolved(self) -> ResolvedLayout | None:
        from moe.config import ResolvedLayout

        return None if self.layout is None else ResolvedLayout.from_dict(self.layout, "job.layout")

    @property
    def spec_path(self) -> Path:
        return Path(self.run_dir) / "job.json"

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.config["checkpoint"]["dir"])

    def write(self) -> Path:
        from pipeline.outputs import write_atomic

        return write_atomic(self.spec_path, json.dumps(dataclasses.asdict(self), indent=2))

    @classmethod
    def read(cls, path: str | Path) -> TrainJob:
        return cls(**json.loads(Path(path).read_text()))

    @property
    def summary_path(self) -> Path:
        return Path(self.run_dir) / "summary.json"

    @property
    def metrics_path(self) -> Path:
        return Path(self.run_dir) / "metrics.jsonl"


@dataclasses.dataclass
class JobResult:
    ok: bool
    exit_code: int
    log_path: str
    message: str = ""
    job_id: str | None = None


class Executor(Protocol):
    def run(self, job: TrainJob) -> JobResult: ...
