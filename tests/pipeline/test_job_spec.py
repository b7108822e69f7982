"""A job.json is read as untrusted input (issue 50, item 6): its fields and the layout it
carries are checked, and anything else ends in one `error:` line naming job.json and the field,
never in a worker traceback (ZeroDivisionError, a mesh that does not fit the world) or a run
that trains something other than its config says."""

import dataclasses
import json
import re
import subprocess
import sys

import pytest

from moe.errors import MoeError
from pipeline.errors import PipelineError
from pipeline.train_job import TrainJob
from tests.helpers import REPO, make_corpus, tiny_config


@pytest.fixture
def job(tmp_path) -> TrainJob:
    corpus = tmp_path / "tokens"
    corpus.mkdir()
    make_corpus(corpus)
    cfg = tiny_config(
        corpus, tmp_path / "run/ck", train={"max_steps": 1, "global_batch_size": 4, "micro_batch_size": 2}, schedule={"warmup_steps": 1}
    )
    return TrainJob(config=cfg.to_dict(), run_dir=str(tmp_path / "run"), nprocs=1, layout=cfg.resolve(1).to_dict())


LAYOUTS = [  # (change to the layout, what the error names); the config resolves to dp 1, grad_accum 2 on one process
    ({"grad_accum": 0}, "layout.grad_accum: must be >= 1, got 0"),
    ({"grad_accum": -1}, "layout.grad_accum: must be >= 1, got -1"),
    ({"grad_accum": 10**12}, "layout.grad_accum: 1000000000000, but the job's config resolves to 2 on world size 1"),
    ({"grad_accum": 1e12}, "layout.grad_accum: expected int, got 1000000000000.0"),
    ({"data_parallel": "nosuch"}, "layout.data_parallel: 'nosuch', but the job's config resolves to 'ddp'"),
    ({"virtual_stages": 0}, "layout.virtual_stages: must be >= 1, got 0"),
    ({"dp": 0}, "layout.dp: must be >= 1, got 0"),
    ({"dp": 4}, "layout.dp: 4, but the job's config resolves to 1 on world size 1"),
    ({"ep": 8}, "layout.ep: 8, but the job's config resolves to 1 on world size 1"),
    ({"pp": 2}, "layout.pp: 2, but the job's config resolves to 1 on world size 1"),
    ({"world_size": 2}, "layout.world_size: 2, but the job runs 1 process(es) (nprocs)"),
    ({"dp": True}, "layout.dp: expected int, got True"),
    ({"nosuch": 1}, "layout: unknown key(s) nosuch"),
    ([1, 2], "layout: expected an object of the layout's fields, got list [1, 2]"),
]


@pytest.mark.parametrize(("change", "said"), LAYOUTS, ids=[json.dumps(c) for c, _ in LAYOUTS])
def test_a_layout_that_is_not_the_configs_own_is_one_error_line(job, change, said, capsys):
    from pipeline.worker import run_and_report

    job.layout = {**job.layout, **change} if isinstance(change, dict) else change
    spec = job.write()
    code, summary = run_and_report(TrainJob.read(spec))
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert (code, summary) == (2, {}) and len(errors) == 1, errors
    assert errors[0].startswith(f"error: {spec}: {said}"), errors[0]
    assert not (job.checkpoint_dir).exists()  # refused before the trainer was built


def test_the_worker_process_says_it_in_one_line(job):
    job.layout = {**job.layout, "dp": 0}  # was a ZeroDivisionError traceback
    spec = job.write()
    r = subprocess.run(
        [sys.executable, "-m", "pipeline.worker", str(spec)], capture_output=True, text=True, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"error: {spec}: layout.dp: must be >= 1, got 0" in r.stderr


def test_the_layout_the_job_was_built_with_passes(job):
    assert job.resolved.to_dict() == job.layout


@pytest.mark.parametrize(
    ("content", "said"),
    [
        ("{not json", "not a job spec (not JSON"),
        ("[1, 2]", "not a job spec (a JSON list, not an object)"),
        ('{"config": {}, "run_dir": "r", "extra": 1}', "unknown field 'extra'"),
        ('{"config": {}}', "missing field 'run_dir'"),
        ('{"config": [], "run_dir": "r"}', "config: expected dict, got []"),
        ('{"config": {}, "run_dir": "r", "nprocs": 0}', "nprocs: must be >= 1, got 0"),
        ('{"config": {}, "run_dir": "r", "nprocs": "2"}', "nprocs: expected int, got '2'"),
        ('{"config": {}, "run_dir": "r", "max_requeues": -1}', "max_requeues: must be >= 0, got -1"),
    ],
)
def test_a_spec_that_is_not_a_jobs_is_refused_naming_the_file(tmp_path, content, said):
    spec = tmp_path / "job.json"
    spec.write_text(content)
    with pytest.raises(PipelineError, match="^" + re.escape(f"{spec}: {said}")):
        TrainJob.read(spec)


def test_a_slurm_task_reports_a_bad_spec_in_one_line(tmp_path, capsys):
    from pipeline.slurm_task import _read_job

    (tmp_path / "job.json").write_text('{"config": {}, "run_dir": "r", "extra": 1}')
    with pytest.raises(SystemExit) as info:
        _read_job(str(tmp_path / "job.json"))
    assert info.value.code == 2
    assert capsys.readouterr().err.startswith(f"error: {tmp_path / 'job.json'}: unknown field 'extra'")


def test_a_spec_round_trips(job):
    again = TrainJob.read(job.write())
    assert again == job and dataclasses.asdict(again) == dataclasses.asdict(job)


@pytest.mark.parametrize(
    ("content", "said"),
    [
        ('{"config": {"optim": {"lr": NaN}}, "run_dir": "r"}', "not a job spec (not JSON: NaN is not a number JSON allows)"),
        ('{"config": ' + '{"a": ' * 40 + "1" + "}" * 40 + ', "run_dir": "r"}', "config.a.a.a"),  # ... nested too deeply
    ],
    ids=["nan", "nested-too-deeply"],
)
def test_a_spec_read_through_the_bounded_reader(tmp_path, content, said):
    spec = tmp_path / "job.json"
    spec.write_text(content)
    with pytest.raises(PipelineError if "NaN" in content else MoeError, match="^" + re.escape(f"{spec}: {said}")):
        TrainJob.read(spec)


def test_a_fifo_in_place_of_the_spec_is_one_error_at_once(tmp_path, capsys):
    from pipeline.slurm_task import _read_job
    from tests.pipeline.fifo import fifo_at, within

    fifo = fifo_at(tmp_path / "job.json")
    with pytest.raises(MoeError, match=re.escape(f"{fifo}: not a regular file")):
        within(lambda: TrainJob.read(fifo), fifo)
    with pytest.raises(SystemExit) as info:
        within(lambda: _read_job(str(fifo)), fifo)
    assert info.value.code == 2 and capsys.readouterr().err.startswith(f"error: {fifo}: not a regular file")
