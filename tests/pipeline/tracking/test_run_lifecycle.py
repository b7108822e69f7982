"""A stage's MLflow run from start to end (issue 51): a resumed training goes on in its run, a
refused command leaves none, every stage takes the same flags, and a command run away from the
project says where it looked."""

from pathlib import Path

from mlflow.tracking import MlflowClient
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.resume import continued_run_id
from pipeline.tracking.client import tracking_uri
from pipeline.tracking.stage_run import Tracker
from pipeline.train_job import TrainJob
from tests.workspace import load


def _runs(cfg, stage: str | None = None):
    client = MlflowClient(tracking_uri(cfg.mlflow))
    exp = client.get_experiment_by_name(cfg.mlflow.experiment)
    found = client.search_runs([exp.experiment_id], f"tags.`moe.stage` = '{stage}'" if stage else "") if exp else []
    return client, found


def test_a_resumed_training_continues_its_mlflow_run(ws, monkeypatch):
    """The interrupted run's job.json names its run; the resumed training (the same config)
    writes on in it: one run, one loss curve; a setting changed since is a tag."""
    from pipeline.stages.train import resolve_experiment

    monkeypatch.setenv("MOE_SYSTEM_METRICS_INTERVAL", "60")
    cfg = load()
    first = Tracker(cfg.mlflow, "train", Path("params.yaml"))
    first.log_stage_start(cfg.flatten())
    first.log_metrics({"loss": 5.0}, step=4)
    first.stop_system_metrics()  # killed: never ended, still RUNNING
    job = TrainJob.read("runs/train/job.json")
    job.mlflow_run_id = first.run_id
    job.write()

    config = resolve_experiment(cfg).to_dict()
    assert continued_run_id(config, cfg.executor.run_dir) == first.run_id
    assert continued_run_id({**config, "train": {**config["train"], "seed": 7}}, cfg.executor.run_dir) is None  # another run: afresh

    again = Tracker(cfg.mlflow, "train", Path("params.yaml"), continue_run=first.run_id)
    assert again.run_id == first.run_id
    again.log_stage_start({**cfg.flatten(), "train.log_every": 2})
    again.log_metrics({"loss": 4.0}, step=8)
    again.end(ok=True)
    client, runs = _runs(cfg, "train")
    (run,) = runs
    assert run.info.run_id == first.run_id and run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [4, 8]
    assert run.data.tags["moe.resumed_with.train.log_every"] == "2" and run.data.params["train.log_every"] == str(cfg.train.log_every)


def test_a_refused_command_leaves_no_run(ws, monkeypatch):
    """Bad input the config check cannot see (an unknown task) stops `moe evaluate` after its
    run was opened: the run is deleted and no FAILED run (nor a FAILED parent) stays."""
    monkeypatch.setenv("MOE_SYSTEM_METRICS_INTERVAL", "60")
    r = CliRunner().invoke(app, ["evaluate", "--set", "evaluate.tasks=[nope_task]"])
    assert r.exit_code == 2 and "unknown task 'nope_task'" in r.output, r.output
    _, runs = _runs(load())
    assert runs == [], [(x.data.tags.get("mlflow.runName"), x.info.status) for x in runs]


def test_every_stage_takes_the_same_flags(tmp_path, monkeypatch):
    """--params, --set, --no-mlflow on every stage; run away from the project, the error says
    where it looked and names --params."""
    monkeypatch.chdir(tmp_path)
    for stage in ("tokenize", "train", "convert", "evaluate", "release"):
        r = CliRunner().invoke(app, [stage, "--no-mlflow", "--set", "train.seed=1"])
        assert r.exit_code == 2, (stage, r.output)
        assert f"params.yaml: params file not found (looked for {tmp_path / 'params.yaml'})" in r.output, (stage, r.output)
        assert "--params PATH" in r.output, r.output
