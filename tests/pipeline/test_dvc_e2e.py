"""`dvc repro` end to end in a temporary clone of this repository, on a tiny config."""

import csv
import json
import os
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import copy_checkout, sh

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    dest = copy_checkout(tmp_path_factory.mktemp("clone"))
    params = yaml.safe_load((dest / "params.yaml").read_text())
    params["tokenize"].update({"max_bytes": 400_000, "vocab_size": 384})
    params["model"]["vocab_size"] = 384
    # 150 steps and checkpoints every 50 as params.yaml has them: the README's `moe evaluate --checkpoint` names steps 100 and 150
    params["train"].update({"max_steps": 150, "log_every": 10, "global_batch_size": 4, "micro_batch_size": 4})
    params["data"]["seq_len"] = 64
    params["evaluate"]["max_batches"] = 4
    params["train"].update({"eval_every": 50, "eval_tasks": ["arc_easy", "piqa"], "eval_limit": 8})
    params["evaluate"].update({"tasks": ["arc_easy", "piqa"], "limit": 16})
    params["checkpoint"]["every"] = 50
    params.setdefault("schedule", {})["warmup_steps"] = 5
    (dest / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(dest),
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@t",
    }
    env.pop("MLFLOW_TRACKING_URI", None)
    sh("git", "init", "-q", cwd=dest, env=env)
    sh("git", "add", "-A", cwd=dest, env=env)
    sh("git", "commit", "-qm", "clone", cwd=dest, env=env)
    return dest, env


def ran_stages(output: str) -> list[str]:
    return [line.split("'")[1] for line in output.splitlines() if line.startswith("Running stage")]


def test_repro_end_to_end_then_incremental(clone):
    dest, env = clone
    first = sh("moe", "repro", cwd=dest, env=env)
    assert ran_stages(first.stdout) == ["tokenize", "train", "convert", "evaluate", "release"], first.stdout
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
    assert values["bpb_stderr"] == pytest.approx(ev["tasks"]["arc_easy"]["bpb_v2/stderr"], abs=1e-6)
    assert f"at step {ev['step']}" in card and "| arc_easy | acc |" in card and "| 16 |" in card  # evaluate.limit documents
    assert "AutoModelForCausalLM.from_pretrained" in card and "## Training hyperparameters" in card
    from transformers import AutoModelForCausalLM

    assert type(AutoModelForCausalLM.from_pretrained(dest / "runs/release")).__name__ == "OlmoeForCausalLM"

    again = sh("dvc", "repro", cwd=dest, env=env)
    assert ran_stages(again.stdout) == []

    sh("dvc", "metrics", "show", cwd=dest, env=env)
    plots = sh("dvc", "plots", "show", "--json", cwd=dest, env=env)
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
    sh("dvc", "plots", "show", "-o", "plots_html", cwd=dest, env=env)
    html = (dest / "plots_html/index.html").read_text()
    assert "<img" in html and "<script src=" not in html  # renders offline: no vega from a CDN

    params = yaml.safe_load((dest / "params.yaml").read_text())
    params["model"].setdefault("moe", {})["top_k"] = 1
    (dest / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    changed = sh("dvc", "repro", cwd=dest, env=env)
    assert ran_stages(changed.stdout) == ["train", "convert", "evaluate", "release"], changed.stdout

    exp = sh("dvc", "exp", "run", "-S", "+model.moe.expert_hidden=32", cwd=dest, env=env)  # a key the preset supplies: added with +
    assert "Ran experiment" in exp.stdout + exp.stderr

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{dest / 'mlflow.db'}")
    exp_id = client.get_experiment_by_name("moe").experiment_id
    stages = [r.data.tags["moe.stage"] for r in client.search_runs([exp_id], max_results=100)]
    assert stages.count("tokenize") == 1 and stages.count("train") >= 3 and "pipeline" in stages


def test_readme_commands_in_a_trained_workspace(clone):
    """The README's commands for after `make repro`, as written (`.venv/bin/...` is this environment)."""
    from tests.readme_commands import WORKSPACE, argv, readme_commands

    dest, env = clone
    assert [c for c in readme_commands() if c in WORKSPACE] == WORKSPACE
    for cmd in WORKSPACE:
        sh(*argv(cmd), cwd=dest, env=env)
    names = sh(*argv(".venv/bin/dvc exp ls --name-only"), cwd=dest, env=env).stdout.split()
    assert len(names) >= 3, names  # test_repro's experiment, the README's and its queued one
