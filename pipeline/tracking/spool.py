"""The offline spool: what a stage or job could not send, appended as JSON lines, and
`moe mlflow-sync`, which sends it later (creating the runs that could not be created).

A sync is all or nothing up to the network: every row is checked first (its fields, types,
finite numbers, MLflow's name rules and lengths; a param that would change a stored value),
and nothing is sent while one row is bad. Sending is idempotent, so a sync the server broke off
is run again to completion: a run created offline is found again by its ``moe.synced_from``
tag, params and tags are set again to the same values, and a metric value already in the store
(same key, step and timestamp: a value keeps its spooled timestamp) is not sent twice."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from moe.reader import FileFormatError, parse_json, read_text
from pipeline.errors import PipelineError
from pipeline.redact import redact
from pipeline.tracking.client import log_batched, mlflow_client, name_problem

STAGE_FALLBACK = Path("mlflow-fallback.jsonl")
OFFLINE_PREFIX = "offline-"
MAX_ROW_BYTES = 16 << 20  # a params row of the longest values is a few MB; more is not a spool row
MAX_SPOOL_BYTES = 1 << 30  # a long run spooled offline: some 1 kB a logged step
ROW_FIELDS = frozenset({"run_id", "time_ms", "uri", "create", "step", "metrics", "params", "tags", "status", "abandoned"})
ACTIONS = ("create", "metrics", "params", "tags", "status", "abandoned")
RUN_STATUSES = ("RUNNING", "SCHEDULED", "FINISHED", "FAILED", "KILLED")
INT64 = 1 << 63


def spool(path: Path, row: dict[str, Any]) -> None:
    from pipeline.outputs import open_for_write

    path.parent.mkdir(parents=True, exist_ok=True)
    with open_for_write(path, append=True) as f:  # its time: a rerun of the sync sends the same value, deduplicated
        f.write(json.dumps({"time_ms": int(time.time() * 1000), **row}) + "\n")


# ------------------------------------------------------------------------------ reading


@dataclasses.dataclass(frozen=True)
class SpoolRow:
    where: str  # path:line, for the error that names it
    row: dict[str, Any]
    stamp: int  # the timestamp (ms) its metric values are sent with


class BadField(ValueError):
    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field} {problem}")


def read_spool(paths: list[Path]) -> list[SpoolRow]:
    """Every row of the spool files, each checked against the spool's schema; the first bad one
    is an error naming its file, line and field (nothing has been sent)."""
    rows = []
    for path in paths:
        stamp = int(path.stat().st_mtime * 1000)
        for lineno, line in _lines(path):
            where = f"{path}:{lineno}"
            try:
                row = parse_row(line)
            except BadField as exc:
                raise PipelineError(f"{where}: {exc}; nothing was uploaded and the spool is kept: fix or remove that line and sync again") from None
            rows.append(SpoolRow(where, row, row.get("time_ms", stamp)))
    return rows


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, line) of every non-blank line; the file and each line bounded."""
    try:
        text = read_text(path, MAX_SPOOL_BYTES)
    except FileFormatError as exc:  # not a regular file, too large, not UTF-8
        raise PipelineError(f"{exc} (not a spool); nothing was uploaded and the spool is kept") from None
    for lineno, line in enumerate(text.split("\n"), 1):  # (as written: one row a line, nothing else splits one)
        if len(line) > MAX_ROW_BYTES:
            raise PipelineError(f"{path}:{lineno}: the line is longer than {MAX_ROW_BYTES >> 20} MiB (not a spool row)")
        if line.strip():
            yield lineno, line


def parse_row(line: str) -> dict[str, Any]:
    """One spool line as a checked row (BadField names the field at fault)."""
    try:
        row = parse_json(line, "the line")  # (NaN and Infinity are not JSON: a spooled figure is finite)
    except FileFormatError as exc:
        raise BadField("the line", f"is {str(exc).removeprefix('the line: ').replace('not valid JSON', 'not JSON', 1)[:120]}") from None
    if not isinstance(row, dict):
        raise BadField("the line", f"is a JSON {type(row).__name__}, not an object")
    unknown = sorted(set(row) - ROW_FIELDS)
    if unknown:
        raise BadField(repr(unknown[0])[:80], "is not a field of a spool row")
    _check_run_id(row.get("run_id"))
    if not any(k in row for k in ACTIONS):
        raise BadField("the row", f"holds none of {', '.join(ACTIONS)}")
    if "time_ms" in row:
        _check_int("time_ms", row["time_ms"], low=0, what="a time in ms since 1970")
    if "uri" in row and not isinstance(row["uri"], str):
        raise BadField("uri", "is not a string")
    if "step" in row:
        _check_int("step", row["step"], low=-INT64, what="an integer step")
    if "create" in row:
        _check_create(row["create"])
    for field, check in (("metrics", _check_metric), ("params", _check_param), ("tags", _check_tag)):
        if field in row:
            _check_entries(field, row[field], check)
    if "status" in row and row["status"] not in RUN_STATUSES:
        raise BadField("status", f"is {_shown(row['status'])}, not one of {', '.join(RUN_STATUSES)}")
    if "abandoned" in row and row["abandoned"] is not True:
        raise BadField("abandoned", "is not true")
    return row


