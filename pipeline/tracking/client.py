"""Talking to an MLflow tracking store without ever holding up a run or leaking a password.

Bounded HTTP retries and timeouts, a total deadline on every call (a server that answers one
byte every few seconds never trips a read timeout), credentials moved out of the URIs MLflow
keeps, a broken local store told apart from an unreachable server, and the one batching loop
every writer uses.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline.errors import PipelineError
from pipeline.params import MlflowConfig
from pipeline.redact import redact, userinfo_end

MAX_PARAMS_PER_BATCH = 100
MAX_METRICS_PER_BATCH = 1000

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
    MLflow prints or raises ("View run ... at: URL") can carry the password. The userinfo is
    found as ``redact`` finds it, so a password holding ``/`` or ``@`` moves whole."""
    from urllib.parse import unquote

    scheme, sep, rest = uri.partition("://")
    at = userinfo_end(rest) if sep and scheme.lower() in ("http", "https") else -1
    if at < 0:
        return uri
    user, _, password = rest[:at].partition(":")
    if user:
        os.environ["MLFLOW_TRACKING_USERNAME"] = unquote(user)
    if password:
        os.environ["MLFLOW_TRACKING_PASSWORD"] = unquote(password)
    return f"{scheme}{sep}{rest[at + 1 :]}"


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
    db = Path(uri[len("sqlite:///") :])
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    raise StoreBroken(
        f"{db}: the MLflow store cannot be used ({redact(first)[:300]}); restore it from a backup, "
        "run `mlflow db upgrade` on it, or move it away (a new one is created)"
    ) from None


def tracking_uri(cfg: MlflowConfig, root: Path | None = None) -> str:
    if cfg.tracking_uri:
        return cfg.tracking_uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    from pipeline.project import project_root

    return f"sqlite:///{project_root(root) / 'mlflow.db'}"


def log_batched(client, run_id: str, metrics: Sequence[Any] = (), params: Sequence[Any] = (), tags: Sequence[Any] = ()) -> None:
    """Metrics, params and tags in MLflow's batch sizes (the one loop every writer goes through)."""
    for i in range(0, len(params), MAX_PARAMS_PER_BATCH):
        client.log_batch(run_id, params=list(params[i : i + MAX_PARAMS_PER_BATCH]))
    for i in range(0, len(tags), MAX_PARAMS_PER_BATCH):
        client.log_batch(run_id, tags=list(tags[i : i + MAX_PARAMS_PER_BATCH]))
    for i in range(0, len(metrics), MAX_METRICS_PER_BATCH):
        client.log_batch(run_id, metrics=list(metrics[i : i + MAX_METRICS_PER_BATCH]))


@functools.lru_cache(maxsize=4096)  # a spool names the same few keys on every row
def name_problem(name: str) -> str | None:
    """Why MLflow would refuse ``name`` as a metric, param or tag key (None: it takes it). Checked
    before anything is sent, so a refusal is an error naming the key, not a run left half written."""
    from mlflow.utils.validation import MAX_ENTITY_KEY_LENGTH, path_not_unique, validate_param_and_metric_name

    if not name or len(name) > MAX_ENTITY_KEY_LENGTH:
        return f"is not 1 to {MAX_ENTITY_KEY_LENGTH} characters long"
    if not validate_param_and_metric_name(name):
        return "holds a character MLflow refuses in a name (it takes letters, digits and _ - . : / space)"
    if path_not_unique(name):
        return "reads as another name as a path (MLflow refuses a leading / or .., // , /./ or a trailing /)"
    return None


def finite(v: Any) -> bool:
    import math

    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))
