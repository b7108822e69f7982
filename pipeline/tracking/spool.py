"""The offline spool: what a stage or job could not send, appended as JSON lines, and
`moe mlflow-sync`, which sends it later (creating the runs that could not be created)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from pipeline.errors import PipelineError
from pipeline.redact import redact
from pipeline.tracking.client import log_batched, mlflow_client

STAGE_FALLBACK = Path("mlflow-fallback.jsonl")
OFFLINE_PREFIX = "offline-"


def spool(path: Path, row: dict[str, Any]) -> None:
    from pipeline.outputs import open_for_write

    path.parent.mkdir(parents=True, exist_ok=True)
    with open_for_write(path, append=True) as f:
        f.write(json.dumps(row) + "\n")


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
            raise PipelineError(
                f"run {run_id} is not in {redact(uri)}{where}: sync against the store it was created in "
                "(run `moe mlflow-sync` from the project directory, or set MLFLOW_TRACKING_URI); "
                "nothing was uploaded and the spool is kept"
            ) from None


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
            log_batched(client, run_id, params=[Param(k, v) for k, v in row["params"].items()])
        for k, v in (row.get("tags") or {}).items():
            client.set_tag(run_id, k, v)
    for run_id, items in metrics.items():
        log_batched(client, run_id, metrics=items)
        n += len(items)
    for row in rows:
        if "status" in row:
            run_id = ids.get(row["run_id"], row["run_id"])
            if not run_id.startswith(OFFLINE_PREFIX):
                client.set_terminated(run_id, row["status"])
    for path in files:
        path.rename(path.with_suffix(path.suffix + ".synced"))
    return n
