"""One stage's MLflow run, nested under the pipeline's parent run.

Grouping: stages of one ``moe repro`` (which sets MOE_PIPELINE_KEY) nest under one parent
run. A plain ``dvc repro`` groups by a key derived from params.yaml and the git commit, so
every stage run for the same parameters and code lands under the same parent. A stage that
DVC skips (its inputs did not change) adds no run; each nested run carries the DVC data
hashes it saw in dvc.lock, which link it to the runs that produced its inputs.

Only global rank 0 logs; the submitting process creates the run and passes its id to jobs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from moe.errors import MoeError
from moe.reader import MIB, AnyOf, Bool, FileFormatError, Map, Nullable, Num, Str, read_json
from pipeline.params import MlflowConfig
from pipeline.redact import redact
from pipeline.tracking.client import (
    bound_http,
    check_local_store,
    client_uri,
    deadline_s,
    finite,
    log_batched,
    mlflow_client,
    tracking_uri,
    within_deadline,
)
from pipeline.tracking.provenance import (
    dvc_dep_tags,
    dvc_out_hashes,
    environment_tags,
    git_info,
    param_value,
    pipeline_key,
    redacted_copy,
    run_name,
    standard_tags,
)
from pipeline.tracking.spool import OFFLINE_PREFIX, STAGE_FALLBACK, spool

log = logging.getLogger("pipeline.tracking")

PIPELINE_KEY_TAG = "moe.pipeline_key"
PIPELINE_STAGES = ("tokenize", "train", "convert", "evaluate")


MODEL_IDENTITY_TAG = "moe.conversion_sha256"  # a logged model's identity: its conversion record's digest


class Tracker:
    """Creates and writes one stage's nested run through MlflowClient (no global state).

    Best effort: when the tracking server cannot be reached (at the start or mid-run), the
    stage goes on and what it would have sent is spooled to ``fallback`` for
    ``moe mlflow-sync``; an unreachable server at the start gives an ``offline-`` run id that
    the sync creates. ``continue_run``: a run of this stage to go on with (a resumed training:
    one run, one loss curve) where the store holds it; else a new run is made."""

    def __init__(
        self,
        cfg: MlflowConfig,
        stage: str,
        params_path: Path = Path("params.yaml"),
        fallback: Path = STAGE_FALLBACK,
        parent_name: str | None = None,
        continue_run: str | None = None,
    ) -> None:
        bound_http()
        self.cfg, self.stage, self.params_path, self.fallback = cfg, stage, params_path, fallback
        self.parent_name = parent_name
        self.uri = tracking_uri(cfg)
        self.failed = False
        self.logged_figures = False  # a metric or a model sent: the stage had begun its work
        self.continued: str | None = None  # the status of the run continued here before (None: a new run)
        self._params_before: dict[str, str] = {}
        self._continued_parent: str | None = None
        tags = {
            "mlflow.runName": run_name(stage),
            "moe.stage": stage,
            PIPELINE_KEY_TAG: pipeline_key(params_path),
            **git_info(),
            **standard_tags(stage),
            **environment_tags(),
            **dvc_dep_tags(stage),
        }
        self._monitor = None
        try:
            within_deadline(lambda: self._connect(tags, continue_run), "MLflow run creation")
        except ModuleNotFoundError:
            raise
        except Exception as exc:  # unreachable or hanging server, database down, bad URI
            check_local_store(self.uri, exc)  # a broken local store is an error, not offline
            self.parent_id, self._parent_before = None, None
            self.run_id = f"{OFFLINE_PREFIX}{uuid.uuid4().hex}"
            self._fail(exc)
            spool(self.fallback, {"run_id": self.run_id, "create": {"experiment": cfg.experiment, "tags": tags}})
        else:
            self._monitor = start_system_metrics(self.uri, self.run_id)

    def _connect(self, tags: dict[str, str], continue_run: str | None) -> None:
        self.client = mlflow_client(self.uri)
        self.experiment_id = self._experiment()
        self.parent_id, self._parent_before = self._parent()
        earlier = self._continuable(continue_run)
        if earlier is None:
            self.run_id = self.client.create_run(self.experiment_id, tags={"mlflow.parentRunId": self.parent_id, **tags}).info.run_id
        else:  # the same run goes on, under this invocation's parent; its name stays
            from mlflow.entities import RunTag

            self.run_id, self.continued, self._params_before = earlier.info.run_id, earlier.info.status, dict(earlier.data.params)
            self._continued_parent = earlier.data.tags.get("mlflow.parentRunId")
            kept = {k: v for k, v in tags.items() if k != "mlflow.runName"}
            log_batched(self.client, self.run_id, tags=[RunTag(k, v) for k, v in {"mlflow.parentRunId": self.parent_id, **kept}.items()])
            self.client.update_run(self.run_id, status="RUNNING")
        self.client.update_run(self.parent_id, status="RUNNING")

    def _continuable(self, run_id: str | None):
        """The run ``run_id`` where this store holds it, live, of this experiment and stage."""
        if not run_id:
            return None
        try:
            run = self.client.get_run(run_id)
        except Exception:  # another store's run (or a deleted one): a new run instead
            return None
        same = run.info.experiment_id == self.experiment_id and run.data.tags.get("moe.stage") == self.stage
        return run if same and run.info.lifecycle_stage == "active" else None

    def _fail(self, exc: BaseException) -> None:
        if not self.failed:
            self.failed = True
            log.warning(
                "MLflow at %s unreachable (%s); continuing; spooling to %s for `moe mlflow-sync`",
                redact(self.uri),
                redact(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__),
                self.fallback,
            )

    def _send(self, fn, row: dict[str, Any]) -> None:
        """Run ``fn`` against the server; on failure (now or earlier) spool ``row`` instead."""
        if not self.failed:
            try:
                within_deadline(fn, "MLflow call")
                return
            except Exception as exc:
                self._fail(exc)
        if row:
            spool(self.fallback, {"run_id": self.run_id, "uri": redact(self.uri), **row})

    def _experiment(self) -> str:
        exp = self.client.get_experiment_by_name(self.cfg.experiment)
        if exp is not None:
            return exp.experiment_id
        artifacts = None
        if self.uri.startswith("sqlite:///"):
            artifacts = (Path(self.uri[len("sqlite:///") :]).parent / "mlartifacts").resolve().as_uri()
        try:
            return self.client.create_experiment(self.cfg.experiment, artifact_location=artifacts)
        except Exception:  # created concurrently by another process
            return self.client.get_experiment_by_name(self.cfg.experiment).experiment_id

    def _parent(self) -> tuple[str, str | None]:
        """(the pipeline's parent run, its status before this stage; None: created here)."""
        key = pipeline_key(self.params_path)
        found = self.client.search_runs(
            [self.experiment_id], filter_string=f"tags.`{PIPELINE_KEY_TAG}` = '{key}' and tags.`moe.stage` = 'pipeline'", max_results=1
        )
        if found:
            return found[0].info.run_id, found[0].info.status
        tags = {
            PIPELINE_KEY_TAG: key,
            "moe.stage": "pipeline",
            "mlflow.runName": self.parent_name or run_name("pipeline", key[:8]),
            **git_info(),
            **standard_tags("pipeline"),
        }
        run_id = self.client.create_run(self.experiment_id, tags=tags).info.run_id
        if self.params_path.is_file():
            self.client.log_artifact(run_id, str(redacted_copy(self.params_path)))
        # The parent spans the pipeline: RUNNING while a stage runs, ended (with the pipeline's
        # final metrics and plots) by each stage that finishes, FAILED if one fails.
        return run_id, None

    def log_params(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        values = {k: param_value(v) for k, v in sorted(params.items())}
        if self.continued is not None:  # MLflow never changes a logged param: what changed since is a tag
            changed = {k: v for k, v in values.items() if k in self._params_before and self._params_before[k] != v}
            values = {k: v for k, v in values.items() if k not in self._params_before}
            if changed:
                self.set_tags({f"moe.resumed_with.{k}": v for k, v in changed.items()})
        items = [Param(k, v) for k, v in values.items()]

        self._send(lambda: log_batched(self.client, self.run_id, params=items), {"params": values})

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None, model_id: str | None = None) -> None:
        """``model_id``: the metrics are also the scores of that logged model (MLflow 3)."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        values = {k: float(v) for k, v in metrics.items() if finite(v)}
        self.logged_figures = self.logged_figures or bool(values)
        items = [Metric(k, v, now, step or 0, model_id=model_id) for k, v in values.items()]
        self._send(lambda: log_batched(self.client, self.run_id, metrics=items), {"step": step or 0, "metrics": values})

    def log_model(self, name: str, directory: Path, identity: str, params: Mapping[str, Any], upload: bool) -> str | None:
        """The converted model as an MLflow 3 logged model of this run, found again by its
        ``identity`` (the sha256 of the conversion's record, which lists every file's digest);
        ``upload``: its files go to the model's artifacts. None when the server is unreachable
        (a logged model is not spooled: `moe mlflow-sync` restores runs, not models)."""
        if self.failed:
            return None
        self.logged_figures = True
        model_id: list[str] = []

        def send():
            model = self.client.create_logged_model(
                self.experiment_id,
                name=name,
                source_run_id=self.run_id,
                tags={MODEL_IDENTITY_TAG: identity, "moe.model_dir": str(directory)},
                params={k: param_value(v) for k, v in params.items()},
                model_type="transformers-olmoe",
            )
            if upload:
                self.client.log_model_artifacts(model.model_id, str(directory))
            self.client.finalize_logged_model(model.model_id, "READY")
            self.client.set_tag(self.run_id, "moe.model_id", model.model_id)
            model_id.append(model.model_id)

        self._send(send, {})
        return model_id[0] if model_id else None

    def find_model(self, identity: str) -> str | None:
        """The newest logged model with this identity in the experiment (None: none, or offline)."""
        if self.failed:
            return None
        found: list[str] = []

        def send():
            models = self.client.search_logged_models(
                [self.experiment_id],
                filter_string=f"tags.`{MODEL_IDENTITY_TAG}` = '{identity}'",
                max_results=1,
                order_by=[{"field_name": "creation_time", "ascending": False}],
            )
            found.extend(m.model_id for m in models)

        self._send(send, {})
        return found[0] if found else None

    def set_tags(self, tags: Mapping[str, str]) -> None:
        tags = {k: redact(str(v)) for k, v in tags.items()}

        def send():
            for k, v in tags.items():
                self.client.set_tag(self.run_id, k, v)

        self._send(send, {"tags": tags})

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """A file as an artifact; text files go with every URI password masked."""
        path = Path(path)
        if path.is_file():
            try:
                sent = redacted_copy(path) if path.suffix in (".yaml", ".yml", ".lock", ".json", ".txt", ".jsonl") else path
            except FileFormatError as exc:  # too large to mask in memory: not uploaded unmasked
                log.warning("%s; not logged as an artifact", exc)
                return
            self._send(lambda: self.client.log_artifact(self.run_id, str(sent), artifact_path), {})

    def log_stage_start(self, flat_params: Mapping[str, Any]) -> None:
        self.log_params(flat_params)
        self.log_artifact(self.params_path)
        self.log_artifact("dvc.lock")

    def log_artifacts(self, directory: str | Path, artifact_path: str | None = None) -> None:
        if Path(directory).is_dir():
            self._send(lambda: self.client.log_artifacts(self.run_id, str(directory), artifact_path), {})

    def log_dataset(self, name: str, path: str | Path, digest: str, context: str) -> None:
        """A token split as an MLflow dataset input (metadata only: where it is, its digest)."""
        self._send(lambda: log_dataset(self.client, self.run_id, name, path, digest, context), {})

    def end(self, ok: bool) -> None:
        if self._monitor is not None:
            try:
                within_deadline(self._monitor.finish, "system metrics", seconds=min(10.0, deadline_s()))
            except Exception as exc:  # system metrics are best effort
                log.warning("system metrics: %s", redact(str(exc)))
            self._monitor = None
        status = "FINISHED" if ok else "FAILED"

        def send():
            self.client.set_terminated(self.run_id, status)
            if not ok and self.parent_id:
                self.client.set_terminated(self.parent_id, "FAILED")
            elif ok and self.parent_id and self.stage in PIPELINE_STAGES:
                finish_parent(self.client, self.parent_id)

        self._send(send, {"status": status})

    def refused(self, exc: BaseException | None) -> bool:
        """Whether ``exc`` refused the command rather than failed its work: bad input (exit code
        2) before the stage logged a figure. A training job that ran and failed is no refusal."""
        from moe.errors import exit_code_of
        from pipeline.errors import JobFailed

        if exc is None or isinstance(exc, JobFailed) or self.logged_figures:
            return False
        return isinstance(exc, (MoeError, FileNotFoundError)) and exit_code_of(exc) == 2

    def abandon(self) -> None:
        """The stage never started (sbatch refused the job, bad input refused the command): its
        run is deleted (a continued run goes back to its status before) and the parent run is
        left as it was (deleted too if this stage created it), so a refused command leaves no
        history behind."""
        if self._monitor is not None:
            with contextlib.suppress(Exception):
                within_deadline(self._monitor.finish, "system metrics", seconds=min(10.0, deadline_s()))
            self._monitor = None

        def send():
            if self.continued is not None:
                if self._continued_parent:
                    self.client.set_tag(self.run_id, "mlflow.parentRunId", self._continued_parent)
                self.client.update_run(self.run_id, status=self.continued)
            else:
                self.client.delete_run(self.run_id)
            if self.parent_id and self._parent_before is None:
                self.client.delete_run(self.parent_id)
            elif self.parent_id:
                self.client.update_run(self.parent_id, status=self._parent_before)

        self._send(send, {"abandoned": True})  # offline: `moe mlflow-sync` drops this run's rows

    def stop_system_metrics(self) -> None:
        """For a run this process hands over (``moe submit`` without --wait: the job ends it)."""
        if self._monitor is not None:
            with contextlib.suppress(Exception):
                within_deadline(self._monitor.finish, "system metrics", seconds=min(10.0, deadline_s()))
            self._monitor = None


def start_system_metrics(uri: str, run_id: str):
    """MLflow's system metrics monitor (CPU, memory, disk, network; GPUs through nvidia-ml-py
    where installed) on this run; None where psutil is missing."""
    try:
        import psutil  # noqa: F401
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        monitor = SystemMetricsMonitor(
            run_id,
            sampling_interval=float(os.environ.get("MOE_SYSTEM_METRICS_INTERVAL", "2")),
            samples_before_logging=1,
            tracking_uri=client_uri(uri),
        )
        monitor.start()
        return monitor
    except Exception as exc:  # never fail a stage for its telemetry
        log.info("no system metrics: %s", exc)
        return None


def log_dataset(client, run_id: str, name: str, path: str | Path, digest: str, context: str) -> None:
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.entities import DatasetInput, InputTag

    with warnings.catch_warnings():  # MLflow registers its local-artifact source twice, then warns that a path is ambiguous
        warnings.filterwarnings("ignore", message="The specified dataset source can be interpreted in multiple ways")
        source = resolve_dataset_source(str(Path(path).resolve()))
    dataset = MetaDataset(source=source, name=name, digest=digest[:36])
    client.log_inputs(run_id, datasets=[DatasetInput(dataset._to_mlflow_entity(), tags=[InputTag("mlflow.data.context", context)])])


FINAL_METRICS = {"train": Path("metrics/train.json"), "eval": Path("metrics/eval.json")}
PLOTS_DIR = Path("plots")


# metrics/train.json and metrics/eval.json as the train and evaluate stages write them (DVC
# metrics): figures by name, some null ("never"), true/false, and a table or two of figures
# (evaluate's suite means, train's last in-loop evaluation), which the parent run leaves out.
_METRIC_NAME = Str(128, r"[A-Za-z][A-Za-z0-9_./\-]*")
_METRIC_VALUE = AnyOf((Nullable(Num()), Bool()), "a finite number, true, false or null")
FINAL_METRICS_SCHEMA = Map(
    other=AnyOf((_METRIC_VALUE, Map(other=_METRIC_VALUE, keys=_METRIC_NAME, max_keys=1000)), "a figure or a table of figures"),
    keys=_METRIC_NAME,
    max_keys=1000,
)
MAX_FINAL_METRICS_BYTES = 4 * MIB


def read_final_metrics(path: Path) -> dict[str, Any]:
    """A stage's final metrics; {} where there are none (the stage has not run) or the file is
    not one (one warning: the parent run's figures are a courtesy, never a failed stage)."""
    if not os.path.lexists(path):
        return {}
    try:
        return read_json(path, FINAL_METRICS_SCHEMA, MAX_FINAL_METRICS_BYTES)
    except FileFormatError as exc:
        log.warning("%s; the pipeline run's final metrics leave it out", exc)
        return {}


def finish_parent(client, parent_id: str) -> None:
    """The pipeline's parent run: its final metrics (metrics/*.json) and plots, ended now."""
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    items = []
    for prefix, path in FINAL_METRICS.items():
        data = read_final_metrics(path)
        items += [Metric(f"{prefix}/{k}", float(v), now, 0) for k, v in data.items() if finite(v)]
    log_batched(client, parent_id, metrics=items)
    if PLOTS_DIR.is_dir() and any(PLOTS_DIR.iterdir()):
        client.log_artifacts(parent_id, str(PLOTS_DIR), "plots")
    client.set_terminated(parent_id, "FINISHED")


def finalize_pipeline(cfg: MlflowConfig, key: str, lock_path: Path = Path("dvc.lock")) -> None:
    """After `moe repro`: tag the parent run with the final DVC hashes and attach dvc.lock."""
    within_deadline(lambda: _finalize_pipeline(mlflow_client(tracking_uri(cfg)), cfg, key, lock_path), "pipeline finalisation")


def _finalize_pipeline(client, cfg: MlflowConfig, key: str, lock_path: Path) -> None:
    exp = client.get_experiment_by_name(cfg.experiment)
    if exp is None:
        return
    runs = client.search_runs(
        [exp.experiment_id], filter_string=f"tags.`{PIPELINE_KEY_TAG}` = '{key}' and tags.`moe.stage` = 'pipeline'", max_results=1
    )
    if not runs:
        return
    run_id = runs[0].info.run_id
    for path, md5 in dvc_out_hashes(lock_path).items():
        client.set_tag(run_id, f"dvc.out.{path}", md5)
    if lock_path.is_file():
        client.log_artifact(run_id, str(redacted_copy(lock_path)))
