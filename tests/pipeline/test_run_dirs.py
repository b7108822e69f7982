"""A run directory is a folder holding only what a training run writes, with the run's record
(its job.json, or the caller's marker): a user's folder that merely looks like one is refused
before anything in it is replaced (issue 50, item 2)."""

import dataclasses
import json
import os
from pathlib import Path

import pytest

from pipeline.errors import PipelineError
from pipeline.run_dirs import LOG_HEADER, RUN_DIR_TEMPORARIES, _matches, check_run_dirs
from pipeline.train_job import TrainJob

ROW = '{"step": 1, "loss": 2.5, "lr": 0.001}\n'  # shaped like a run's metrics row


def _job_json(run):
    job = TrainJob(config={"checkpoint": {"dir": str(run / "ck")}}, run_dir=str(run))
    (run / "job.json").write_text(json.dumps(dataclasses.asdict(job)))


def test_a_users_metrics_jsonl_shaped_like_a_runs_is_refused_and_kept(tmp_path):
    from pipeline.stages.train import prepare_run

    run = tmp_path / "mine"
    run.mkdir()
    (run / "metrics.jsonl").write_text(ROW)
    with pytest.raises(PipelineError, match=f"executor.run_dir: {run} holds metrics.jsonl but no job.json"):
        check_run_dirs(run, run / "ck")
    job = TrainJob(config={"checkpoint": {"dir": str(tmp_path / "ck"), "resume": "auto"}}, run_dir=str(run))
    with pytest.raises(PipelineError, match="holds metrics.jsonl but no job.json"):
        prepare_run(job)  # the path that removed it for a fresh start
    assert (run / "metrics.jsonl").read_text() == ROW


@pytest.mark.parametrize(
    ("entry", "said"),
    [
        ("eval/", "holds eval, which a training run does not write"),
        ("notes.tmp", "holds notes.tmp, which a training run does not write"),
        (".bashrc.tmp-1", "holds .bashrc.tmp-1, which a training run does not write"),
        ("metrics.jsonl.tmp", "holds metrics.jsonl.tmp, whose content is not what a training run writes"),
        ("eval_requests.json.gz", "holds eval_requests.json.gz, whose content is not what a training run writes"),
    ],
)
def test_entries_no_run_writes_are_refused_even_beside_a_record(tmp_path, entry, said):
    run = tmp_path / "run"
    run.mkdir()
    _job_json(run)
    (run / "metrics.jsonl").write_text(ROW)
    if entry.endswith("/"):
        (run / entry).mkdir()
        (run / entry / "mine.txt").write_text("my notes\n")
    else:
        (run / entry).write_text("my notes\n")
    with pytest.raises(PipelineError, match=f"executor.run_dir: {run} {said}"):
        check_run_dirs(run, run / "ck")


def test_a_run_directory_with_its_record_or_only_its_lock_is_accepted(tmp_path):
    run = tmp_path / "run"
    (run / "ck").mkdir(parents=True)
    (run / ".lock").write_text("")
    (run / "ck/.lock").write_text("")
    check_run_dirs(run, run / "ck")  # what the lock leaves before the record is written
    _job_json(run)
    (run / "metrics.jsonl").write_text(ROW)
    (run / "metrics.jsonl.tmp").write_text(ROW)  # an older version's temporary
    (run / ".metrics.jsonl.tmp-12-ab").write_text(ROW)
    (run / "logs").mkdir()
    (run / "logs/rank0.log").write_text(f"{LOG_HEADER}: rank 0 of 1\n")
    check_run_dirs(run, run / "ck")


def test_a_callers_marker_is_its_runs_record(tmp_path):
    run = tmp_path / "paper"
    run.mkdir()
    (run / "metrics.jsonl").write_text(ROW)
    with pytest.raises(PipelineError, match="no job.json"):
        check_run_dirs(run, run / "checkpoints")
    (run / ".moe-paper-run").write_text("made by pipeline.paper.measure\n")
    check_run_dirs(run, run / "checkpoints", also=(".moe-paper-run",))


def test_the_temporaries_a_run_writes_are_names_the_check_accepts(tmp_path, monkeypatch):
    """The sink's and pipeline.outputs' temporaries (``.<name>.tmp-*``), and nothing wider."""
    from moe.train.sinks import JsonlSink

    path = tmp_path / "metrics.jsonl"
    path.write_text(ROW)
    renamed, real_replace = [], os.replace

    def recording_replace(src, dst):
        renamed.append(Path(src).name)
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", recording_replace)
    sink = JsonlSink(path)
    sink.log(1, {"loss": 1.0})
    sink.close({})
    assert renamed and all(_matches(name, RUN_DIR_TEMPORARIES) for name in renamed), renamed
    assert not _matches("notes.tmp", RUN_DIR_TEMPORARIES) and not _matches(".bashrc.tmp-1", RUN_DIR_TEMPORARIES)


