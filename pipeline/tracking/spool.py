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
    with open_for_write(path, append=True) as f:  # its time: a rerun of the sync sends the same value, deduplicated
        f.write(json.dumps({"time_ms": int(time.time() * 1000), **row}) + "\n")


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
    offline) to the tracking server; rename each file ``*.synced`` only once every value was
    accepted. Returns the number of metric values sent.

    Everything is checked before anything is written (every row a JSON object naming a run
    that exists in the store or is created by the spool), and a rerun after a failure sends
    nothing twice: each value keeps a fixed timestamp (the spool file's), which the store
    deduplicates, and a run created offline is found again by its ``moe.synced_from`` tag."""
    from mlflow.entities import Metric, Param

    files = [p for p in ([paths] if isinstance(paths, Path) else paths) if p.is_file()]
    if not files:
        return 0
    rows: list[tuple[dict[str, Any], int]] = []
    for path in files:
        stamp = int(path.stat().st_mtime * 1000)
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except ValueError:
                    row = None
                if not isinstance(row, dict) or not isinstance(row.get("run_id"), str):
                    raise PipelineError(f"{path}:{lineno}: not a spool row (a JSON object with a run_id); fix or remove it and sync again")
                rows.append((row, int(row.get("time_ms", stamp))))
    abandoned = {r["run_id"] for r, _ in rows if r.get("abandoned")}  # a refused command's run: never sent
    rows = [(r, t) for r, t in rows if r["run_id"] not in abandoned]
    created = {r["run_id"] for r, _ in rows if "create" in r}
    orphans = sorted({r["run_id"] for r, _ in rows if r["run_id"].startswith(OFFLINE_PREFIX)} - created)
    if orphans:
        raise PipelineError(
            f"the spool holds values of run {orphans[0]}, created offline, but not its creation row: nothing was uploaded "
            "and the spool is kept (remove that run's rows to send the rest)"
        )
    client = mlflow_client(uri)
    check_spooled_runs_exist(client, [r for r, _ in rows], uri)
    ids: dict[str, str] = {}
    for row, _ in rows:  # runs that were created offline first (once, also over reruns)
        if "create" in row:
            ids[row["run_id"]] = _synced_run(client, row)
    metrics: dict[str, list] = {}
    expected = 0
    for row, stamp in rows:
        run_id = ids.get(row["run_id"], row["run_id"])
        if "metrics" in row:
            items = [Metric(k, float(v), stamp, row.get("step", 0)) for k, v in row["metrics"].items()]
            metrics.setdefault(run_id, []).extend(items)
            expected += len(items)
        if "params" in row:
            log_batched(client, run_id, params=[Param(k, v) for k, v in row["params"].items()])
        for k, v in (row.get("tags") or {}).items():
            client.set_tag(run_id, k, v)
    n = 0
    for run_id, items in metrics.items():
        log_batched(client, run_id, metrics=items)
        n += len(items)
    if n != expected:  # never mark a spool synced that did not all go
        raise PipelineError(f"sent {n} of {expected} metric values; the spool is kept, sync again")
    for row, _ in rows:
        if "status" in row:
            client.set_terminated(ids.get(row["run_id"], row["run_id"]), row["status"])
    for path in files:
        path.rename(path.with_suffix(path.suffix + ".synced"))
    return n


def _synced_run(client, row: dict[str, Any]) -> str:
    """The store's run for a run created offline: the one an earlier sync made, else a new one."""
    name = row["create"].get("experiment", "moe")
    exp = client.get_experiment_by_name(name)
    exp_id = exp.experiment_id if exp else client.create_experiment(name)
    found = client.search_runs([exp_id], filter_string=f"tags.`moe.synced_from` = '{row['run_id']}'", max_results=1)
    if found:
        return found[0].info.run_id
    return client.create_run(exp_id, tags={**row["create"].get("tags", {}), "moe.synced_from": row["run_id"]}).info.run_id
