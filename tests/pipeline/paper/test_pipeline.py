"""The paper-reproduction pipeline end to end at CPU scale: `dvc repro bench/paper/dvc.yaml`
in a temporary clone, every measurement a job on the local Slurm cluster, then a no-op rerun,
the report, and the MLflow runs (one 'paper reproduction' parent, one nested run per stage)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import copy_checkout

REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.slow
CLAIM_STAGES = ["resident", "experts", "fp8", "recompute", "ep", "gerrymander"]


def sh(*cmd, cwd, env):
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-3000:]}"
    return r


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    dest = copy_checkout(
        tmp_path_factory.mktemp("paper"),
        skip_prefixes=("bench/paper/results/", "bench/paper/plots/"),
        skip_files=("bench/paper/dvc.lock", "bench/paper/REPORT.md"),
    )
    params_path = dest / "bench/paper/params.yaml"
    params = yaml.safe_load(params_path.read_text())
    params["paper"].update({"steps": 2, "experts": [8, 16], "gerrymander_steps": 40})
    params["executor"] = {"kind": "slurm", "run_dir": "runs/train"}
    params["slurm"].update({"nodes": 2, "tasks_per_node": 1, "time_min": 20, "folder": str(dest / "slurm-logs")})
    params["tokenize"].update({"max_bytes": 150_000, "vocab_size": 300})
    params_path.write_text(yaml.safe_dump(params, sort_keys=False))
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
    for cmd in (("git", "init", "-q"), ("git", "add", "-A"), ("git", "commit", "-qm", "clone")):
        sh(*cmd, cwd=dest, env=env)
    return dest, env


def test_paper_pipeline_on_slurm_then_noop(slurm_cluster, clone):  # noqa: F811
    dest, env = clone
    first = sh("moe", "paper", "repro", cwd=dest, env=env)
    ran = [line.split("'")[1].split(":")[-1] for line in first.stdout.splitlines() if line.startswith("Running stage")]
    assert set(ran) == {"tokenize", "claim@resident", "claim@experts", "claim@fp8", "claim@recompute", "claim@ep", "gerrymander", "report"}, (
        first.stdout
    )
    out = dest / "bench/paper"
    for stage in CLAIM_STAGES:
        r = json.loads((out / f"results/{stage}.json").read_text())
        assert r["hardware"]["describe"] == "2 CPU processes (gloo)" and "CPU scale" in r["scaling"]["shape"]
        statuses = {v["name"]: v["status"] for v in r["variants"]}
        assert all(s in ("ok", "not run") for s in statuses.values()), (stage, r["variants"])
        assert any(s == "ok" for s in statuses.values()), (stage, statuses)
    fp8 = json.loads((out / "results/fp8.json").read_text())
    assert [v["status"] for v in fp8["variants"]] == ["ok", "not run"] and "CPU" in fp8["variants"][1]["reason"]
    resident = json.loads((out / "results/resident.json").read_text())
    assert resident["derived"]["speedup"] > 0
    experts = json.loads((out / "results/experts.json").read_text())
    assert set(experts["derived"]["tokens_per_s_per_device"]) == {"8", "16"}
    # The paper's regime, labelled: random routing plus learned rows, accumulation, measured
    # drops, and a profile of every variant for the decomposition and the EP projection.
    assert [(v["name"], v["routing"]) for v in experts["variants"]] == [
        ("experts-8", "random"),
        ("experts-16", "random"),
        ("experts-8-learned", "learned"),
        ("experts-16-learned", "learned"),
    ]
    for v in experts["variants"]:
        assert v["accumulation"] == 2 and v["tokens_dropped_fraction"] == 0.0 and v["dropless"], v
        assert v["profile"]["total"] > 0 and v["profile"]["expert_gemm"] > 0 and v["profile"]["optimizer"] > 0, v["profile"]
    assert "drop_learned" in experts["derived"] and experts["derived"]["projection"]["gpus"] == 8
    report = (out / "REPORT.md").read_text()
    for title in ("Resident experts", "Experts 8 -> 128", "FP8", "Activation recompute", "Expert parallelism", "Token gerrymandering"):
        assert title in report
    assert "52,000 vs 19,400" in report and "2 CPU processes (gloo)" in report
    assert "Where the time goes" in report and "Projection to the paper's 8 GPUs" in report and "routing learned + random" in report
    assert {p.name for p in (out / "plots").glob("*.png")} >= {"experts.png", "resident.png", "recompute.png", "gerrymander.png"}
    # Every measurement was a Slurm job on the two-node cluster.
    assert list((dest / "slurm-logs").glob("*_0_log.out"))

    again = sh("moe", "paper", "repro", cwd=dest, env=env)
    assert "Running stage" not in again.stdout, again.stdout

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{dest / 'mlflow.db'}" if (dest / "mlflow.db").exists() else f"sqlite:///{out / 'mlflow.db'}")
    exp = client.get_experiment_by_name("paper-reproduction")
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if r.data.tags.get("mlflow.runName") == "paper reproduction"]
    assert len(parents) == 1
    children = {r.data.tags["mlflow.runName"] for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id}
    assert children == {f"paper/{s}" for s in CLAIM_STAGES} | {"paper/report"}
    assert any(k.startswith("resident/") for k in parents[0].data.metrics)