HOLDER = {"pid": 4242, "host": "node1", "command": "moe train", "slurm_job_id": None, "since": "2026-12-03T18:00:00+00:00"}
SUMMARY = {"steps": 3, "start_step": 0, "final_loss": 2.5}


@pytest.mark.parametrize(
    ("name", "content", "ours"),
    [
        (".lock", json.dumps(HOLDER), True),
        (".lock", json.dumps({**HOLDER, "pid": "4242"}), False),  # wrong type
        (".lock", json.dumps({**HOLDER, "pid": 0}), False),  # out of range
        (".lock", json.dumps({**HOLDER, "user": "me"}), False),  # unknown key
        (".lock", json.dumps(HOLDER).replace("4242", "NaN"), False),  # NaN
        ("summary.json", json.dumps(SUMMARY), True),
        ("summary.json", json.dumps({**SUMMARY, "steps": "3"}), False),
        ("summary.json", json.dumps({**SUMMARY, "accuracy": 0.9}), False),
        ("summary.json", json.dumps(SUMMARY).replace("2.5", "NaN"), False),
        ("metrics.jsonl", ROW + '{"step": 2, "loss": "nan"}\n', True),  # the sink's text for a non-finite loss
        ("metrics.jsonl", ROW + '{"step": 2, "loss": "x"}\n', False),
        ("metrics.jsonl", ROW + '{"step": -2, "loss": 1.0}\n', False),
        ("metrics.jsonl", ROW + '{"step": 2, "my loss": 1.0}\n', False),
        ("metrics.jsonl", ROW + '{"step": 2, "loss": 1.0, oops\n', True),  # a line a kill tore: tolerated
    ],
    ids=[
        "lock",
        "lock-pid-text",
        "lock-pid-zero",
        "lock-unknown-key",
        "lock-nan",
        "summary",
        "summary-steps-text",
        "summary-unknown-key",
        "summary-nan",
        "metrics-nan-text",
        "metrics-text",
        "metrics-negative-step",
        "metrics-odd-key",
        "metrics-torn-line",
    ],
)
def test_a_runs_files_read_as_ours_only_as_their_writers_write_them(tmp_path, name, content, ours):
    """Issue 50: the lock, summary and metrics rows are checked against their writers' schemas
    (LOCK_HOLDER_SCHEMA, pipeline.worker.SUMMARY_SCHEMA, moe.train.sinks.METRIC_ROW)."""
    run = tmp_path / "run"
    run.mkdir()
    _job_json(run)
    (run / name).write_text(content)
    if ours:
        check_run_dirs(run, run / "ck")
    else:
        with pytest.raises(PipelineError, match=f"holds {name}, whose content is not what a training run writes"):
            check_run_dirs(run, run / "ck")


def test_a_large_metrics_file_is_checked_at_its_ends(tmp_path, monkeypatch):
    from pipeline import run_dirs

    run = tmp_path / "run"
    run.mkdir()
    _job_json(run)
    monkeypatch.setattr(run_dirs, "_SCAN", 200)
    rows = "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 100))
    (run / "metrics.jsonl").write_text(rows)
    check_run_dirs(run, run / "ck")
    (run / "metrics.jsonl").write_text(rows + '{"step": 100, "loss": "x"}\n')
    with pytest.raises(PipelineError, match="holds metrics.jsonl, whose content"):
        check_run_dirs(run, run / "ck")


@pytest.mark.parametrize("name", ["job.json", "summary.json", "metrics.jsonl", ".lock", "logs/rank0.log"])
def test_a_fifo_in_place_of_a_runs_file_is_refused_at_once(tmp_path, name):
    import threading

    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    if name != "job.json":
        _job_json(run)
    os.mkfifo(run / name)
    raised = []
    t = threading.Thread(target=lambda: raised.append(pytest.raises(PipelineError, check_run_dirs, run, run / "ck")), daemon=True)
    t.start()
    t.join(5)
    assert raised, f"a FIFO at {name} blocked the check"
    assert f"holds {name.split('/')[0]}, whose content is not what a training run writes" in str(raised[0].value)


def test_the_in_loop_tasks_a_launch_wrote_are_a_runs_own(tmp_path):
    """pipeline.eval.inloop writes them at launch beside job.json: a run directory holds them."""
    from moe.eval.requests import Request, TaskRequests, dump_task_requests

    run = tmp_path / "run"
    run.mkdir()
    _job_json(run)
    (run / "eval_requests.json.gz").write_bytes(dump_task_requests([TaskRequests("t", "acc", (Request(0, 0, (1,), (2,), 0, 1, 1, 0, 0),), 1)], {}))
    check_run_dirs(run, run / "ck")
