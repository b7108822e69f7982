"""N local processes (gloo) against one process: the data-parallel layout must not change the math."""

import json
from pathlib import Path

import pytest

from moe.config import ExperimentConfig
from pipeline.executors import LocalExecutor, TrainJob
from tests.helpers import make_corpus

pytestmark = pytest.mark.distributed


def job(tmp_path, name, nprocs, corpus, **train):
    cfg = ExperimentConfig.load({
        "model": {"preset": "tiny", "vocab_size": 256},
        "data": {"paths": [str(corpus)], "seq_len": 32},
        "train": {"global_batch_size": 8, "micro_batch_size": 2, "max_steps": 6, "log_every": 1, **train},
        "schedule": {"warmup_steps": 2},
        "checkpoint": {"dir": str(tmp_path / name / "ck")},
    })
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
