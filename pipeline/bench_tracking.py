"""Benchmark results into MLflow (experiment "bench"): one run per JSON file from bench/results.

Benchmarks run on GPU machines that may not have MLflow; they always write JSON, and
`moe bench log bench/results/*.json` (or the `moe bench ...` commands themselves, when MLflow
is importable) records them: environment as tags, config as params, every numeric result as
a metric named <row label>/<field> (a GiB figure by its name now, ``*_gib``, older files' too)."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from moe.reader import AnyOf, Bool, FileFormatError, List, Map, Nullable, Num, Plain, Str, parse_json_object, read_text
from pipeline.errors import PipelineError
from pipeline.params import MlflowConfig
from pipeline.tracking.client import mlflow_client, name_problem, tracking_uri, within_deadline
from pipeline.tracking.provenance import flatten
from pipeline.tracking.stage_run import Tracker
from pipeline.units import GIB_NAME

ROW_LABELS = ("shape", "layout", "layers", "peer")


def _row_label(row: dict[str, Any], index: int) -> str:
    parts = [str(row[k]) for k in ROW_LABELS if k in row]
    label = "/".join(parts) if parts else f"row{index}"
    return "".join(ch if ch.isalnum() or ch in "._-/ " else "_" for ch in label)


def result_rows(payload: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(where, row) of every result row: ``results[i]``, or the one ``result``."""
    if payload.get("results"):
        return [(f"results[{i}]", row) for i, row in enumerate(payload["results"])]
    return [("result", payload["result"])] if "result" in payload else []


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def result_metrics(payload: dict[str, Any]) -> dict[str, float]:
    metrics: dict[str, float] = {}
    for i, (_, row) in enumerate(result_rows(payload)):
        label = _row_label(row, i)
        for k, v in row.items():
            if is_number(v):
                metrics[f"{label}/{GIB_NAME.get(k, k)}"] = float(v)  # a GiB figure by its name now (older files: *_gb)
    if is_number(payload.get("matmul_peak_tflops")):
        metrics["matmul_peak_tflops"] = float(payload["matmul_peak_tflops"])
    return metrics


