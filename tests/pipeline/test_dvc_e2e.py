"""`dvc repro` end to end and DVC as users run it, in one temporary clone of this repository on a
tiny config: the whole pipeline, a no-op rerun, the README's commands for a trained workspace,
persistent, temporary and queued experiments through `.venv/bin/dvc` with nothing on PATH, and an
interrupted `dvc repro` resumed while a changed config restarts. One workspace, trained once, in
test order (each test continues from the state the previous one left)."""

import contextlib
import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from mlflow.entities import LoggedModelStatus
from mlflow.tracking import MlflowClient

from tests.helpers import copy_checkout, sh
from tests.pipeline.test_verbosity import noise

pytestmark = pytest.mark.slow

VENV = Path(sys.executable).parent.parent


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A git+DVC clone whose .venv is this interpreter's environment; PATH holds no `moe`/`dvc`."""
    dest = copy_checkout(tmp_path_factory.mktemp("project"))
    (dest / ".venv").symlink_to(VENV)
    params = yaml.safe_load((dest / "params.yaml").read_text())
    params["tokenize"].update({"max_bytes": 400_000, "vocab_size": 384})
    params["model"]["vocab_size"] = 384
    # 150 steps and checkpoints every 50 as params.yaml has them: the README's `moe evaluate --checkpoint` names steps 100 and 150
    params["train"].update({"max_steps": 150, "log_every": 10, "global_batch_size": 4, "micro_batch_size": 4})
    params["data"]["seq_len"] = 64
    params["evaluate"].update({"max_batches": 4, "generate_tokens": 8})
    params["train"].update({"eval_every": 50, "eval_tasks": ["arc_easy", "piqa"], "eval_limit": 8})
    params["evaluate"].update({"tasks": ["arc_easy", "piqa"], "limit": 16})
    params["checkpoint"]["every"] = 50
    params.setdefault("schedule", {})["warmup_steps"] = 5
    (dest / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "MOE_PIPELINE_KEY", "PYTHONPATH", "VIRTUAL_ENV")}
    env.update({"PATH": "/usr/bin:/bin", "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"})
    sh("git", "init", "-q", cwd=dest, env=env)
    sh("git", "add", "-A", cwd=dest, env=env)
    sh("git", "commit", "-qm", "clone", cwd=dest, env=env)
    return dest, env


def venv(project, tool, *args, check=True):
    """`.venv/bin/<tool> ...` in the project, as the README writes it."""
    dest, env = project
    return sh(str(dest / ".venv/bin" / tool), *args, cwd=dest, env=env, check=check)


def ran_stages(output: str) -> list[str]:
    return [line.split("'")[1] for line in output.splitlines() if line.startswith("Running stage")]


def train_runs(dest):
    client = MlflowClient(f"sqlite:///{dest / 'mlflow.db'}")
    exp = client.get_experiment_by_name("moe")
    return client.search_runs([exp.experiment_id], "tags.`moe.stage` = 'train'", order_by=["attributes.start_time ASC"]) if exp else []


def check_stage_runs(dest):
    """What MLflow users look for after one `moe repro`: system metrics, dataset inputs, the
    converted model as a logged model scored by evaluate, MLflow's source tags, and a parent run
    that spans the pipeline and holds its final metrics and plots."""
    client = MlflowClient(f"sqlite:///{dest / 'mlflow.db'}")
    exp = client.get_experiment_by_name("moe")
    runs = {r.data.tags["moe.stage"]: r for r in client.search_runs([exp.experiment_id])}
    assert set(runs) == {"pipeline", "tokenize", "train", "convert", "evaluate"}, set(runs)  # release logs no run
    train, parent = runs["train"], runs["pipeline"]

    assert any(k.startswith("system/cpu_utilization") for k in train.data.metrics), sorted(train.data.metrics)
    assert any(k.startswith("system/system_memory_usage") for k in train.data.metrics)
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
    assert runs["evaluate"].data.tags["moe.model_id"] == model.model_id == runs["convert"].data.tags["moe.model_id"]

    assert parent.info.status == "FINISHED"
    assert parent.info.start_time <= runs["tokenize"].info.start_time and parent.info.end_time >= runs["evaluate"].info.end_time
    for key in ("train/final_loss", "train/tokens_per_s_per_device", "eval/val_loss", "eval/val_perplexity"):
        assert key in parent.data.metrics, key
    assert any(f.path == "plots" for f in client.list_artifacts(parent.info.run_id))
    assert all(r.data.tags["mlflow.parentRunId"] == parent.info.run_id for s, r in runs.items() if s != "pipeline")


