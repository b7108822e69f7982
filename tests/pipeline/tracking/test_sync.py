"""`moe mlflow-sync` is all or nothing (issue 50): every spool row is checked before anything is
sent, and a sync the store broke off is run again to completion, sending nothing twice. Against
a real MLflow store (SQLite); the store "goes away" through a trigger that fails its inserts."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from pipeline.errors import PipelineError
from pipeline.tracking.spool import sync_fallback


def _store(tmp_path: Path) -> tuple[str, MlflowClient, str]:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run = client.create_run(client.create_experiment("moe")).info.run_id
    return uri, client, run


def _write(path: Path, rows: list) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


def _good_rows(run: str) -> list[dict]:
    return [
        {"run_id": run, "time_ms": 1000, "params": {"optim.lr": "0.001"}},
        {"run_id": run, "time_ms": 1000, "tags": {"moe.stage": "train"}},
        {"run_id": run, "time_ms": 1000, "step": 1, "metrics": {"loss": 2.0}},
        {"run_id": "offline-abc", "time_ms": 1000, "create": {"experiment": "moe", "tags": {"moe.stage": "tokenize"}}},
        {"run_id": "offline-abc", "time_ms": 1000, "step": 0, "metrics": {"tokens": 10.0}},
    ]


BAD_ROWS = [
    ("metrics.loss", lambda run: {"run_id": run, "step": 2, "metrics": {"loss": "abc"}}),
    ("the line is not JSON (NaN", lambda run: {"run_id": run, "step": 2, "metrics": {"loss": float("nan")}}),  # written as NaN: not JSON
    ("metrics.loss", lambda run: {"run_id": run, "step": 2, "metrics": {"loss": True}}),
    ("metrics.bad key!", lambda run: {"run_id": run, "step": 2, "metrics": {"bad key!": 1.0}}),
    ("metrics.../x", lambda run: {"run_id": run, "step": 2, "metrics": {"../x": 1.0}}),
    ("step", lambda run: {"run_id": run, "step": "2", "metrics": {"loss": 1.0}}),
    ("time_ms", lambda run: {"run_id": run, "time_ms": -5, "metrics": {"loss": 1.0}}),
    ("params.optim.lr", lambda run: {"run_id": run, "params": {"optim.lr": 0.001}}),
    ("params.note", lambda run: {"run_id": run, "params": {"note": "y" * 6001}}),
    ("params.optim.lr", lambda run: {"run_id": run, "params": {"optim.lr": "0.5"}}),  # contradicts line 1
    ("tags.moe.stage", lambda run: {"run_id": run, "tags": {"moe.stage": ["train"]}}),
    ("tags", lambda run: {"run_id": run, "tags": ["moe.stage", "train"]}),
    ("status", lambda run: {"run_id": run, "status": "DONE"}),
    ("'extra'", lambda run: {"run_id": run, "status": "FINISHED", "extra": 1}),
    ("run_id", lambda run: {"run_id": 7, "status": "FINISHED"}),
    ("create.experiment", lambda run: {"run_id": "offline-new", "create": {"experiment": "", "tags": {}}}),
    ("the row", lambda run: {"run_id": run}),
    ("the line", lambda run: "[1, 2]"),
    ("the line", lambda run: "{broken"),
]


@pytest.mark.parametrize(("field", "bad"), BAD_ROWS, ids=[f"{i}-{f}" for i, (f, _) in enumerate(BAD_ROWS)])
def test_one_bad_row_uploads_nothing_and_names_its_line_and_field(tmp_path, field, bad):
    uri, client, run = _store(tmp_path)
    spool = tmp_path / "mlflow-fallback.jsonl"
    _write(spool, [*_good_rows(run), bad(run)])
    with pytest.raises(PipelineError, match="nothing was uploaded") as raised:
        sync_fallback(spool, uri)
    assert str(raised.value).startswith(f"{spool}:6: {field}"), str(raised.value)
    stored = client.get_run(run)
    assert stored.data.params == {} and stored.data.metrics == {} and "moe.stage" not in stored.data.tags
    assert len(client.search_runs([client.get_experiment_by_name("moe").experiment_id])) == 1  # no offline run made
    assert spool.is_file()


def test_a_param_that_would_change_a_stored_value_uploads_nothing(tmp_path):
    uri, client, run = _store(tmp_path)
    client.log_param(run, "optim.lr", "0.1")
    spool = tmp_path / "mlflow-fallback.jsonl"
    _write(spool, _good_rows(run))
    with pytest.raises(PipelineError, match=rf"{spool}:1: params.optim.lr is '0.001', but run {run} holds '0.1'"):
        sync_fallback(spool, uri)
    assert client.get_run(run).data.metrics == {}


def test_the_command_prints_one_error_line_and_exits_non_zero(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from pipeline.cli import app

    uri, client, run = _store(tmp_path)
    (tmp_path / "runs/train").mkdir(parents=True)
    (tmp_path / ".dvc").mkdir()
    spool = tmp_path / "runs/train/mlflow-fallback.jsonl"
    _write(spool, [*_good_rows(run), {"run_id": run, "step": 3, "metrics": {"loss": "abc"}}])
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    r = CliRunner().invoke(app, ["mlflow-sync", "runs/train"])
    lines = r.output.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1, r.output
    assert lines[0].startswith("error:") and "mlflow-fallback.jsonl:6: metrics.loss is 'abc'" in lines[0]
    assert client.get_run(run).data.params == {}


def test_a_sync_the_store_broke_off_completes_on_a_rerun_sending_nothing_twice(tmp_path):
    """The store fails half way (after the first run's values landed and the offline run was
    made): the spool is kept; once the store is back, a rerun sends only the rest."""
    uri, client, run = _store(tmp_path)
    spool = tmp_path / "mlflow-fallback.jsonl"
    rows = _good_rows(run) + [
        {"run_id": run, "time_ms": 2000, "step": 2, "metrics": {"loss": 1.5}},
        {"run_id": run, "time_ms": 2000, "status": "FINISHED"},
        {"run_id": "offline-abc", "time_ms": 2000, "step": 1, "metrics": {"late": 3.0, "tokens": 20.0}},
        {"run_id": "offline-abc", "time_ms": 2000, "status": "FINISHED"},
    ]
    _write(spool, rows)
    db = sqlite3.connect(tmp_path / "mlflow.db")
    db.execute("CREATE TRIGGER gone BEFORE INSERT ON metrics WHEN NEW.key = 'late' BEGIN SELECT RAISE(ABORT, 'the store went away'); END")
    db.commit()
    with pytest.raises(Exception, match="the store went away"):
        sync_fallback(spool, uri)
    assert spool.is_file()
    assert [(m.step, m.value) for m in client.get_metric_history(run, "loss")] == [(1, 2.0), (2, 1.5)]  # landed
    db.execute("DROP TRIGGER gone")
    db.commit()
    db.close()
    assert sync_fallback(spool, uri) == 3  # the offline run's three values; the first run's two not again
    assert not spool.exists() and spool.with_suffix(".jsonl.synced").is_file()
    assert [(m.step, m.value) for m in client.get_metric_history(run, "loss")] == [(1, 2.0), (2, 1.5)]
    exp = client.get_experiment_by_name("moe").experiment_id
    offline = client.search_runs([exp], "tags.`moe.synced_from` = 'offline-abc'")
    assert len(offline) == 1 and offline[0].info.status == "FINISHED"
    assert [(m.step, m.value) for m in client.get_metric_history(offline[0].info.run_id, "tokens")] == [(0, 10.0), (1, 20.0)]
    stored = client.get_run(run)
    assert stored.info.status == "FINISHED" and stored.data.params == {"optim.lr": "0.001"} and stored.data.tags["moe.stage"] == "train"
    spool.with_suffix(".jsonl.synced").rename(spool)  # the whole spool once more: nothing new
    assert sync_fallback(spool, uri) == 0
    assert len(client.get_metric_history(offline[0].info.run_id, "tokens")) == 2


def test_an_unreachable_server_keeps_the_spool_and_says_sync_again(tmp_path, monkeypatch):
    """Not "run ... is not in": the store could not be asked. The URI's token stays masked."""
    import socket

    from typer.testing import CliRunner

    from pipeline.cli import app

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "runs/train").mkdir(parents=True)
    (tmp_path / ".dvc").mkdir()
    spool = tmp_path / "runs/train/mlflow-fallback.jsonl"
    _write(spool, _good_rows("0123abcd"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}/?private_token=s3cret-tok")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    r = CliRunner().invoke(app, ["mlflow-sync", "runs/train"])
    lines = r.output.strip().splitlines()
    assert r.exit_code == 2 and lines[-1].startswith("error: cannot upload to"), r.output
    assert "sync again later" in lines[-1] and "private_token=***" in lines[-1] and "s3cret-tok" not in r.output
    assert spool.is_file()
