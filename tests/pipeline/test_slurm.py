"""The Slurm path on a real cluster: one slurmctld and two slurmd on this machine
(slurm/local/start.sh). CI installs Slurm and sets MOE_REQUIRE_SLURM=1, so these never skip there."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from moe.parallel.env import free_port
from tests.helpers import cancel_slurm_jobs_under, committed_params, moe, need_slurm
from tests.workspace import REPO

pytestmark = pytest.mark.slow
GOLDEN = Path(__file__).parent / "golden" / "sbatch_dry_run.txt"
# the golden script's command (tests/pipeline/test_without_slurm.py runs it without Slurm too)
DRY_RUN_ARGS = (
    "submit",
    "--dry-run",
    "--nodes",
    "2",
    "--partition",
    "debug",
    "--time-min",
    "30",
    "--set",
    "slurm.extra_sbatch=[--comment=golden]",
    "--set",
    "slurm.setup=[export MOE_X=1]",
)


def losses(run_dir) -> dict[int, float]:
    rows = [json.loads(line) for line in Path(run_dir, "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def state(job_id) -> tuple[str, int]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True).stdout
    fields = dict(kv.split("=", 1) for kv in out.split() if "=" in kv)
    return fields.get("JobState", "UNKNOWN"), int(fields.get("Restarts", "0"))


def wait_until(predicate, timeout=240, every=0.5):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(every)
    raise AssertionError("timed out")


def release_requeued(job_id) -> None:
    """Slurm holds a requeued batch job for ~2 minutes (BeginTime); let it start now."""
    wait_until(lambda: state(job_id) == ("PENDING", 1) or state(job_id)[1] >= 1 and state(job_id)[0] == "PENDING")
    time.sleep(2)  # slurmd refuses a credential issued in the second the old one was revoked
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=True)


def test_dry_run_prints_the_exact_sbatch_script(workspace):
    r = moe(*DRY_RUN_ARGS)
    assert r.returncode == 0, r.stderr
    text = r.stdout.replace(str(workspace.resolve()), "<CWD>").replace(sys.executable, "<PYTHON>")
    if os.environ.get("MOE_UPDATE_GOLDEN"):
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text()
    assert not Path("runs").exists()


@pytest.fixture
def tokenized(workspace):
    r = moe("tokenize", "--no-mlflow")
    assert r.returncode == 0, r.stderr
    return workspace


def test_two_node_job_matches_two_local_processes(slurm_cluster, tokenized):
    common = ["--no-mlflow", "--set", "train.max_steps=6", "--set", "train.log_every=1"]
    local = moe("train", *common, "--set", "executor.nprocs=2", "--set", "executor.run_dir=runs/local", "--set", "checkpoint.dir=runs/local/ck")
    assert local.returncode == 0, local.stderr
    slurm = moe(
        "submit", "--wait", "--nodes", "2", *common, "--set", "executor.run_dir=runs/slurm_train", "--set", "checkpoint.dir=runs/slurm_train/ck"
    )
    assert slurm.returncode == 0, slurm.stdout[-2000:] + slurm.stderr[-2000:]
    a, b = losses("runs/local"), losses("runs/slurm_train")
    assert a.keys() == b.keys() == set(range(1, 7))
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-6)
    assert "WORLD_SIZE" not in os.environ


def test_failing_job_is_one_clear_error(slurm_cluster, tokenized):
    r = moe("submit", "--wait", "--no-mlflow", "--set", "data.tokenizer_hash=deadbeef")
    assert r.returncode == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, r.stderr
    assert re.search(r"slurm job \d+ FAILED \(exit code 2:0\): error: .*the tokenizer does not match the data", errors[0])
    assert "log: runs/slurm/" in errors[0]


def submit_background(*args):
    r = moe("submit", "--no-mlflow", *args)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().splitlines()[-1]


def finish(job_id, timeout=300):
    wait_until(lambda: state(job_id)[0] in ("COMPLETED", "FAILED", "CANCELLED"), timeout=timeout)
    assert state(job_id)[0] == "COMPLETED", Path(f"runs/slurm/{job_id}_0_log.err").read_text()[-3000:]


LONG = ["--set", "train.max_steps=500", "--set", "train.log_every=50", "--set", "checkpoint.every=50"]


@pytest.mark.parametrize("how", ["usr2", "hard_requeue"])
def test_requeued_job_resumes_and_matches_the_uninterrupted_run(slurm_cluster, tokenized, how):
    ref = submit_background(*LONG, "--set", "executor.run_dir=runs/ref", "--set", "checkpoint.dir=runs/ref/ck")
    finish(ref)
    job = submit_background(*LONG, "--set", "executor.run_dir=runs/cut", "--set", "checkpoint.dir=runs/cut/ck")
    wait_until(lambda: Path("runs/cut/ck/step_00000050").is_dir())
    if how == "usr2":
        subprocess.run(["scancel", "--signal=USR2", job], check=True)
    else:
        subprocess.run(["scontrol", "requeue", job], check=True)
    release_requeued(job)
    finish(job)
    log = Path(f"runs/slurm/{job}_0_log.out").read_text()
    assert "resumed from runs/cut/ck/step_" in log
    if how == "usr2":
        assert "stop requested (signal 12)" in log
    ref_losses, cut_losses = losses("runs/ref"), losses("runs/cut")
    assert cut_losses[500] == ref_losses[500]
    summary = json.loads(Path("runs/cut/summary.json").read_text())
    # submitit ignores SIGTERM, so a hard-requeued attempt trains on until KillWait's SIGKILL and
    # may finish; the requeued one then resumes at step 500 and reports the run as finished
    assert summary["steps"] == 500 and (summary["start_step"] >= 50 or summary.get("already_finished"))


def test_dvc_train_stage_runs_on_slurm(slurm_cluster, tokenized):
    shutil.copy(REPO / "dvc.yaml", "dvc.yaml")
    for package in ("moe", "pipeline", "scripts"):  # the stages' code dependencies and scripts/moe
        shutil.copytree(REPO / package, package, ignore=shutil.ignore_patterns("__pycache__"))
    from moe.config.base import deep_merge

    # the repository's full params.yaml (DVC wants every section a stage lists), made tiny
    params = deep_merge(yaml.safe_load(committed_params()), yaml.safe_load(Path("params.yaml").read_text()))
    params["executor"]["kind"] = "slurm"
    params["mlflow"] = {"enabled": False}
    Path("params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    # scripts/moe runs this interpreter (the workspace has no .venv of its own)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", "MOE_PYTHON": sys.executable}
    for cmd in (["git", "init", "-q"], ["dvc", "init", "-q"]):
        subprocess.run(cmd, check=True, env=env)
    r = subprocess.run(["dvc", "repro", "train"], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "submitted slurm job" in r.stdout
    assert json.loads(Path("metrics/train.json").read_text())["steps"] == 8
    params["train"]["max_steps"] = 0
    Path("params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    bad = subprocess.run(["dvc", "repro", "train"], capture_output=True, text=True, env=env, timeout=600)
    assert bad.returncode != 0
    assert "train.max_steps: must be >= 1" in bad.stdout + bad.stderr


@pytest.fixture
def mlflow_server(tmp_path):
    if os.geteuid() != 0 or not shutil.which("pg_ctlcluster"):
        need_slurm("PostgreSQL not installed (apt-get install postgresql) or not root")
    r = subprocess.run(["bash", str(REPO / "slurm/local/postgres-start.sh")], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        need_slurm(f"could not start PostgreSQL: {r.stderr[-500:]}")
    db = f"mlflow_test_{os.getpid()}"
    subprocess.run(["runuser", "-u", "postgres", "--", "psql", "-q", "-c", f"CREATE DATABASE {db} OWNER mlflow"], check=True)
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pipeline.cli",
            "mlflow-server",
            "--backend",
            f"postgresql+psycopg2://mlflow:mlflow@127.0.0.1:5432/{db}",
            "--artifacts",
            str(tmp_path / "artifacts"),
            "--port",
            str(port),
            "--workers",
            "2",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    import urllib.request

    def up():
        try:
            return urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200
        except OSError:
            return False

    try:
        wait_until(up, timeout=180, every=1)
        yield f"http://127.0.0.1:{port}"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
        subprocess.run(["runuser", "-u", "postgres", "--", "psql", "-q", "-c", f"DROP DATABASE IF EXISTS {db}"])


def test_postgres_tracking_server_gets_two_concurrent_jobs_complete(slurm_cluster, tokenized, mlflow_server):
    env = {"MLFLOW_TRACKING_URI": mlflow_server}
    jobs = []
    for name in ("a", "b"):
        r = moe(
            "submit",
            "--set",
            "train.max_steps=40",
            "--set",
            "train.log_every=10",
            "--set",
            f"executor.run_dir=runs/{name}",
            "--set",
            f"checkpoint.dir=runs/{name}/ck",
            "--set",
            f"train.seed={ord(name)}",
            env=env,
        )
        assert r.returncode == 0, r.stderr
        jobs.append(r.stdout.strip().splitlines()[-1])
    for j in jobs:
        finish(j)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(mlflow_server)
    exp = client.get_experiment_by_name("moe")
    runs = client.search_runs([exp.experiment_id], "tags.`moe.stage` = 'train'")
    by_job = {r.data.tags["slurm.job_id"]: r for r in runs}
    assert set(by_job) == set(jobs)
    for j, run in by_job.items():
        assert run.info.status == "FINISHED"
        history = client.get_metric_history(run.info.run_id, "loss")
        assert sorted(m.step for m in history) == list(range(1, 41)), j
        assert "tokens_per_s_per_device" in run.data.metrics
    assert not list(Path("runs").glob("*/mlflow-fallback.jsonl"))


def test_plain_sbatch_template_trains_on_two_nodes(slurm_cluster, tokenized):
    r = moe("job", "--set", "train.max_steps=6", "--set", "executor.run_dir=runs/plain", "--set", "checkpoint.dir=runs/plain/ck")
    assert r.returncode == 0, r.stderr
    spec = r.stdout.strip()
    Path("runs/slurm").mkdir(parents=True, exist_ok=True)
    out = subprocess.run(
        ["sbatch", "--parsable", "--nodes=2", "--ntasks-per-node=1", str(REPO / "slurm/train.sbatch"), spec],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHON": sys.executable},
        check=True,
    )
    job_id = out.stdout.strip().split(";")[0]
    finish(job_id)
    assert json.loads(Path("runs/plain/summary.json").read_text())["steps"] == 6


def submit_and_wait_in_background(out: Path, *args, env=None) -> tuple[subprocess.Popen, str]:
    """`moe submit --wait ...` running on; (process, job id) once it has printed the id."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "submit", "--wait", *args],
        stdout=open(out, "w"),  # noqa: SIM115 - the child's stdout
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    wait_until(lambda: out.read_text().strip() != "" or proc.poll() is not None, timeout=120)
    assert proc.poll() is None, proc.stderr.read()
    return proc, out.read_text().splitlines()[0].strip()


