"""DVC as users run it: `.venv/bin/dvc` with nothing on PATH, temporary and queued experiments,
an interrupted `dvc repro` resumed. A temporary clone of this repository on a tiny config."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from tests.helpers import copy_checkout, sh

pytestmark = pytest.mark.slow

VENV = Path(sys.executable).parent.parent


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A git+DVC clone whose .venv is this interpreter's environment; PATH holds no `moe`/`dvc`."""
    dest = copy_checkout(tmp_path_factory.mktemp("project"))
    (dest / ".venv").symlink_to(VENV)
    params = yaml.safe_load((dest / "params.yaml").read_text())
    params["tokenize"].update({"max_bytes": 150_000, "vocab_size": 300})
    params["model"]["vocab_size"] = 320
    params["train"].update({"max_steps": 16, "log_every": 4, "global_batch_size": 4, "micro_batch_size": 4})
    params["data"]["seq_len"] = 64
    params["checkpoint"]["every"] = 4
    params.setdefault("schedule", {})["warmup_steps"] = 2
    params["evaluate"].update({"max_batches": 2, "generate_tokens": 4})
    params["train"].update({"eval_every": 8, "eval_tasks": ["arc_easy", "piqa"], "eval_limit": 8})
    params["evaluate"].update({"tasks": ["arc_easy", "piqa"], "limit": 16})
    (dest / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "MOE_PIPELINE_KEY", "PYTHONPATH", "VIRTUAL_ENV")}
    env.update({"PATH": "/usr/bin:/bin", "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"})
    sh("git", "init", "-q", cwd=dest, env=env)
    sh("git", "add", "-A", cwd=dest, env=env)
    sh("git", "commit", "-qm", "clone", cwd=dest, env=env)
    return dest, env


def dvc(project, *args, check=True):
    dest, env = project
    return sh(str(dest / ".venv/bin/dvc"), *args, cwd=dest, env=env, check=check)


def train_runs(dest):
    client = MlflowClient(f"sqlite:///{dest / 'mlflow.db'}")
    exp = client.get_experiment_by_name("moe")
    return client.search_runs([exp.experiment_id], "tags.`moe.stage` = 'train'", order_by=["attributes.start_time ASC"]) if exp else []


def test_interrupted_repro_resumes_and_a_changed_config_does_not(project):
    dest, env = project
    dvc(project, "repro", "tokenize")
    proc = subprocess.Popen(
        [str(dest / ".venv/bin/dvc"), "repro", "train"],
        cwd=dest,
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    ckpts = dest / "runs/train/checkpoints"

    def checkpointed() -> bool:  # any step (keep_last deletes older ones as training goes on)
        return ckpts.is_dir() and any(p.name.startswith("step_") for p in ckpts.iterdir())

    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None and not checkpointed():
        time.sleep(0.02)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # the whole `dvc repro` at once, mid-training
    proc.wait()
    assert checkpointed(), "no checkpoint before the deadline"
    assert not (dest / "runs/train/summary.json").exists(), "training ended before it could be interrupted"

    rerun = dvc(project, "repro", "train")
    assert "Running stage 'train'" in rerun.stdout
    log = (dest / "runs/train/logs/rank0.log").read_text()
    assert "resumed from" in log, log[-2000:]
    assert train_runs(dest)[-1].data.tags["train.start"] == "resume"
    summary = json.loads((dest / "runs/train/summary.json").read_text())
    assert summary["steps"] == 16

    params = yaml.safe_load((dest / "params.yaml").read_text())
    params.setdefault("optim", {})["lr"] = 0.002
    (dest / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    dvc(project, "repro", "train")
    assert train_runs(dest)[-1].data.tags["train.start"] == "restart"
    assert "resumed from" not in (dest / "runs/train/logs/rank0.log").read_text()
    sh("git", "checkout", "params.yaml", cwd=dest, env=env)


def test_exp_run_with_venv_dvc_and_temp_log_to_the_project_store(project):
    """Queued experiments run in the same kind of workspace (.dvc/tmp/exps/tmp*) as --temp ones;
    their celery worker did not run the task in this sandbox, so the queue itself is not run here."""
    dest, env = project
    dvc(project, "repro")  # a baseline with every stage
    sh("git", "add", "-A", cwd=dest, env=env)
    sh("git", "commit", "-qm", "baseline", cwd=dest, env=env)
    before = len(train_runs(dest))

    r = dvc(project, "exp", "run", "-S", "++optim.lr=0.002")  # the README's command, `moe` not on PATH
    assert "Ran experiment" in r.stdout + r.stderr
    dvc(project, "exp", "run", "--temp", "-S", "train.max_steps=8")

    runs = train_runs(dest)
    made = sorted((r.data.params["optim.lr"], r.data.params["train.max_steps"]) for r in runs[before:])
    assert made[0][0] == "0.002" and made[1][1] == "8", made
    assert not list((dest / ".dvc/tmp").rglob("mlflow.db"))  # nothing went to a throwaway store
    names = [r.data.tags.get("mlflow.runName", "") for r in runs[before:]]
    assert all(n.startswith("train (") for n in names), names  # carries the DVC experiment's name


def test_queued_experiment_logs_to_the_project_store(project):
    """`dvc exp run --queue` + `--run-all` as the README shows them (the venv on PATH: DVC's
    queue workers start `dvc` by name): the experiment runs in DVC's temporary workspace and its
    MLflow runs land in the project's store under the experiment's name."""
    dest, env = project
    env = {**env, "PATH": f"{dest / '.venv/bin'}:{env['PATH']}"}
    sh("dvc", "exp", "run", "--queue", "-S", "++optim.lr=0.0021", "-S", "train.max_steps=8", cwd=dest, env=env)
    sh("dvc", "exp", "run", "--run-all", cwd=dest, env=env)
    status = sh("dvc", "queue", "status", cwd=dest, env=env).stdout
    assert "Success" in status and "Failed" not in status, status
    runs = [r for r in train_runs(dest) if r.data.params.get("optim.lr") == "0.0021"]
    assert runs and runs[-1].info.status == "FINISHED"
    assert "(" in runs[-1].data.tags["mlflow.runName"]  # "train (<experiment name>)"