def _shown(value: Any) -> str:
    return redact(repr(value))[:80]


def _check_run_id(run_id: Any) -> None:
    import re

    if not isinstance(run_id, str) or not re.fullmatch(r"[A-Za-z0-9][\w\-]{0,255}", run_id):
        raise BadField("run_id", f"is {_shown(run_id)}, not a run id")


def _check_int(field: str, value: Any, low: int, what: str) -> None:
    if type(value) is not int or not low <= value < INT64:
        raise BadField(field, f"is {_shown(value)}, not {what}")


def _check_create(create: Any) -> None:
    from mlflow.utils.validation import MAX_EXPERIMENT_NAME_LENGTH

    if not isinstance(create, dict) or set(create) - {"experiment", "tags"}:
        raise BadField("create", "is not an object of experiment and tags")
    name = create.get("experiment", "moe")
    if not isinstance(name, str) or not name.strip() or len(name) > MAX_EXPERIMENT_NAME_LENGTH:
        raise BadField("create.experiment", f"is {_shown(name)}, not an experiment name")
    _check_entries("create.tags", create.get("tags", {}), _check_tag)


def _check_entries(field: str, entries: Any, check) -> None:
    """Every ``key: value`` of a metrics, params or tags object: a name MLflow takes, a value ``check`` takes."""
    if not isinstance(entries, dict):
        raise BadField(field, "is not an object")
    for key, value in entries.items():
        problem = name_problem(key)
        if problem:
            raise BadField(f"{field}.{key[:80]}", problem)
        problem = check(value)
        if problem:
            raise BadField(f"{field}.{key}", f"is {_shown(value)}, {problem}")