def test_requeues_stop_at_max_requeues_with_a_failure_naming_the_limit(slurm_cluster, tokenized):
    uri = f"sqlite:///{tokenized / 'mlflow.db'}"
    waiting, job = submit_and_wait_in_background(
        Path("submit.out"),
        *LONG,
        "--set",
        "slurm.max_requeues=1",
        "--set",
        "executor.run_dir=runs/lim",
        "--set",
        "checkpoint.dir=runs/lim/ck",
        env={"MLFLOW_TRACKING_URI": uri},
    )
    try:
        wait_until(lambda: Path("runs/lim/ck/step_00000050").is_dir())
        subprocess.run(["scancel", "--signal=USR2", job], check=True)  # requeue 1 of 1
        release_requeued(job)
        wait_until(lambda: Path("runs/lim/ck/step_00000100").is_dir())
        subprocess.run(["scancel", "--signal=USR2", job], check=True)  # the limit: no requeue
        _, err = waiting.communicate(timeout=300)
    finally:
        if waiting.poll() is None:
            waiting.kill()
    assert state(job) == ("FAILED", 1)
    assert waiting.returncode == 5, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err
    assert re.search(rf"slurm job {job} FAILED \(exit code 5:0\): error: slurm.max_requeues=1 reached: job {job} was requeued 1 times", errors[0])
    assert "slurm.max_requeues=1 reached" in Path(f"runs/slurm/{job}_0_log.out").read_text()
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("moe").experiment_id], f"tags.`slurm.job_id` = '{job}'")
    assert run.info.status == "FAILED"
    assert "slurm.max_requeues=1 reached" in run.data.tags["moe.stop_reason"]


