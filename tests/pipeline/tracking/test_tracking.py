"""What the trained workspace's store holds; capped params; the spool; the default store."""

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from pipeline.params import MlflowConfig
from pipeline.tracking.client import tracking_uri
from pipeline.tracking.job import MlflowSink
from tests.workspace import load


def test_mlflow_store_holds_every_param_and_the_metrics(in_trained):
    cfg = load()
    client = MlflowClient(tracking_uri(cfg.mlflow))
    exp = client.get_experiment_by_name("moe")
    runs = client.search_runs([exp.experiment_id], "tags.`moe.stage` = 'train'")
    assert len(runs) == 1
    run = runs[0]
    flat = cfg.flatten()
    assert set(flat) <= set(run.data.params)
    assert run.data.params["model.moe.num_experts"] == "4"
    for key in (
        "loss",
        "lr",
        "grad_norm",
        "tokens_per_s_per_device",
        "tflops_per_device",
        "lb_loss",
        "z_loss",
        "expert_load_max_over_mean",
        "expert_load_max_over_mean/layer_0",
        "final/final_loss",
    ):
        assert key in run.data.metrics, key
    assert len(client.get_metric_history(run.info.run_id, "loss")) == 8
    for tag in ("git.commit", "torch", "host", "mlflow.parentRunId", "moe.pipeline_key"):
        assert tag in run.data.tags, tag
    parent = client.get_run(run.data.tags["mlflow.parentRunId"])
    assert parent.data.tags["moe.stage"] == "pipeline"
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"params.yaml", "metrics.jsonl", "expert_load.png"} <= artifacts
    # the expert-load figures and the alarm; per-expert loads go to the heatmap, not metrics
    for key in ("expert_load_entropy/layer_0", "expert_load_cv/layer_0", "load_alarm", "load_alarm/layer_0", "final/load_alarm"):
        assert key in run.data.metrics, key
    assert not any(k.startswith("expert_load/") for k in run.data.metrics)
    assert run.data.tags["moe.load_alarm"] == "quiet"
    assert json.loads(Path("metrics/train.json").read_text())["load_alarm"] == 0
    assert Path("plots/expert_load.csv").read_text().startswith("step,layer,expert,row,load\n")


def test_long_param_values_are_capped(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    from pipeline.tracking.provenance import MAX_PARAM_CHARS, param_value
    from pipeline.tracking.stage_run import Tracker

    assert len(param_value(["x" * 100] * 100)) == MAX_PARAM_CHARS
    tracker = Tracker(MlflowConfig(experiment="caps"), "unit", Path("params.yaml"))
    tracker.log_params({f"p{i}": i for i in range(250)} | {"long": "y" * 9000})
    run = MlflowClient(tracker.uri).get_run(tracker.run_id)
    assert len(run.data.params) == 251 and len(run.data.params["long"]) == MAX_PARAM_CHARS


def test_unreachable_server_does_not_lose_metrics(tmp_path):
    sink = MlflowSink("http://127.0.0.1:9", "no-run", tmp_path / "fallback.jsonl")
    import os

    os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"
    os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] = "2"
    try:
        sink.log(1, {"loss": 2.0})
        sink.log(2, {"loss": 1.5, "lr": 0.1})
        sink.close({})
    finally:
        del os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"], os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"]
    rows = [json.loads(line) for line in (tmp_path / "fallback.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["metrics"]["lr"] == 0.1


def test_default_store_is_sqlite_at_the_root_and_env_overrides(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert tracking_uri(MlflowConfig(), tmp_path) == f"sqlite:///{tmp_path.resolve()}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://example:5000")
    assert tracking_uri(MlflowConfig(), tmp_path) == "http://example:5000"


def test_sync_finds_the_spools_project_from_anywhere_and_never_sends_twice(tmp_path):
    """`moe mlflow-sync DIR` from another directory uploads to the store of the project that
    holds DIR; a second sync of the same spool (a rename that did not happen, a rerun after a
    failure) adds no value twice and creates no second offline run (issue 37)."""
    import os
    import subprocess
    import sys

    from mlflow.tracking import MlflowClient

    project = tmp_path / "project"
    (project / ".dvc").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    uri = f"sqlite:///{project / 'mlflow.db'}"
    client = MlflowClient(uri)
    run = client.create_run(client.create_experiment("moe")).info.run_id
    spool = project / "runs/train/mlflow-fallback.jsonl"
    spool.parent.mkdir(parents=True)
    rows = [
        {"run_id": run, "step": 1, "metrics": {"loss": 1.0}},
        {"run_id": run, "step": 2, "metrics": {"loss": 0.5}},
        {"run_id": "offline-abc", "create": {"experiment": "moe", "tags": {"moe.stage": "train"}}},
        {"run_id": "offline-abc", "step": 1, "metrics": {"loss": 2.0}},
        {"run_id": "offline-abc", "status": "FINISHED"},
    ]
    spool.write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "MOE_PROJECT_ROOT")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[3])

    def sync():
        return subprocess.run(
            [sys.executable, "-m", "pipeline.cli", "mlflow-sync", str(project / "runs/train")],
            cwd=tmp_path / "elsewhere",
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )

    r = sync()
    assert r.returncode == 0, r.stderr
    assert "uploaded 3 metric values" in r.stdout + r.stderr
    assert not (tmp_path / "elsewhere/mlflow.db").exists() and not spool.exists()
    spool.with_suffix(".jsonl.synced").rename(spool)  # the same spool again
    assert sync().returncode == 0
    assert [(m.step, m.value) for m in client.get_metric_history(run, "loss")] == [(1, 1.0), (2, 0.5)]
    offline = client.search_runs([client.get_experiment_by_name("moe").experiment_id], "tags.`moe.synced_from` = 'offline-abc'")
    assert len(offline) == 1 and offline[0].info.status == "FINISHED"
    assert [m.value for m in client.get_metric_history(offline[0].info.run_id, "loss")] == [2.0]


def test_sync_refuses_values_of_an_offline_run_without_its_creation(tmp_path):
    from pipeline.errors import PipelineError
    from pipeline.tracking.spool import sync_fallback

    spool = tmp_path / "mlflow-fallback.jsonl"
    spool.write_text(json.dumps({"run_id": "offline-zzz", "step": 1, "metrics": {"loss": 1.0}}) + "\n")
    with pytest.raises(PipelineError, match="offline-zzz.*nothing was uploaded"):
        sync_fallback(spool, f"sqlite:///{tmp_path / 'm.db'}")
    assert spool.is_file()


def test_sync_sends_nothing_of_a_run_a_refused_command_abandoned(tmp_path):
    """Offline, a refused `moe submit` spools its run's creation and then `abandoned`: the sync
    creates no run for it (issue 36: a refused submission leaves no history)."""
    from pipeline.tracking.spool import sync_fallback

    spool = tmp_path / "mlflow-fallback.jsonl"
    rows = [
        {"run_id": "offline-ab", "create": {"experiment": "moe", "tags": {"moe.stage": "train"}}},
        {"run_id": "offline-ab", "abandoned": True},
        {"run_id": "offline-ok", "create": {"experiment": "moe", "tags": {"moe.stage": "tokenize"}}},
        {"run_id": "offline-ok", "step": 0, "metrics": {"x": 1.0}},
    ]
    spool.write_text("".join(json.dumps(r) + "\n" for r in rows))
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    assert sync_fallback(spool, uri) == 1
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("moe").experiment_id])
    assert [r.data.tags["moe.synced_from"] for r in runs] == ["offline-ok"]
