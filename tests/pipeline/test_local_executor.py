"""N local processes (gloo) against one process: the data-parallel layout must not change the math."""

import json
from pathlib import Path

import pytest

from moe.config import ExperimentConfig
from pipeline.executors import LocalExecutor
from pipeline.train_job import TrainJob
from tests.helpers import make_corpus

pytestmark = pytest.mark.distributed


def job(tmp_path, name, nprocs, corpus, **train):
    cfg = ExperimentConfig.load(
        {
            "model": {"preset": "tiny", "vocab_size": 256},
            "data": {"paths": [str(corpus)], "seq_len": 32},
            "train": {"global_batch_size": 8, "micro_batch_size": 2, "max_steps": 6, "log_every": 1, **train},
            "schedule": {"warmup_steps": 2},
            "checkpoint": {"dir": str(tmp_path / name / "ck")},
        }
    )
    return TrainJob(config=cfg.to_dict(), run_dir=str(tmp_path / name), nprocs=nprocs)


def losses(j):
    return {r["step"]: r["loss"] for r in map(json.loads, Path(j.metrics_path).read_text().splitlines())}


def test_two_processes_match_one(tmp_path):
    corpus = tmp_path / "tokens"
    corpus.mkdir()
    make_corpus(corpus)
    one, two = job(tmp_path, "one", 1, corpus), job(tmp_path, "two", 2, corpus)
    for j in (one, two):
        result = LocalExecutor(stream_rank0=False).run(j)
        assert result.ok, Path(result.log_path).read_text()[-2000:]
    a, b = losses(one), losses(two)
    assert a.keys() == b.keys() == set(range(1, 7))
    assert b[1] == pytest.approx(a[1], rel=1e-6)
    for step in range(2, 7):
        assert b[step] == pytest.approx(a[step], rel=1e-4)
    assert json.loads(Path(two.summary_path).read_text())["steps"] == 6


def test_failing_rank_is_reported_with_its_log(tmp_path):
    j = job(tmp_path, "bad", 2, tmp_path / "missing")
    result = LocalExecutor(stream_rank0=False).run(j)
    assert not result.ok and result.exit_code == 2
    assert "missing: token file not found" in result.message
    assert Path(result.log_path).is_file()


def test_local_executor_launches_a_pipeline_layout_unchanged(tmp_path):
    corpus = tmp_path / "tokens"
    corpus.mkdir()
    make_corpus(corpus)
    j = job(tmp_path, "pp", 2, corpus)
    j.config["parallel"].update({"pp": 2, "ep": 1})
    result = LocalExecutor(stream_rank0=False).run(j)
    assert result.ok, Path(result.log_path).read_text()[-2000:]
    assert json.loads(Path(j.summary_path).read_text())["steps"] == 6
    assert set(losses(j)) == set(range(1, 7))


# --- `moe train` as an operator runs it: kills, a second writer, resumes and reruns --------


def moe(*args, timeout=600):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], capture_output=True, text=True, timeout=timeout)


def start_train(*args):
    import subprocess
    import sys

    return subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "train", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def worker_pids(spec: str = "runs/train/job.json") -> list[int]:
    """Live `python -m pipeline.worker SPEC` processes started in this directory (no zombies)."""
    pids, here = [], Path.cwd().resolve()
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            status = (proc / "status").read_text()
            cwd = (proc / "cwd").resolve()
        except OSError:
            continue
        if b"pipeline.worker" in cmd and spec.encode() in cmd and cwd == here and "State:\tZ" not in status:
            pids.append(int(proc.name))
    return pids


def wait_for(predicate, timeout=240.0):
    import time

    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError("timed out")


TRAIN = ["--no-mlflow", "--set", "executor.nprocs=2", "--set", "train.max_steps=120", "--set", "train.log_every=10", "--set", "checkpoint.every=20"]


@pytest.fixture
def tokenized(workspace):
    r = moe("tokenize", "--no-mlflow")
    assert r.returncode == 0, r.stderr
    return workspace


@pytest.mark.slow
def test_second_writer_is_refused_and_sigterm_reaches_the_workers(tokenized):
    import signal

    first = start_train(*TRAIN, "--set", "train.max_steps=2000")
    try:
        wait_for(lambda: Path("runs/train/checkpoints/step_00000020").is_dir())
        workers = worker_pids()
        assert len(workers) == 2
        second = moe("train", *TRAIN)
        assert second.returncode == 2
        errors = [line for line in second.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and f"runs/train: in use by pid {first.pid} on " in errors[0], second.stderr
        assert "train (local executor)" in errors[0]
        first.send_signal(signal.SIGTERM)
        _, err = first.communicate(timeout=60)
        assert first.returncode == 128 + signal.SIGTERM, err
        assert "interrupted by SIGTERM" in err
        assert worker_pids() == []
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()


@pytest.mark.slow
def test_killed_train_takes_its_workers_along_and_resumes_keep_the_history(tokenized):
    import signal

    first = start_train(*TRAIN)
    wait_for(lambda: Path("runs/train/checkpoints/step_00000040").is_dir())
    workers = worker_pids()
    assert len(workers) == 2
    first.send_signal(signal.SIGKILL)
    first.wait()
    wait_for(lambda: worker_pids() == [], timeout=20)
    before = {s: v for s, v in losses_of("runs/train/metrics.jsonl").items() if s <= 40}
    assert set(before) == set(range(1, 41))

    resumed = moe("train", *TRAIN)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from runs/train/checkpoints/step_00000040" in resumed.stdout
    rows = [json.loads(line) for line in Path("runs/train/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 121))  # the history before the resume point kept, once
    assert {s: v for s, v in losses_of("runs/train/metrics.jsonl").items() if s <= 40} == before
    plot = Path("plots/train_loss.csv").read_text().splitlines()
    assert plot[1].startswith("1,") and len(plot) == 121
    metrics, history = Path("metrics/train.json").read_text(), Path("runs/train/metrics.jsonl").read_bytes()

    again = moe("train", *TRAIN)  # a finished run is reported as finished, its history untouched
    assert again.returncode == 0, again.stderr
    assert "run already finished: its checkpoint is at step 120" in again.stdout
    assert "trained 120 steps: final loss" in again.stdout + again.stderr
    assert Path("runs/train/metrics.jsonl").read_bytes() == history
    assert json.loads(Path("metrics/train.json").read_text())["final_loss"] == json.loads(metrics)["final_loss"]
    assert len(Path("plots/train_loss.csv").read_text().splitlines()) == 121


def losses_of(path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, Path(path).read_text().splitlines())}
