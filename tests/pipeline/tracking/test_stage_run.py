"""What MLflow users look for, from the stages run as `moe <stage>`: system metrics, dataset
inputs, the converted model, MLflow's source/git tags, DVC experiment names, and a parent run
that spans the pipeline and holds its final metrics and plots."""

import os
import subprocess
import sys

import pytest
from mlflow.entities import LoggedModelStatus
from mlflow.tracking import MlflowClient

pytestmark = pytest.mark.slow


def moe(*args, env=None):
    r = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", *args],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "MOE_PIPELINE_KEY": "k-mlflow", "DVC_EXP_NAME": "bushy-oats", **(env or {})},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def test_stage_runs_and_parent_run(workspace):
    for stage in ("tokenize", "train", "convert", "evaluate"):
        moe(stage)
    client = MlflowClient(f"sqlite:///{workspace / 'mlflow.db'}")
    exp = client.get_experiment_by_name("moe")
    runs = {r.data.tags["moe.stage"]: r for r in client.search_runs([exp.experiment_id])}
    assert set(runs) == {"pipeline", "tokenize", "train", "convert", "evaluate"}
    train, parent = runs["train"], runs["pipeline"]

    assert any(k.startswith("system/cpu_utilization") for k in train.data.metrics), sorted(train.data.metrics)
    assert any(k.startswith("system/system_memory_usage") for k in train.data.metrics)
    assert train.data.tags["mlflow.runName"] == "train (bushy-oats)" and train.data.tags["dvc.exp_name"] == "bushy-oats"
    for tag in ("mlflow.source.name", "mlflow.source.type", "mlflow.user"):
        assert train.data.tags.get(tag), tag

    def inputs(run):
        full = client.get_run(run.info.run_id)
        return {(d.dataset.name, next(t.value for t in d.tags if t.key == "mlflow.data.context")) for d in full.inputs.dataset_inputs}

    assert inputs(runs["tokenize"]) == {("tokens/train", "training"), ("tokens/val", "validation")}
    assert inputs(train) == {("tokens/train", "training")}
    assert inputs(runs["evaluate"]) == {("tokens/val", "evaluation")}

    model_files = {f.path for f in client.list_artifacts(runs["convert"].info.run_id, "hf_model")}
    assert "hf_model/config.json" in model_files and any(p.endswith(".safetensors") for p in model_files)

    # the converted model is an MLflow 3 logged model of the convert run, scored by the evaluate run
    (model,) = client.search_logged_models([exp.experiment_id])
    assert model.source_run_id == runs["convert"].info.run_id and model.status == LoggedModelStatus.READY
    assert model.params["artifacts"] == f"runs:/{runs['convert'].info.run_id}/hf_model" and "step" in model.params
    scores = {m.key: m for m in model.metrics}
    assert "val_loss" in scores and scores["val_loss"].run_id == runs["evaluate"].info.run_id
    ranked = client.search_logged_models([exp.experiment_id], order_by=[{"field_name": "metrics.val_loss", "ascending": True}])
    assert [m.model_id for m in ranked] == [model.model_id]
    assert runs["evaluate"].data.tags["moe.model_id"] == model.model_id == runs["convert"].data.tags["moe.model_id"]

    assert parent.info.status == "FINISHED"
    assert parent.info.start_time <= runs["tokenize"].info.start_time and parent.info.end_time >= runs["evaluate"].info.end_time
    for key in ("train/final_loss", "train/tokens_per_s_per_device", "eval/val_loss", "eval/val_perplexity"):
        assert key in parent.data.metrics, key
    assert any(f.path == "plots" for f in client.list_artifacts(parent.info.run_id))
    assert all(r.data.tags["mlflow.parentRunId"] == parent.info.run_id for s, r in runs.items() if s != "pipeline")