def test_repro_end_to_end_then_noop(project):
    dest, env = project
    first = venv(project, "moe", "repro")
    assert ran_stages(first.stdout) == ["tokenize", "train", "convert", "evaluate", "release"], first.stdout
    # a quiet console (issue 51): our lines only, the stages' progress among them
    assert noise(first.stdout + first.stderr) == [], first.stdout + first.stderr
    assert "moe.train step 10 " in first.stdout and "  [ours] arc_easy: " in first.stdout, first.stdout
    check_stage_runs(dest)  # (was tests/pipeline/tracking/test_stage_run.py, with its own pipeline run)
    ev = json.loads((dest / "metrics/eval_detail.json").read_text())
    assert ev["hf_rel_diff"] < 1e-4 and ev["generation_matches_hf"] == 1.0
    assert set(ev["tasks"]) == {"arc_easy", "piqa"} and all(t["hf_rel_diff"] < 1e-4 for t in ev["tasks"].values())
    summary = json.loads((dest / "metrics/eval.json").read_text())
    assert summary["suite"]["bpb_mean"] == ev["suite"]["bpb_mean"] and "tasks" not in summary
    curve = list(csv.DictReader((dest / "plots/eval_curve.csv").open()))
    assert {int(r["step"]) for r in curve} == {50, 100, 150}, curve
    assert {(r["task"], r["metric"]) for r in curve} >= {("arc_easy", "bpb"), ("piqa", "acc"), ("val", "loss")}, curve
    assert (dest / "runs/hf/config.json").is_file()
    # the release: the converted model with the evaluate stage's own numbers on its card
    card = (dest / "runs/release/README.md").read_text()
    header = yaml.safe_load(card.split("---\n")[1])
    (entry,) = header["model-index"]
    by_task = {r["dataset"]["name"]: r for r in entry["results"]}
    arc = by_task["arc_easy"]
    assert arc["dataset"] == {"name": "arc_easy", "type": "allenai/ai2_arc", "config": "ARC-Easy", "split": "validation", "args": {"num_few_shot": 0}}
    values = {m["type"]: m["value"] for m in arc["metrics"]}
    assert values["bpb"] == pytest.approx(ev["tasks"]["arc_easy"]["bpb_v2"], abs=1e-6)
    errors = {m["type"]: m["args"]["stderr"] for m in arc["metrics"]}  # issue 51: a standard error rides with its figure
    assert errors["bpb"] == pytest.approx(ev["tasks"]["arc_easy"]["bpb_v2/stderr"], abs=1e-6)
    assert f"at step {ev['step']}" in card and "| arc_easy | acc |" in card and "| 16 |" in card  # evaluate.limit documents
    assert "AutoModelForCausalLM.from_pretrained" in card and "## Training hyperparameters" in card
    from transformers import AutoModelForCausalLM

    assert type(AutoModelForCausalLM.from_pretrained(dest / "runs/release")).__name__ == "OlmoeForCausalLM"

    again = venv(project, "dvc", "repro")
    assert ran_stages(again.stdout) == []
    plots = venv(project, "dvc", "plots", "show", "--json")
    for png in (
        "plots/train/loss.png",
        "plots/train/lr.png",
        "plots/train/throughput_mfu.png",
        "plots/train/expert_load.png",
        "plots/eval/val_loss.png",
        "plots/eval/downstream.png",
        "plots/train/eval_curve.png",
    ):
        assert png in plots.stdout, png
    venv(project, "dvc", "plots", "show", "-o", "plots_html")
    html = (dest / "plots_html/index.html").read_text()
    assert "<img" in html and "<script src=" not in html  # renders offline: no vega from a CDN
    # (the README's `git add dvc.lock metrics plots` and `git commit` record the run: the next test)


def test_readme_commands_in_a_trained_workspace(project):
    """The README's commands for after `make repro`, as written (`.venv/bin/...` is this environment):
    two temporary experiments, `+` for a key the preset supplies, evaluate, release, checkpoints."""
    from tests.readme_commands import WORKSPACE, argv, readme_commands

    dest, env = project
    before = len(train_runs(dest))
    assert {c for c in readme_commands() if c in WORKSPACE} == set(WORKSPACE)  # (run in this file's order: experiments first)
    tables = {}
    for cmd in WORKSPACE:
        out = sh(*argv(cmd), cwd=dest, env={**env, "COLUMNS": "400"}).stdout  # (a wide terminal: DVC cuts nothing)
        if cmd.startswith(("dvc metrics show", "dvc exp show")):
            tables[cmd] = out
    # DVC's views read well (issue 51): 120 columns, the recipe's values shown, the baseline committed
    widths = {cmd: max(len(line) for line in out.splitlines()) for cmd, out in tables.items()}
    assert len(widths) == 2 and max(widths.values()) <= 120, widths
    shown = next(out for cmd, out in tables.items() if cmd.startswith("dvc exp show"))
    assert "resolved.optim.lr" in shown and "0.003" in shown and "0.002" in shown, shown  # the baseline's lr: the recipe's
    assert not re.search(r"\s!\s", shown), shown  # every row has its values: the README's commit made main one
    made = train_runs(dest)[before:]
    assert len(made) == 2 and "0.002" in {r.data.params.get("optim.lr") for r in made}, [r.data.params for r in made]
    assert "128" in {r.data.params.get("model.d_model") for r in made}, [r.data.params for r in made]
    assert not list((dest / ".dvc/tmp").rglob("mlflow.db"))  # nothing went to a throwaway store
    names = [r.data.tags.get("mlflow.runName", "") for r in made]
    assert all(n.startswith("train (") for n in names), names  # carries the DVC experiment's name
    assert len(venv(project, "dvc", "exp", "ls", "--name-only").stdout.split()) >= 2


