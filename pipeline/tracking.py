"""MLflow tracking: one parent run per pipeline, one nested run per stage that runs.

Grouping: stages of one ``moe repro`` (which sets MOE_PIPELINE_KEY) nest under one parent
run. A plain ``dvc repro`` groups by a key derived from params.yaml and the git commit, so
every stage run for the same parameters and code lands under the same parent. A stage that
DVC skips (its inputs did not change) adds no run; each nested run carries the DVC data
hashes it saw in dvc.lock, which link it to the runs that produced its inputs.

Only global rank 0 logs; the submitting process creates the run and passes its id to jobs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import platform
import socket
import subprocess
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from pipeline.errors import PipelineError
from pipeline.params import MlflowConfig
from pipeline.redact import redact

log = logging.getLogger("pipeline.tracking")

MAX_PARAM_CHARS = 6000
MAX_PARAMS_PER_BATCH = 100
MAX_METRICS_PER_BATCH = 1000
PIPELINE_KEY_TAG = "moe.pipeline_key"
PIPELINE_STAGES = ("tokenize", "train", "convert", "evaluate")


# Training never waits long on tracking: a few quick retries, then spool to the fallback file.
HTTP_LIMITS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
}
# A server that answers one byte every few seconds never trips a read timeout: every tracking
# call also has a total deadline, after which the stage goes on offline (spooling).
DEADLINE_ENV = "MOE_TRACKING_DEADLINE_S"
DEFAULT_DEADLINE_S = 30.0
STAGE_FALLBACK = Path("mlflow-fallback.jsonl")
OFFLINE_PREFIX = "offline-"


class TrackingTimeout(TimeoutError):
    pass


def bound_http() -> None:
    """Bounded MLflow HTTP retries and timeouts for this process and the jobs it starts
    (MLflow's defaults retry for minutes); values the user exported win."""
    for k, v in HTTP_LIMITS.items():
        os.environ.setdefault(k, v)


def deadline_s() -> float:
    try:
        return max(0.1, float(os.environ.get(DEADLINE_ENV, DEFAULT_DEADLINE_S)))
    except ValueError:
        return DEFAULT_DEADLINE_S


def within_deadline(fn, what: str = "tracking call", seconds: float | None = None):
    """``fn()``, or TrackingTimeout once the deadline passes (the call goes on in a daemon
    thread, which dies with the process; nothing waits for it)."""
    import threading

    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the caller
            box["error"] = exc

    t = threading.Thread(target=run, name=f"moe-{what}", daemon=True)
    t.start()
    limit = deadline_s() if seconds is None else seconds
    t.join(limit)
    if t.is_alive():
        raise TrackingTimeout(f"{what} did not finish within {limit:.0f} s (${DEADLINE_ENV})")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def client_uri(uri: str) -> str:
    """The URI MLflow itself sees: credentials of an http(s) URI move to MLFLOW_TRACKING_USERNAME /
    MLFLOW_TRACKING_PASSWORD (MLflow's own basic-auth variables, inherited by jobs), so nothing
    MLflow prints or raises ("View run ... at: URL") can carry the password."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https") or "@" not in parts.netloc:
        return uri
    userinfo, host = parts.netloc.rsplit("@", 1)
    user, _, password = userinfo.partition(":")
    from urllib.parse import unquote

    if user:
        os.environ["MLFLOW_TRACKING_USERNAME"] = unquote(user)
    if password:
        os.environ["MLFLOW_TRACKING_PASSWORD"] = unquote(password)
    return urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment))


def mlflow_client(uri: str):
    """An MlflowClient for ``uri`` with bounded HTTP and no credential in the URI it keeps."""
    from mlflow.tracking import MlflowClient

    bound_http()
    return MlflowClient(tracking_uri=client_uri(uri))


class StoreBroken(PipelineError):
    """A local SQLite tracking store that exists but cannot be used (half-migrated, damaged):
    not an unreachable server to spool around, but a file to repair."""


def check_local_store(uri: str, exc: BaseException) -> None:
    if not uri.startswith("sqlite:///"):
        return
    db = Path(uri[len("sqlite:///"):])
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    raise StoreBroken(f"{db}: the MLflow store cannot be used ({redact(first)[:300]}); restore it from a backup, "
                      "run `mlflow db upgrade` on it, or move it away (a new one is created)") from None


def redacted_copy(path: Path) -> Path:
    """``path`` itself, or a copy under a temporary directory with every URI password masked."""
    import tempfile

    text = path.read_text(errors="replace")
    masked = redact(text)
    if masked == text:
        return path
    out = Path(tempfile.mkdtemp(prefix="moe-redacted-")) / path.name
    out.write_text(masked)
    return out


def spool(path: Path, row: dict[str, Any]) -> None:
    from pipeline.outputs import open_for_write

    path.parent.mkdir(parents=True, exist_ok=True)
    with open_for_write(path, append=True) as f:
        f.write(json.dumps(row) + "\n")


def tracking_uri(cfg: MlflowConfig, root: Path | None = None) -> str:
    if cfg.tracking_uri:
        return cfg.tracking_uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    from pipeline.project import project_root

    return f"sqlite:///{project_root(root) / 'mlflow.db'}"


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def git_info() -> dict[str, str]:
    commit = _git("rev-parse", "HEAD")
    if commit is None:
        return {"git.commit": "unknown"}
    status = _git("status", "--porcelain", "--untracked-files=no") or ""
    return {"git.commit": commit, "git.dirty": str(bool(status)).lower(), "git.branch": _git("rev-parse", "--abbrev-ref", "HEAD") or ""}


def pipeline_key(params_path: Path) -> str:
    if os.environ.get("MOE_PIPELINE_KEY"):
        return os.environ["MOE_PIPELINE_KEY"]
    h = hashlib.sha256(params_path.read_bytes() if params_path.is_file() else b"")
    h.update((git_info().get("git.commit") or "").encode())
    return h.hexdigest()[:16]


def _yaml(path: Path) -> dict:
    try:
        return (yaml.safe_load(path.read_text()) or {}) if path.is_file() else {}
    except yaml.YAMLError:
        return {}


def dvc_out_hashes(lock_path: Path = Path("dvc.lock")) -> dict[str, str]:
    """path -> md5 of every stage output recorded in dvc.lock."""
    hashes = {}
    for stage in (_yaml(lock_path).get("stages") or {}).values():
        for out in stage.get("outs") or []:
            if "md5" in out:
                hashes[out["path"]] = out["md5"]
    return hashes


def dvc_dep_tags(stage: str, dvc_yaml: Path = Path("dvc.yaml"), lock_path: Path = Path("dvc.lock")) -> dict[str, str]:
    """``dvc.dep.<path>`` -> md5 for this stage's inputs that earlier stages produced.

    DVC writes a stage's entry in dvc.lock as soon as it finishes, so when a stage starts, the
    hashes of the data it reads are already there."""
    deps = ((_yaml(dvc_yaml).get("stages") or {}).get(stage) or {}).get("deps") or []
    outs = dvc_out_hashes(lock_path)
    return {f"dvc.dep.{d}": outs[d] for d in deps if isinstance(d, str) and d in outs}


def inventory_tags() -> dict[str, str]:
    """Tags from the container image's inventory file, when running inside the image."""
    path = Path(os.environ.get("MOE_IMAGE_INVENTORY", "/opt/moe/inventory.json"))
    if not path.is_file():
        return {}
    try:
        inv = json.loads(path.read_text())
    except ValueError:
        return {}
    tags = {f"image.{k}": str(inv[k])
            for k in ("base_image", "base_image_digest", "python", "torch", "cuda", "nccl", "nvshmem", "lock_sha256") if inv.get(k)}
    if os.environ.get("MOE_IMAGE_DIGEST"):
        tags["container.image_digest"] = os.environ["MOE_IMAGE_DIGEST"]
    return tags


def environment_tags() -> dict[str, str]:
    tags = {"host": socket.gethostname(), "python": platform.python_version()}
    try:
        import torch

        tags["torch"] = torch.__version__
        tags["cuda"] = str(torch.version.cuda)
        if torch.cuda.is_available():
            tags["gpu"] = torch.cuda.get_device_name()
    except ImportError:
        pass
    digest = os.environ.get("MOE_IMAGE_DIGEST")
    inventory = Path(os.environ.get("MOE_IMAGE_INVENTORY", "/opt/moe/inventory.json"))
    if inventory.is_file():
        try:
            inv = json.loads(inventory.read_text())
            digest = digest or inv.get("image_digest")
            for k in ("cuda", "nccl", "nvshmem"):
                if inv.get(k):
                    tags[f"image.{k}"] = str(inv[k])
        except ValueError:
            pass
    if digest:
        tags["container.image_digest"] = digest
    for lock in ("requirements/cpu.lock", "requirements/gpu.lock"):
        if Path(lock).is_file():
            tags[f"lock.{Path(lock).name}"] = hashlib.sha256(Path(lock).read_bytes()).hexdigest()[:16]
    return tags


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, Mapping):
            out.update(flatten(v, key))
        else:
            out[key] = v
    return out


