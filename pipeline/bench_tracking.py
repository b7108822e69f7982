"""Benchmark results into MLflow (experiment "bench"): one run per JSON file from bench/results.

Benchmarks run on GPU machines that may not have MLflow; they always write JSON, and
`moe bench log bench/results/*.json` (or the `moe bench ...` commands themselves, when MLflow
is importable) records them: environment as tags, config as params, every numeric result as
a metric named <row label>/<field> (a GiB figure by its name now, ``*_gib``, older files' too)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from pipeline.errors import PipelineError
from pipeline.params import MlflowConfig
from pipeline.tracking.client import mlflow_client, tracking_uri
from pipeline.tracking.provenance import flatten
from pipeline.tracking.stage_run import Tracker
from pipeline.units import GIB_NAME

ROW_LABELS = ("shape", "layout", "layers", "peer")


def _row_label(row: dict[str, Any], index: int) -> str:
    parts = [str(row[k]) for k in ROW_LABELS if k in row]
    label = "/".join(parts) if parts else f"row{index}"
    return "".join(ch if ch.isalnum() or ch in "._-/ " else "_" for ch in label)


def result_metrics(payload: dict[str, Any]) -> dict[str, float]:
    metrics: dict[str, float] = {}
    rows = payload.get("results") or ([payload["result"]] if "result" in payload else [])
    for i, row in enumerate(rows):
        label = _row_label(row, i)
        for k, v in row.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                metrics[f"{label}/{GIB_NAME.get(k, k)}"] = float(v)  # a GiB figure by its name now (older files: *_gb)
    if isinstance(payload.get("matmul_peak_tflops"), (int, float)):
        metrics["matmul_peak_tflops"] = float(payload["matmul_peak_tflops"])
    return metrics


def logged_run(uri: str, experiment: str, sha256: str) -> str | None:
    """The run that already holds the result file with this content, if any."""
    client = mlflow_client(uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return None
    found = client.search_runs([exp.experiment_id], filter_string=f"tags.`bench.file_sha256` = '{sha256}'", max_results=1)
    return found[0].info.run_id if found else None


RESULT_LIMIT = 64 << 20


def load_result(path: Path) -> tuple[bytes, dict[str, Any]]:
    """A benchmark result file, checked for everything ``log_result`` reads (one error naming
    the file and the field). ``artifacts`` are looked up by file name in the result's own
    folder: a result file never makes us upload a file from anywhere else."""

    def bad(field: str, what: str) -> PipelineError:
        return PipelineError(f"{path}: {field} {what} (not a bench/results JSON file)")

    path = Path(path)
    if path.stat().st_size > RESULT_LIMIT:
        raise bad("the file", f"is larger than {RESULT_LIMIT >> 20} MiB")
    data = path.read_bytes()
    try:
        payload = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad("the file", f"is not JSON ({exc})") from None
    if not isinstance(payload, dict):
        raise bad("the top level", f"is a {type(payload).__name__}, not an object")
    for key in ("environment", "config", "mlflow", "result", "curves"):
        if key in payload and not isinstance(payload[key], dict):
            raise bad(key, "is not an object")
    results = payload.get("results")
    if results is not None and not (isinstance(results, list) and all(isinstance(r, dict) for r in results)):
        raise bad("results", "is not a list of objects")
    experiment = (payload.get("mlflow") or {}).get("experiment")
    if experiment is not None and not (isinstance(experiment, str) and experiment.strip()):
        raise bad("mlflow.experiment", "is not a name")
    artifacts = payload.get("artifacts", [])
    if not isinstance(artifacts, list) or not all(isinstance(a, str) and Path(a).name for a in artifacts):
        raise bad("artifacts", "is not a list of file names")
    for a in artifacts:
        local = path.parent / Path(a).name
        if local.is_symlink() or not local.is_file():
            raise bad("artifacts", f"names {Path(a).name}, which is not a file beside it")
    for name, curve in (payload.get("curves") or {}).items():
        ok = isinstance(curve, list) and all(isinstance(p, list) and len(p) == 2 and all(type(x) in (int, float) for x in p) for p in curve)
        if not ok:
            raise bad(f"curves.{name}", "is not a list of [step, value] numbers")
    return data, payload


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