def _check_metric(value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return "not a finite number"
    return None


def _check_param(value: Any) -> str | None:
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

    if not isinstance(value, str) or len(value) > MAX_PARAM_VAL_LENGTH:
        return f"not a string of at most {MAX_PARAM_VAL_LENGTH} characters"
    return None


def _check_tag(value: Any) -> str | None:
    return None if isinstance(value, str) else "not a string"  # a long one MLflow cuts, as when sent live


# ------------------------------------------------------------------------------ planning


@dataclasses.dataclass
class RunUpload:
    """What the spool holds for one run, its rows merged in order."""

    spooled_id: str
    spooled_uri: str | None = None  # the store it was written for (redacted), to name in an error
    create: dict[str, Any] | None = None
    params: dict[str, tuple[str, str]] = dataclasses.field(default_factory=dict)  # key -> (value, where)
    tags: dict[str, str] = dataclasses.field(default_factory=dict)
    metrics: dict[tuple[str, int, int], float] = dataclasses.field(default_factory=dict)  # (key, step, ms) -> value
    status: str | None = None


def plan_uploads(rows: list[SpoolRow]) -> list[RunUpload]:
    """One upload per run (a refused command's abandoned run left out), checked for values that
    contradict each other and for an offline run whose creation is missing."""
    abandoned = {r.row["run_id"] for r in rows if r.row.get("abandoned")}
    runs: dict[str, RunUpload] = {}
    for r in rows:
        if r.row["run_id"] in abandoned:
            continue
        run = runs.setdefault(r.row["run_id"], RunUpload(r.row["run_id"]))
        _merge(run, r)
    orphans = sorted(i for i, run in runs.items() if i.startswith(OFFLINE_PREFIX) and run.create is None)
    if orphans:
        raise PipelineError(
            f"the spool holds values of run {orphans[0]}, created offline, but not its creation row: nothing was uploaded "
            "and the spool is kept (remove that run's rows to send the rest)"
        )
    return list(runs.values())


def _merge(run: RunUpload, r: SpoolRow) -> None:
    row = r.row
    run.spooled_uri = run.spooled_uri or row.get("uri")
    if "create" in row and run.create is None:
        run.create = row["create"]
    for key, value in (row.get("params") or {}).items():
        earlier = run.params.setdefault(key, (value, r.where))
        if earlier[0] != value:
            raise PipelineError(
                f"{r.where}: params.{key} is {_shown(value)}, but {earlier[1]} gave it {_shown(earlier[0])} "
                "(MLflow keeps one value per param): nothing was uploaded and the spool is kept"
            )
    run.tags.update(row.get("tags") or {})
    step = row.get("step", 0)
    for key, value in (row.get("metrics") or {}).items():
        run.metrics.setdefault((key, step, r.stamp), float(value))
    if "status" in row:
        run.status = row["status"]


def resolve_runs(client, runs: list[RunUpload], uri: str) -> dict[str, Any]:
    """spooled run id -> the store's run (None: created offline, not yet synced). Reads only:
    every run written to exists and is active, and no spooled param would change a stored one
    (a sync against another store fails here, not half way)."""
    found = {}
    for run in runs:
        if run.create is not None:
            found[run.spooled_id] = _synced_run(client, run)
            continue
        try:
            stored = client.get_run(run.spooled_id)
        except Exception as exc:
            if getattr(exc, "error_code", None) != "RESOURCE_DOES_NOT_EXIST":
                raise  # the store is down, not without the run: the caller says sync again later
            written_for = f"; the spool was written for {redact(run.spooled_uri)}" if run.spooled_uri else ""
            raise PipelineError(
                f"run {run.spooled_id} is not in {redact(uri)}{written_for}: sync against the store it was created in "
                "(run `moe mlflow-sync` from the project directory, or set MLFLOW_TRACKING_URI); "
                "nothing was uploaded and the spool is kept"
            ) from None
        if stored.info.lifecycle_stage == "deleted":
            raise PipelineError(f"run {run.spooled_id} was deleted in {redact(uri)}: nothing was uploaded and the spool is kept")
        found[run.spooled_id] = stored
    for run in runs:
        _check_params_unchanged(run, found[run.spooled_id])
    return found


def _synced_run(client, run: RunUpload):
    """The store's run for a run created offline that an earlier sync made, or None."""
    exp = client.get_experiment_by_name(run.create.get("experiment", "moe"))
    if exp is None:
        return None
    hits = client.search_runs([exp.experiment_id], filter_string=f"tags.`moe.synced_from` = '{run.spooled_id}'", max_results=1)
    return hits[0] if hits else None


def _check_params_unchanged(run: RunUpload, stored) -> None:
    if stored is None:
        return
    for key, (value, where) in run.params.items():
        if stored.data.params.get(key, value) != value:
            raise PipelineError(
                f"{where}: params.{key} is {_shown(value)}, but run {stored.info.run_id} holds {_shown(stored.data.params[key])} "
                "(MLflow keeps one value per param): nothing was uploaded and the spool is kept"
            )


# ------------------------------------------------------------------------------ sending


def upload_run(client, run: RunUpload, stored) -> int:
    """Send one run's values, skipping what the store holds already; the number of metric values sent."""
    from mlflow.entities import Metric, Param, RunTag

    if stored is None:
        name = run.create.get("experiment", "moe")
        exp = client.get_experiment_by_name(name)
        exp_id = exp.experiment_id if exp else client.create_experiment(name)
        tags = {**run.create.get("tags", {}), "moe.synced_from": run.spooled_id}
        stored = client.get_run(client.create_run(exp_id, tags=tags).info.run_id)
    run_id = stored.info.run_id
    params = [Param(k, v) for k, (v, _) in run.params.items() if k not in stored.data.params]
    tags = [RunTag(k, v) for k, v in run.tags.items() if stored.data.tags.get(k) != v]
    landed = _landed_metrics(client, run_id, {k for k, _, _ in run.metrics}, stored)
    metrics = [Metric(k, v, ms, step) for (k, step, ms), v in run.metrics.items() if (k, step, ms) not in landed]
    log_batched(client, run_id, params=params, tags=tags, metrics=metrics)
    if run.status is not None and stored.info.status != run.status:
        client.set_terminated(run_id, run.status)
    return len(metrics)


def _landed_metrics(client, run_id: str, keys: set[str], stored) -> set[tuple[str, int, int]]:
    """(key, step, timestamp) of the values of ``keys`` the run holds already (an earlier sync's)."""
    landed = set()
    for key in sorted(keys & set(stored.data.metrics)):
        landed.update((key, m.step, m.timestamp) for m in client.get_metric_history(run_id, key))
    return landed


def sync_fallback(paths: Path | list[Path], uri: str) -> int:
    """Send what jobs and stages spooled (metrics, params, tags, final status; runs created
    offline) to the tracking server; rename each file ``*.synced`` once every value is in the
    store. Returns the number of metric values sent by this call (a rerun after a broken-off
    sync sends only the rest)."""
    files = [p for p in ([paths] if isinstance(paths, Path) else paths) if p.is_file()]
    if not files:
        return 0
    runs = plan_uploads(read_spool(files))
    client = mlflow_client(uri)
    stored = resolve_runs(client, runs, uri)
    sent = sum(upload_run(client, run, stored[run.spooled_id]) for run in runs)
    for path in files:
        path.rename(path.with_suffix(path.suffix + ".synced"))
    return sent