def metric_problems(payload: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(field, what is wrong) for every value that should be a metric and is not one: a number
    written as text, a number that is not finite, or a text where the same field of another row
    holds a number. A field that holds text in every row (shape, recipe, note) is a label, not a
    metric: the result file itself is the run's artifact."""
    rows = result_rows(payload)
    numeric = {k for _, row in rows for k, v in row.items() if is_number(v)}
    fields = [(f"{where}.{k}", v, k in numeric) for where, row in rows for k, v in row.items()]
    for field, v, is_metric in [*fields, ("matmul_peak_tflops", payload.get("matmul_peak_tflops"), True)]:
        if isinstance(v, str) and _reads_as_number(v):
            yield field, f"is {v[:40]!r}, a number written as text (a metric is a JSON number)"
        elif is_number(v) and not math.isfinite(v):
            yield field, "is not a finite number"
        elif is_metric and v is not None and not is_number(v):
            yield field, f"is {str(v)[:40]!r}, not a number (a metric: the field holds numbers in the file)"


def _reads_as_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def name_problems(payload: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(field, why) for every metric, param and tag name MLflow would refuse: checked before a run
    is made, so a refused name is an error naming its field, not a run left half written."""
    for i, (where, row) in enumerate(result_rows(payload)):
        label = _row_label(row, i)
        for k, v in row.items():
            if is_number(v) and (why := name_problem(f"{label}/{GIB_NAME.get(k, k)}")):
                yield f"{where}.{k}", f"names the metric '{label}/{k}', which {why}"
    for k in flatten(payload.get("config", {})):
        if why := name_problem(k):
            yield f"config.{k}", f"names a param that {why}"
    for k in payload.get("environment", {}):
        if why := name_problem(f"bench.{k}"):
            yield f"environment.{k}", f"names a tag that {why}"


def logged_run(uri: str, experiment: str, sha256: str) -> str | None:
    """The run that already holds the result file with this content, if any. None too when the
    store cannot be asked: the run is then made by a Tracker, which goes offline as every stage
    does (one warning naming the server, the run spooled for `moe mlflow-sync`)."""

    def find() -> str | None:
        client = mlflow_client(uri)
        exp = client.get_experiment_by_name(experiment)
        if exp is None:
            return None
        found = client.search_runs([exp.experiment_id], filter_string=f"tags.`bench.file_sha256` = '{sha256}'", max_results=1)
        return found[0].info.run_id if found else None

    try:
        return within_deadline(find, "MLflow lookup")
    except ModuleNotFoundError:
        raise
    except Exception:  # unreachable or hanging server, broken store: the Tracker tells which
        return None


RESULT_LIMIT = 64 << 20
# A bench/results file (bench/common.py write_result): the fields `moe bench log` reads, typed;
# each benchmark's own fields (losses, step_times_s, sweeps, ...) are free-form by design (the
# file itself is the run's artifact). Which row fields are metrics, and MLflow's name rules,
# are checked next (metric_problems, name_problems): a figure written as text is named there.
_ROW = Map(other=Plain(), max_keys=10_000)
BENCH_RESULT_SCHEMA = Map(
    optional={
        "benchmark": Str(256),
        "environment": Map(other=Nullable(AnyOf((Str(4096), Num(), Bool()), "text, a number or true/false")), max_keys=1000),
        "config": Map(other=Plain(), max_keys=10_000),
        "mlflow": Map(optional={"experiment": Nullable(Str(500))}, other=Plain()),
        "result": _ROW,
        "results": Nullable(List(_ROW, max_len=100_000)),
        "curves": Nullable(Map(other=List(List(Num(), min_len=2, max_len=2), max_len=10_000_000), max_keys=1000)),
        "artifacts": List(Str(4096), max_len=1000),
        "matmul_peak_tflops": Plain(),  # a figure; text here is named by metric_problems
    },
    other=Plain(),
)


def load_result(path: Path) -> tuple[bytes, dict[str, Any]]:
    """A benchmark result file, checked for everything ``log_result`` reads (one error naming
    the file and the field). ``artifacts`` are looked up by file name in the result's own
    folder: a result file never makes us upload a file from anywhere else."""

    def bad(what: str) -> PipelineError:
        return PipelineError(f"{path}: {what} (not a bench/results JSON file)")

    path = Path(path)
    try:
        text = read_text(path, RESULT_LIMIT)
        payload = parse_json_object(text, str(path))
    except FileFormatError as exc:  # not a regular file, too large, not UTF-8, not JSON, not an object
        raise bad(str(exc).removeprefix(f"{path}: ")) from None
    try:
        payload = BENCH_RESULT_SCHEMA.check(payload)
    except FileFormatError as exc:
        raise bad(str(exc)) from None
    experiment = (payload.get("mlflow") or {}).get("experiment")
    if experiment is not None and not experiment.strip():
        raise bad("mlflow.experiment: expected a name (1 to 500 characters), got a blank")
    for a in payload.get("artifacts", []):
        if not Path(a).name:
            raise bad(f"artifacts: expected file names, got {a!r}")
        local = path.parent / Path(a).name
        if local.is_symlink() or not local.is_file():
            raise bad(f"artifacts names {Path(a).name}, which is not a file beside it")
    for field, what in (*metric_problems(payload), *name_problems(payload)):
        raise PipelineError(f"{path}: {field} {what}; nothing was logged")
    if not result_metrics(payload) and not payload.get("curves"):
        raise PipelineError(f"{path}: the file holds no number to log ({_no_metrics_hint(payload)}); nothing was logged")
    return text.encode(), payload  # (UTF-8 back to the very bytes read: the file's digest)


def _no_metrics_hint(payload: dict[str, Any]) -> str:
    rows = result_rows(payload)
    if not rows:
        return "no result or results rows, matmul_peak_tflops or curves"
    texts = [f"{where}.{k}" for where, row in rows for k in row if k not in ROW_LABELS]
    if not texts:
        return "its rows hold labels only"
    more = " ..." if len(texts) > 6 else ""
    return f"its rows hold no number: {', '.join(texts[:6])}{more} are not numbers"


def log_result(path: Path, experiment: str | None = None) -> tuple[str, bool]:
    """(run id, whether a run was created): a file already logged (same content) is not logged again.
    The payload may name its experiment (``mlflow.experiment``), list ``artifacts`` (a plot beside
    it) and carry ``curves`` (name -> [[step, value], ...]): each becomes a child run with its history."""
    data, payload = load_result(Path(path))
    sha256 = hashlib.sha256(data).hexdigest()
    experiment = experiment or (payload.get("mlflow") or {}).get("experiment") or "bench"
    existing = logged_run(tracking_uri(MlflowConfig(experiment=experiment)), experiment, sha256)
    if existing:
        return existing, False
    tracker = Tracker(MlflowConfig(experiment=experiment), f"bench:{payload.get('benchmark', 'unknown')}", Path("params.yaml"))
    env = payload.get("environment", {})
    tracker.set_tags({f"bench.{k}": v for k, v in env.items() if v is not None})
    tracker.set_tags({"bench.file": Path(path).name, "bench.file_sha256": sha256})
    tracker.log_params(flatten(payload.get("config", {})))
    tracker.log_metrics(result_metrics(payload))
    tracker.log_artifact(path)
    for artifact in payload.get("artifacts", []):
        tracker.log_artifact(Path(path).parent / Path(artifact).name)
    for name, curve in (payload.get("curves") or {}).items():
        log_curve(tracker, name, curve, env)
    tracker.end(ok=True)
    return tracker.run_id, True


def log_curve(tracker: Tracker, name: str, curve: list[list[float]], env: dict[str, Any]) -> None:
    """One curve as a child run of the result's run: tag ``recipe`` = its name, metric ``loss`` per step."""
    if tracker.failed:
        return
    import time

    from mlflow.entities import Metric

    from pipeline.tracking.client import log_batched

    client = tracker.client
    run_id = client.create_run(
        tracker.experiment_id,
        run_name=f"{tracker.stage}-{name}",
        tags={"mlflow.parentRunId": tracker.run_id, "recipe": name, "device": str(env.get("device"))},
    ).info.run_id
    now = int(time.time() * 1000)
    log_batched(client, run_id, metrics=[Metric("loss", float(v), now, int(s)) for s, v in curve])
    client.set_terminated(run_id)