def param_value(value: Any) -> str:
    text = redact(value if isinstance(value, str) else json.dumps(value))
    if len(text) > MAX_PARAM_CHARS:
        digest = hashlib.sha256(text.encode()).hexdigest()[:12]
        suffix = f"...[truncated; sha256 {digest}; full value in params.yaml artifact]"
        text = text[: MAX_PARAM_CHARS - len(suffix)] + suffix
    return text


class Tracker:
    """Creates and writes one stage's nested run through MlflowClient (no global state).

    Best effort: when the tracking server cannot be reached (at the start or mid-run), the
    stage goes on and what it would have sent is spooled to ``fallback`` for
    ``moe mlflow-sync``; an unreachable server at the start gives an ``offline-`` run id that
    the sync creates."""

    def __init__(self, cfg: MlflowConfig, stage: str, params_path: Path = Path("params.yaml"),
                 fallback: Path = STAGE_FALLBACK, parent_name: str | None = None) -> None:
        bound_http()
        self.cfg, self.stage, self.params_path, self.fallback = cfg, stage, params_path, fallback
        self.parent_name = parent_name
        self.uri = tracking_uri(cfg)
        self.failed = False
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
            within_deadline(lambda: self._connect(tags), "MLflow run creation")
        except ModuleNotFoundError:
            raise
        except Exception as exc:  # unreachable or hanging server, database down, bad URI
            check_local_store(self.uri, exc)  # a broken local store is an error, not offline
            self.parent_id = None
            self.run_id = f"{OFFLINE_PREFIX}{uuid.uuid4().hex}"
            self._fail(exc)
            spool(self.fallback, {"run_id": self.run_id, "create": {"experiment": cfg.experiment, "tags": tags}})
        else:
            self._monitor = start_system_metrics(self.uri, self.run_id)

    def _connect(self, tags: dict[str, str]) -> None:
        self.client = mlflow_client(self.uri)
        self.experiment_id = self._experiment()
        self.parent_id = self._parent()
        self.run_id = self.client.create_run(self.experiment_id, tags={"mlflow.parentRunId": self.parent_id, **tags}).info.run_id
        self.client.update_run(self.parent_id, status="RUNNING")

    def _fail(self, exc: BaseException) -> None:
        if not self.failed:
            self.failed = True
            log.warning("MLflow at %s unreachable (%s); continuing; spooling to %s for `moe mlflow-sync`",
                        redact(self.uri), redact(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__),
                        self.fallback)

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
            artifacts = (Path(self.uri[len("sqlite:///"):]).parent / "mlartifacts").resolve().as_uri()
        try:
            return self.client.create_experiment(self.cfg.experiment, artifact_location=artifacts)
        except Exception:  # created concurrently by another process
            return self.client.get_experiment_by_name(self.cfg.experiment).experiment_id

    def _parent(self) -> str:
        key = pipeline_key(self.params_path)
        found = self.client.search_runs(
            [self.experiment_id], filter_string=f"tags.`{PIPELINE_KEY_TAG}` = '{key}' and tags.`moe.stage` = 'pipeline'", max_results=1
        )
        if found:
            return found[0].info.run_id
        tags = {PIPELINE_KEY_TAG: key, "moe.stage": "pipeline",
                "mlflow.runName": self.parent_name or run_name("pipeline", key[:8]), **git_info(),
                **standard_tags("pipeline")}
        run_id = self.client.create_run(self.experiment_id, tags=tags).info.run_id
        if self.params_path.is_file():
            self.client.log_artifact(run_id, str(redacted_copy(self.params_path)))
        # The parent spans the pipeline: RUNNING while a stage runs, ended (with the pipeline's
        # final metrics and plots) by each stage that finishes, FAILED if one fails.
        return run_id

    def log_params(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        values = {k: param_value(v) for k, v in sorted(params.items())}
        items = [Param(k, v) for k, v in values.items()]

        def send():
            for i in range(0, len(items), MAX_PARAMS_PER_BATCH):
                self.client.log_batch(self.run_id, params=items[i : i + MAX_PARAMS_PER_BATCH])

        self._send(send, {"params": values})

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        finite = {k: float(v) for k, v in metrics.items() if _finite(v)}
        items = [Metric(k, v, now, step or 0) for k, v in finite.items()]

        def send():
            for i in range(0, len(items), MAX_METRICS_PER_BATCH):
                self.client.log_batch(self.run_id, metrics=items[i : i + MAX_METRICS_PER_BATCH])

        self._send(send, {"step": step or 0, "metrics": finite})

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
            sent = redacted_copy(path) if path.suffix in (".yaml", ".yml", ".lock", ".json", ".txt", ".jsonl") else path
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

    def stop_system_metrics(self) -> None:
        """For a run this process hands over (``moe submit`` without --wait: the job ends it)."""
        if self._monitor is not None:
            with contextlib.suppress(Exception):
                within_deadline(self._monitor.finish, "system metrics", seconds=min(10.0, deadline_s()))
            self._monitor = None


def run_name(stage: str, suffix: str | None = None) -> str:
    """``stage`` (or ``stage-suffix``), followed by the DVC experiment's name when DVC runs one."""
    name = f"{stage}-{suffix}" if suffix else stage
    exp = os.environ.get("DVC_EXP_NAME")
    return f"{name} ({exp})" if exp else name


def standard_tags(stage: str) -> dict[str, str]:
    """MLflow's own source, git and user tags (what its UI shows in the run's header)."""
    import getpass

    tags = {"mlflow.source.type": "LOCAL", "mlflow.source.name": f"moe {stage}"}
    with contextlib.suppress(KeyError, OSError):
        tags["mlflow.user"] = getpass.getuser()
    info = git_info()
    if info.get("git.commit", "unknown") != "unknown":
        tags["mlflow.source.git.commit"] = info["git.commit"]
        if info.get("git.branch"):
            tags["mlflow.source.git.branch"] = info["git.branch"]
        remote = _git("remote", "get-url", "origin")
        if remote and "@" not in remote.split("//", 1)[-1].split("/", 1)[0]:  # never a URL with credentials
            tags["mlflow.source.git.repoURL"] = remote
    if os.environ.get("DVC_EXP_NAME"):
        tags["dvc.exp_name"] = os.environ["DVC_EXP_NAME"]
    if os.environ.get("DVC_EXP_BASELINE_REV"):
        tags["dvc.exp_baseline_rev"] = os.environ["DVC_EXP_BASELINE_REV"]
    return tags


def start_system_metrics(uri: str, run_id: str):
    """MLflow's system metrics monitor (CPU, memory, disk, network; GPUs through nvidia-ml-py
    where installed) on this run; None where psutil is missing."""
    try:
        import psutil  # noqa: F401
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        monitor = SystemMetricsMonitor(run_id, sampling_interval=float(os.environ.get("MOE_SYSTEM_METRICS_INTERVAL", "2")),
                                       samples_before_logging=1, tracking_uri=client_uri(uri))
        monitor.start()
        return monitor
    except Exception as exc:  # never fail a stage for its telemetry
        log.info("no system metrics: %s", exc)
        return None


def log_dataset(client, run_id: str, name: str, path: str | Path, digest: str, context: str) -> None:
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.entities import DatasetInput, InputTag

    source = resolve_dataset_source(str(Path(path).resolve()))
    dataset = MetaDataset(source=source, name=name, digest=digest[:36])
    client.log_inputs(run_id, datasets=[DatasetInput(dataset._to_mlflow_entity(), tags=[InputTag("mlflow.data.context", context)])])


FINAL_METRICS = {"train": Path("metrics/train.json"), "eval": Path("metrics/eval.json")}
PLOTS_DIR = Path("plots")


def finish_parent(client, parent_id: str) -> None:
    """The pipeline's parent run: its final metrics (metrics/*.json) and plots, ended now."""
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    items = []
    for prefix, path in FINAL_METRICS.items():
        try:
            data = json.loads(path.read_text()) if path.is_file() else {}
        except ValueError:
            data = {}
        items += [Metric(f"{prefix}/{k}", float(v), now, 0) for k, v in data.items() if _finite(v) and not isinstance(v, bool)]
    for i in range(0, len(items), MAX_METRICS_PER_BATCH):
        client.log_batch(parent_id, metrics=items[i : i + MAX_METRICS_PER_BATCH])
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


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(float(v))


class MlflowSink:
    """A trainer metrics sink (rank 0) writing to an existing run.

    Metrics are buffered and sent with log_batch at every full log point (and every
    ``flush_every`` entries). If the tracking server cannot be reached, training goes on:
    the entries are appended to ``fallback`` (JSON lines) for a later ``moe mlflow-sync``.
    """

    def __init__(self, uri: str, run_id: str, fallback: Path, flush_every: int = 50) -> None:
        self.uri, self.run_id, self.fallback, self.flush_every = uri, run_id, fallback, flush_every
        self.buffer: list[tuple[int, dict[str, float]]] = []
        self.failed = run_id.startswith(OFFLINE_PREFIX)  # the server was unreachable at the start
        self._client = None
        bound_http()

    def _get_client(self):
        if self._client is None:
            self._client = mlflow_client(self.uri)
        return self._client

    def log(self, step: int, metrics: dict[str, float]) -> None:
        # Per-expert loads go to the heatmap artifact, not one metric per expert.
        self.buffer.append((step, {k: v for k, v in metrics.items() if _finite(v) and not k.startswith("expert_load/")}))
        if "lr" in metrics or len(self.buffer) >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        if not self.buffer:
            return
        batch, self.buffer = self.buffer, []
        if not self.failed:
            try:
                from mlflow.entities import Metric

                now = int(time.time() * 1000)
                items = [Metric(k, float(v), now, step) for step, m in batch for k, v in m.items()]

                def send() -> None:
                    for i in range(0, len(items), MAX_METRICS_PER_BATCH):
                        self._get_client().log_batch(self.run_id, metrics=items[i : i + MAX_METRICS_PER_BATCH])

                within_deadline(send, "MLflow metrics")
                return
            except Exception as exc:  # network, server or database down: keep training
                self.failed = True
                log.warning("MLflow unreachable (%s); metrics go to %s for `moe mlflow-sync`", redact(str(exc)), self.fallback)
        for step, m in batch:
            spool(self.fallback, {"run_id": self.run_id, "uri": redact(self.uri), "step": step, "metrics": m})

    def set_tags(self, tags: Mapping[str, str]) -> None:
        if not tags or self.failed:
            return
        try:
            within_deadline(lambda: [self._get_client().set_tag(self.run_id, k, redact(str(v))) for k, v in tags.items()],
                            "MLflow tags")
        except Exception as exc:  # keep training without tracking
            self.failed = True
            log.warning("MLflow unreachable (%s); continuing without tags", redact(str(exc)))

    def close(self, summary: dict[str, Any]) -> None:
        self.flush()


def check_spooled_runs_exist(client, rows: list[dict[str, Any]], uri: str) -> None:
    """Every run a spool writes to (but those it creates) is in the target store: a sync against
    another store must fail, not report "uploaded 0" and mark the spool synced."""
    created = {r["run_id"] for r in rows if "create" in r}
    for run_id in sorted({r.get("run_id") for r in rows} - created):
        if not isinstance(run_id, str) or run_id.startswith(OFFLINE_PREFIX):
            continue
        try:
            client.get_run(run_id)
        except Exception:
            recorded = next((r["uri"] for r in rows if r.get("run_id") == run_id and r.get("uri")), None)
            where = f"; the spool was written for {recorded}" if recorded else ""
            raise PipelineError(f"run {run_id} is not in {redact(uri)}{where}: sync against the store it was created in "
                                "(run `moe mlflow-sync` from the project directory, or set MLFLOW_TRACKING_URI); "
                                "nothing was uploaded and the spool is kept") from None


def sync_fallback(paths: Path | list[Path], uri: str) -> int:
    """Send what jobs and stages spooled (metrics, params, tags, final status; runs created
    offline) to the tracking server; rename each file ``*.synced`` after. Returns the number
    of metric values sent."""
    from mlflow.entities import Metric, Param

    files = [p for p in ([paths] if isinstance(paths, Path) else paths) if p.is_file()]
    if not files:
        return 0
    rows = []
    for path in files:
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    raise PipelineError(f"{path}:{lineno}: not a JSON line; fix or remove it and sync again") from None
    client = mlflow_client(uri)
    check_spooled_runs_exist(client, rows, uri)
    ids: dict[str, str] = {}
    for row in rows:  # runs that were created offline first
        if "create" in row:
            name = row["create"].get("experiment", "moe")
            exp = client.get_experiment_by_name(name)
            exp_id = exp.experiment_id if exp else client.create_experiment(name)
            ids[row["run_id"]] = client.create_run(exp_id, tags={**row["create"].get("tags", {}), "moe.synced_from": row["run_id"]}).info.run_id
    now = int(time.time() * 1000)
    metrics: dict[str, list] = {}
    n = 0
    for row in rows:
        run_id = ids.get(row["run_id"], row["run_id"])
        if run_id.startswith(OFFLINE_PREFIX):
            continue  # its creation row was lost; nothing to attach it to
        if "metrics" in row:
            metrics.setdefault(run_id, []).extend(Metric(k, float(v), now, row.get("step", 0)) for k, v in row["metrics"].items())
        if "params" in row:
            items = [Param(k, v) for k, v in row["params"].items()]
            for i in range(0, len(items), MAX_PARAMS_PER_BATCH):
                client.log_batch(run_id, params=items[i : i + MAX_PARAMS_PER_BATCH])
        for k, v in (row.get("tags") or {}).items():
            client.set_tag(run_id, k, v)
    for run_id, items in metrics.items():
        for i in range(0, len(items), MAX_METRICS_PER_BATCH):
            client.log_batch(run_id, metrics=items[i : i + MAX_METRICS_PER_BATCH])
        n += len(items)
    for row in rows:
        if "status" in row:
            run_id = ids.get(row["run_id"], row["run_id"])
            if not run_id.startswith(OFFLINE_PREFIX):
                client.set_terminated(run_id, row["status"])
    for path in files:
        path.rename(path.with_suffix(path.suffix + ".synced"))
    return n