def test_resubmitted_job_resumes_and_keeps_the_metrics_history(slurm_cluster, tokenized):
    short = [
        "--set",
        "train.log_every=5",
        "--set",
        "checkpoint.every=10",
        "--set",
        "executor.run_dir=runs/again",
        "--set",
        "checkpoint.dir=runs/again/ck",
    ]
    finish(submit_background(*short, "--set", "train.max_steps=20"))
    first = losses("runs/again")
    assert set(first) == set(range(1, 21))
    job = submit_background(*short, "--set", "train.max_steps=40")
    finish(job)
    assert "resumed from runs/again/ck/step_00000020" in Path(f"runs/slurm/{job}_0_log.out").read_text()
    rows = [json.loads(line)["step"] for line in Path("runs/again/metrics.jsonl").read_text().splitlines()]
    assert rows == list(range(1, 41))
    assert {s: v for s, v in losses("runs/again").items() if s <= 20} == first


@pytest.mark.parametrize(("launch", "scope"), [("submit", "--batch"), ("submit", "--full"), ("sbatch", "--batch")])
def test_usr2_to_the_batch_shell_reaches_the_tasks(slurm_cluster, tokenized, launch, scope):
    where = ["--set", "executor.run_dir=runs/batch", "--set", "checkpoint.dir=runs/batch/ck"]
    steps = 500 if launch == "submit" else 150
    if launch == "submit":
        job = submit_background(*LONG, *where)
    else:  # slurm/train.sbatch, the plain template (one thread per task: it sets none itself)
        r = moe("job", *LONG, "--set", f"train.max_steps={steps}", *where)
        assert r.returncode == 0, r.stderr
        Path("runs/slurm").mkdir(parents=True, exist_ok=True)
        out = subprocess.run(
            ["sbatch", "--parsable", "--nodes=2", "--ntasks-per-node=1", str(REPO / "slurm/train.sbatch"), r.stdout.strip()],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"},
            check=True,
        )
        job = out.stdout.strip().split(";")[0]
    wait_until(lambda: Path("runs/batch/ck/step_00000050").is_dir())
    subprocess.run(["scancel", "--signal=USR2", scope, job], check=True)
    release_requeued(job)
    finish(job, timeout=600)
    assert state(job)[1] == 1  # one requeue, however many copies of the signal arrived
    log = Path(f"runs/slurm/{job}_0_log.out").read_text()
    assert "stop requested (signal 12)" in log and "resumed from runs/batch/ck/step_" in log
    assert json.loads(Path("runs/batch/summary.json").read_text())["steps"] == steps
    assert [json.loads(line)["step"] for line in Path("runs/batch/metrics.jsonl").read_text().splitlines()] == list(range(1, steps + 1))


