"""The job side of MLflow: the metrics sink of a training process (global rank 0) writing to
the run its submitter created, and the calls that tag and end that run from the job."""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pipeline.redact import redact, unredact
from pipeline.tracking.client import bound_http, finite, log_batched, mlflow_client, within_deadline
from pipeline.tracking.spool import OFFLINE_PREFIX, spool

log = logging.getLogger("pipeline.tracking")
SECRET_URI_ENV = "MOE_MLFLOW_TRACKING_URI"  # the full tracking URI for jobs, by environment only


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
        self.buffer.append((step, {k: v for k, v in metrics.items() if finite(v) and not k.startswith("expert_load/")}))
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

                within_deadline(lambda: log_batched(self._get_client(), self.run_id, metrics=items), "MLflow metrics")
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
            within_deadline(lambda: [self._get_client().set_tag(self.run_id, k, redact(str(v))) for k, v in tags.items()], "MLflow tags")
        except Exception as exc:  # keep training without tracking
            self.failed = True
            log.warning("MLflow unreachable (%s); continuing without tags", redact(str(exc)))

    def close(self, summary: dict[str, Any]) -> None:
        self.flush()


def job_uri(job) -> str | None:
    """The tracking URI with its password, which job.json holds redacted: from the environment."""
    return unredact(job.mlflow_uri, os.environ.get(SECRET_URI_ENV), os.environ.get("MLFLOW_TRACKING_URI"))


def close_job_run(job, ok: bool) -> None:
    """A job that nobody waits for ends its run itself (FINISHED or FAILED, with its summary)."""
    if not (job.mlflow_finalize and job.mlflow_run_id) or job.mlflow_run_id.startswith(OFFLINE_PREFIX):
        return

    def close() -> None:
        client = mlflow_client(job_uri(job))
        client.set_terminated(job.mlflow_run_id, "FINISHED" if ok else "FAILED")
        if job.summary_path.is_file():
            client.log_artifact(job.mlflow_run_id, str(job.summary_path))

    try:
        within_deadline(close, "closing the MLflow run")
    except Exception as exc:  # tracking is best effort from a job
        print(f"warning: could not close MLflow run {job.mlflow_run_id}: {redact(str(exc))}", file=sys.stderr)


def tag_job_run(job, tags: Mapping[str, str]) -> None:
    """Tags on the job's run, through the full URI (job.json's is redacted: on a
    password-protected server a tag sent through it would never arrive)."""
    if not job.mlflow_run_id or job.mlflow_run_id.startswith(OFFLINE_PREFIX):
        return

    def send() -> None:
        client = mlflow_client(job_uri(job))
        for k, v in tags.items():
            client.set_tag(job.mlflow_run_id, k, redact(str(v)))

    try:
        within_deadline(send, "tagging the MLflow run")
    except Exception as exc:  # tracking is best effort from a job
        print(f"warning: could not tag MLflow run {job.mlflow_run_id}: {redact(str(exc))}", file=sys.stderr)
