"""What the trained workspace's store holds; capped params; the spool; the default store."""

import json
from pathlib import Path

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