def test_a_refused_submission_leaves_the_mlflow_history_as_it_was(slurm_cluster, workspace):
    """sbatch refuses the job (no such partition): no train run is left behind and the
    pipeline's parent run, FINISHED by the tokenize stage, stays FINISHED (issue 36)."""
    from mlflow.tracking import MlflowClient

    r = moe("tokenize")
    assert r.returncode == 0, r.stderr
    client = MlflowClient(f"sqlite:///{workspace / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("moe").experiment_id
    before = {run.info.run_id: run.info.status for run in client.search_runs([experiment])}
    assert sorted(before.values()) == ["FINISHED", "FINISHED"]  # the parent and the tokenize run
    for command in (
        ["submit", "--partition", "nosuchpartition"],
        ["train", "--set", "executor.kind=slurm", "--set", "slurm.partition=nosuchpartition"],
    ):
        r = moe(*command)
        assert r.returncode != 0, command
        assert [line for line in r.stderr.splitlines() if line.startswith("error:")] == [
            next(line for line in r.stderr.splitlines() if line.startswith("error: sbatch failed"))
        ], r.stderr
    after = {run.info.run_id: run.info.status for run in client.search_runs([experiment])}
    assert after == before
    assert not list(Path("runs/train").glob("checkpoints/step_*"))


def test_a_modules_leftover_jobs_are_cancelled_and_nobody_elses(slurm_cluster, tmp_path):
    """Between modules the suite cancels the jobs left in its own tmp folders (a timed-out test's job held a node
    the next module's two-node job waited for) and leaves every other job alone."""
    elsewhere = Path(tempfile.mkdtemp(prefix="moe-not-the-tests-", dir="/var/tmp"))
    submitted = {}
    try:
        for name, where in (("ours", tmp_path), ("theirs", elsewhere)):
            r = subprocess.run(["sbatch", "--parsable", "-N1", "--wrap", "sleep 600"], cwd=where, capture_output=True, text=True, check=True)
            submitted[name] = r.stdout.strip().split(";")[0]
        assert cancel_slurm_jobs_under(tmp_path) == [submitted["ours"]]
        queued = subprocess.run(["squeue", "-h", "-o", "%A"], capture_output=True, text=True, check=True).stdout.split()
        assert submitted["ours"] not in queued and submitted["theirs"] in queued
    finally:
        subprocess.run(["scancel", *submitted.values()], check=False)
        shutil.rmtree(elsewhere)
