"""A training job carries its config's layout, resolved once where the job is built
(ExperimentConfig.resolve); the worker hands it to the layout, which checks only the world."""

import json
from pathlib import Path

import yaml

from moe.config import ExperimentConfig, ResolvedLayout
from pipeline.run_dirs import is_job_spec
from pipeline.train_job import TrainJob
from tests.helpers import make_corpus
from tests.workspace import TINY_PARAMS, load


def _config(tmp_path: Path, corpus: Path) -> ExperimentConfig:
    return ExperimentConfig.load(
        {
            "model": {"preset": "tiny", "vocab_size": 256},
            "data": {"paths": [str(corpus)], "seq_len": 32},
            "train": {"global_batch_size": 8, "micro_batch_size": 2, "max_steps": 2},
            "schedule": {"warmup_steps": 1},
            "checkpoint": {"dir": str(tmp_path / "run" / "ck")},
        }
    )


def test_the_resolved_layout_round_trips_through_job_json(tmp_path):
    cfg = _config(tmp_path, tmp_path)
    resolved = cfg.resolve(2)
    job = TrainJob(config=cfg.to_dict(), run_dir=str(tmp_path / "run"), nprocs=2, layout=resolved.to_dict())
    spec = job.write()
    assert is_job_spec(spec)
    again = TrainJob.read(spec)
    assert again == job and again.resolved == resolved and isinstance(again.resolved, ResolvedLayout)
    # a job.json written before jobs carried their layout: the layout resolves the config itself
    data = json.loads(spec.read_text())
    del data["layout"]
    spec.write_text(json.dumps(data))
    assert is_job_spec(spec) and TrainJob.read(spec).resolved is None


def test_make_job_carries_the_layout_check_train_resolved(tmp_path, monkeypatch):
    from pipeline.stages.train import make_job

    monkeypatch.chdir(tmp_path)
    Path("params.yaml").write_text(yaml.safe_dump(TINY_PARAMS, sort_keys=False))
    cfg = load(["train.eval_every=0", "executor.nprocs=2"])
    job = make_job(cfg, resolve_data=False)
    assert job.nprocs == 2
    assert job.resolved == cfg.experiment().resolve(2)
    assert job.resolved.dp == 2 and job.resolved.grad_accum == 1


def test_moe_job_writes_a_spec_without_a_layout_for_sbatch_to_size(in_trained, tmp_path):
    """slurm/train.sbatch takes its world size from sbatch's flags, not the config: the spec
    `moe job` writes leaves the layout to the world it starts in (tests/pipeline/test_slurm.py
    runs such a spec on two nodes)."""
    from typer.testing import CliRunner

    from pipeline.cli import app

    r = CliRunner().invoke(app, ["job", "--out", str(tmp_path / "job.json")])
    assert r.exit_code == 0, r.output
    job = TrainJob.read(tmp_path / "job.json")
    assert job.layout is None and job.resolved is None and job.nprocs == 1


def test_the_worker_refuses_a_layout_resolved_for_another_world(tmp_path, capsys):
    from pipeline.worker import run_and_report

    corpus = tmp_path / "tokens"
    corpus.mkdir()
    make_corpus(corpus)
    cfg = _config(tmp_path, corpus)
    job = TrainJob(config=cfg.to_dict(), run_dir=str(tmp_path / "run"), nprocs=2, layout=cfg.resolve(2).to_dict())
    code, summary = run_and_report(job)  # one process: world size 1
    assert (code, summary) == (2, {})
    assert "parallel: the job's layout was resolved for world size 2, but this run has world size 1" in capsys.readouterr().err


def test_the_worker_trains_with_the_layout_its_job_carries(tmp_path):
    from pipeline.worker import run_and_report

    corpus = tmp_path / "tokens"
    corpus.mkdir()
    make_corpus(corpus)
    cfg = _config(tmp_path, corpus)
    job = TrainJob(config=cfg.to_dict(), run_dir=str(tmp_path / "run"), nprocs=1, layout=cfg.resolve(1).to_dict())
    code, summary = run_and_report(job)
    assert code == 0 and summary["steps"] == 2
