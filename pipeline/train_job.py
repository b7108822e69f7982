"""A training job: everything a worker process needs, written to and read from ``<run_dir>/job.json``.
Its own module, below the executors, the run directories and the Slurm task that all read it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moe.reader import MIB, FileFormatError, Plain, parse_json, read_text
from pipeline.errors import PipelineError

if TYPE_CHECKING:
    from moe.config import ExperimentConfig, ResolvedLayout


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

    @classmethod
    def of(cls, exp: ExperimentConfig, layout: ResolvedLayout, run_dir: str | Path, **fields: Any) -> TrainJob:
        """The job of ``exp`` on ``layout``'s world, carrying that layout (resolved once, where the
        job is built): how the train stage (make_job) and the paper's measured runs build theirs."""
        return cls(config=exp.to_dict(), run_dir=str(run_dir), nprocs=layout.world_size, layout=layout.to_dict(), **fields)

    @property
    def resolved(self) -> ResolvedLayout | None:
        """The layout the job carries, refused (one ConfigError naming job.json and the field)
        unless it is the config's own on its world size: job.json is a file anybody can edit, and
        a layout the config does not resolve to (dp 0, an ep that does not divide dp, another
        grad_accum) fails deep inside a worker, or trains something else."""
        if self.layout is None:
            return None
        return check_layout(self.layout, self.config, self.nprocs, f"{self.spec_path}: layout")

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
        """A job spec as written by ``write``; anything else is refused naming the file and the
        field (the layout is checked where the worker takes it: ``resolved``)."""
        text = read_text(path, MAX_SPEC_BYTES)  # (FileFormatError: missing, not a regular file, too large, not UTF-8)
        try:
            data = parse_json(text, str(path))
        except FileFormatError as exc:  # "not valid JSON (why)" or "nested too deeply"
            why = str(exc).removeprefix(f"{path}: ")
            why = why[len("not valid JSON (") : -1] if why.startswith("not valid JSON (") else why
            raise PipelineError(f"{path}: not a job spec (not JSON: {why})") from None
        check_spec_fields(data, str(path))
        Plain().check(data, f"{path}: ")  # the config and eval inputs: bounded in depth, numbers finite
        return cls(**data)

    @property
    def summary_path(self) -> Path:
        return Path(self.run_dir) / "summary.json"

    @property
    def metrics_path(self) -> Path:
        return Path(self.run_dir) / "metrics.jsonl"

    def metric_rows(self) -> list[dict[str, Any]]:
        """The rows the job's rank 0 logged (metrics.jsonl, through the library's bounded reader):
        what the train stage and the paper's measured runs read of a finished job."""
        from moe.train.sinks import read_metric_rows

        return read_metric_rows(self.metrics_path)


MAX_SPEC_BYTES = 16 * MIB  # a job.json is a few kB: a config, paths and numbers

# The type of each field of a job.json (NoneType: may be null), and the least value of its counts;
# the layout is checked where the worker takes it (TrainJob.resolved: one error line, not a traceback).
_SPEC_TYPES: dict[str, tuple[type, ...]] = {
    "config": (dict,),
    "run_dir": (str,),
    "nprocs": (int,),
    "mlflow_uri": (str, type(None)),
    "mlflow_run_id": (str, type(None)),
    "mlflow_flush_every": (int,),
    "mlflow_finalize": (bool,),
    "max_requeues": (int, type(None)),
    "eval_inputs": (dict, type(None)),
}
_SPEC_LEAST = {"nprocs": 1, "mlflow_flush_every": 1, "max_requeues": 0}


def check_spec_fields(data: Any, where: str) -> None:
    """A job.json's top level: an object of TrainJob's fields, each of its type."""
    if not isinstance(data, dict):
        raise PipelineError(f"{where}: not a job spec (a JSON {type(data).__name__}, not an object)")
    fields = {f.name for f in dataclasses.fields(TrainJob)}
    unknown = sorted(set(data) - fields)
    if unknown:
        raise PipelineError(f"{where}: unknown field {unknown[0]!r} (a job spec has {', '.join(sorted(fields))})")
    missing = [name for name in ("config", "run_dir") if name not in data]
    if missing:
        raise PipelineError(f"{where}: missing field {missing[0]!r}")
    for name, value in data.items():
        if name == "layout":
            continue  # checked where the worker takes it (TrainJob.resolved)
        kinds = _SPEC_TYPES[name]
        if type(value) not in kinds:  # (type, not isinstance: true is no count)
            expected = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
            raise PipelineError(f"{where}: {name}: expected {expected}, got {repr(value)[:80]}")
        if name in _SPEC_LEAST and value is not None and value < _SPEC_LEAST[name]:
            raise PipelineError(f"{where}: {name}: must be >= {_SPEC_LEAST[name]}, got {value}")


def check_layout(layout: Any, config: dict[str, Any], nprocs: int, where: str) -> ResolvedLayout:
    """``layout`` read as a ResolvedLayout and checked against what ``config`` resolves to on its
    world size (ExperimentConfig.resolve: pp * dp = world, ep divides dp, grad_accum = global
    batch / (dp * micro batch), the data-parallel kind, the virtual stages), which must be the
    job's process count: the first field that differs is named with the value it should have."""
    from moe.config import ConfigError, ExperimentConfig, ResolvedLayout

    if not isinstance(layout, dict):
        raise ConfigError(f"{where}: expected an object of the layout's fields, got {type(layout).__name__} {layout!r}")
    given = ResolvedLayout.from_dict(layout, where)  # the fields, each of its type
    for name, value in given.to_dict().items():
        if type(value) is int and value < 1:
            raise ConfigError(f"{where}.{name}: must be >= 1, got {value}")
    if given.world_size != nprocs:
        raise ConfigError(f"{where}.world_size: {given.world_size}, but the job runs {nprocs} process(es) (nprocs)")
    try:
        own = ExperimentConfig.from_dict(config).validate().resolve(given.world_size).to_dict()
    except ConfigError as exc:
        raise ConfigError(f"{where}: the job's config does not run on world size {given.world_size} ({exc})") from None
    for name, value in given.to_dict().items():
        if value != own[name]:
            raise ConfigError(f"{where}.{name}: {value!r}, but the job's config resolves to {own[name]!r} on world size {given.world_size}")
    return given