def test_exp_run_with_venv_dvc_logs_to_the_project_store(project):
    """A persistent experiment (`moe` not on PATH) lands in the project's store under its name."""
    dest, env = project
    before = len(train_runs(dest))
    r = venv(project, "dvc", "exp", "run", "-S", "++optim.lr=0.0025")
    assert "Ran experiment" in r.stdout + r.stderr
    (run,) = train_runs(dest)[before:]
    assert run.data.params["optim.lr"] == "0.0025" and run.data.tags["mlflow.runName"].startswith("train (")
    assert run.data.tags["mlflow.runName"] == f"train ({run.data.tags['dvc.exp_name']})"  # DVC's experiment name, tagged
    client = MlflowClient(f"sqlite:///{dest / 'mlflow.db'}")
    stages = [r.data.tags["moe.stage"] for r in client.search_runs([run.info.experiment_id], max_results=200)]
    assert stages.count("tokenize") == 1 and "pipeline" in stages
    sh("git", "checkout", "params.yaml", cwd=dest, env=env)


def test_queued_experiment_logs_to_the_project_store(project):
    """`dvc exp run --queue` + `--run-all` as the README shows them (the venv on PATH: DVC's
    queue workers start `dvc` by name): the experiment runs in DVC's temporary workspace and its
    MLflow runs land in the project's store under the experiment's name."""
    dest, env = project
    env = {**env, "PATH": f"{dest / '.venv/bin'}:{env['PATH']}"}
    sh("dvc", "exp", "run", "--queue", "-S", "++optim.lr=0.0021", "-S", "train.max_steps=60", cwd=dest, env=env)
    sh("dvc", "exp", "run", "--run-all", cwd=dest, env=env)
    sh("dvc", "queue", "stop", cwd=dest, env=env)  # as docs/tracking.md shows: no worker left waiting
    deadline = time.monotonic() + 60
    while "0 active, 0 idle" not in (status := sh("dvc", "queue", "status", cwd=dest, env=env).stdout) and time.monotonic() < deadline:
        time.sleep(2)
    assert "Success" in status and "Failed" not in status and "0 active, 0 idle" in status, status
    runs = [r for r in train_runs(dest) if r.data.params.get("optim.lr") == "0.0021"]
    assert runs and runs[-1].info.status == "FINISHED"
    assert "(" in runs[-1].data.tags["mlflow.runName"]  # "train (<experiment name>)"


def test_interrupted_repro_resumes_and_a_changed_config_does_not(project):
    """Killed mid-training, `dvc repro` resumes from the last checkpoint; a changed training
    config restarts and reruns exactly the stages below it (not tokenize)."""
    dest, env = project
    params = yaml.safe_load((dest / "params.yaml").read_text())
    params["train"]["seed"] = 1
    (dest / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    ckpts, summary = dest / "runs/train/checkpoints", dest / "runs/train/summary.json"
    before = {p.name for p in ckpts.glob("step_*")}  # the last experiment's (DVC-cached: the restart removes them)
    finished_before = summary.stat().st_mtime_ns if summary.exists() else None
    proc = subprocess.Popen(
        [str(dest / ".venv/bin/dvc"), "repro", "train"],
        cwd=dest,
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def checkpointed() -> bool:  # a step of this run (keep_last deletes older ones as training goes on)
        return ckpts.is_dir() and any(p.name.startswith("step_") and p.name not in before for p in ckpts.iterdir())

    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None and not checkpointed():
        time.sleep(0.02)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # the whole `dvc repro` at once, mid-training
    proc.wait()
    assert checkpointed(), "no checkpoint before the deadline"
    killed = train_runs(dest)[-1]
    ended = summary.exists() and summary.stat().st_mtime_ns != finished_before
    assert not ended, "training ended before it could be interrupted"

    rerun = venv(project, "dvc", "repro", "train")
    assert "Running stage 'train'" in rerun.stdout
    log = (dest / "runs/train/logs/rank0.log").read_text()
    assert "resumed from" in log, log[-2000:]
    resumed = train_runs(dest)[-1]
    assert resumed.data.tags["train.start"] == "resume"
    assert resumed.info.run_id == killed.info.run_id and resumed.info.status == "FINISHED"  # one run, one loss curve
    steps = {m.step for m in MlflowClient(f"sqlite:///{dest / 'mlflow.db'}").get_metric_history(resumed.info.run_id, "loss")}
    assert min(steps) <= 50 and max(steps) == 150, sorted(steps)  # before the checkpoint it resumed from, and on to the end
    assert json.loads(summary.read_text())["steps"] == 150

    params["optim"] = {**(params.get("optim") or {}), "lr": 0.002}
    (dest / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    changed = venv(project, "dvc", "repro")
    assert ran_stages(changed.stdout) == ["train", "convert", "evaluate", "release"], changed.stdout
    assert train_runs(dest)[-1].data.tags["train.start"] == "restart"
    assert "resumed from" not in (dest / "runs/train/logs/rank0.log").read_text()
    sh("git", "checkout", "params.yaml", cwd=dest, env=env)
