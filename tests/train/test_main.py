"""`python -m moe.train run.json`, the library's own entry point (moe/train/process.py is the
lifecycle it shares with the pipeline's worker): a run, and bad input as one error line."""

import argparse
import json
import re
import subprocess
import sys

import pytest

from moe.eval.requests import Request, TaskRequests, dump_task_requests
from tests.helpers import REPO, make_corpus, tiny_config


def _run(*args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "moe.train", *args], capture_output=True, text=True, cwd=cwd, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    )


def test_a_run_from_a_json_config_and_bad_input_as_one_error_line(tmp_path):
    """The run evaluates in the loop as the pipeline's does (train.eval_*): the tasks from a
    tokenised-requests file, the validation loss from token files."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    make_corpus(corpus)
    train = {"max_steps": 3, "log_every": 1, "eval_every": 3, "eval_tasks": ["toy"], "eval_limit": None, "eval_val_batches": 1}
    cfg = tiny_config(corpus, tmp_path / "ckpt", train=train, schedule={"warmup_steps": 1})
    (tmp_path / "run.json").write_text(json.dumps(cfg.to_dict()))
    toy = TaskRequests("toy", "acc", (Request(0, 0, (5, 6), (7,), 0, 2, 2, 1, 1), Request(0, 1, (5, 6), (8, 9), 0, 3, 3, 2, 2)), 1)
    (tmp_path / "toy.json.gz").write_bytes(dump_task_requests([toy], {"task_names": ["toy"], "limit": None, "max_len": cfg.model.max_seq_len}))
    evals = ("--eval-requests", "toy.json.gz", "--eval-val", "corpus")
    r = _run("run.json", "--summary-json", "out/summary.json", "--metrics-jsonl", "out/metrics.jsonl", *evals, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    summary = json.loads((tmp_path / "out/summary.json").read_text())
    rows = [json.loads(line) for line in (tmp_path / "out/metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == 3 and len(rows) >= 3
    assert {"eval/val_loss", "eval/toy/acc"} <= rows[-1].keys() and rows[-1]["step"] == 3

    (tmp_path / "broken.json").write_text("{not json")
    r = _run("broken.json", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("error: broken.json: not valid JSON") and "Traceback" not in r.stderr
    r = _run("run.json", "--set", "optim.lr=-1", cwd=tmp_path)
    assert r.returncode == 2 and "optim.lr" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_in_loop_flags_and_keys_must_agree(tmp_path):
    """Tasks asked for without their file, a file without tasks, or flags without train.eval_every:
    one error naming the key or the flag, before any training."""
    from moe.errors import ConfigError
    from moe.train.__main__ import in_loop_eval

    on = tiny_config(tmp_path, tmp_path / "ck", train={"eval_every": 2, "eval_tasks": ["core"]})
    for cfg, flags, said in [
        (on, {}, "train.eval_tasks: pass them tokenised with --eval-requests"),
        (on.replace(train=on.train.replace(eval_tasks=[])), {"eval_requests": "r.json.gz"}, "--eval-requests: train.eval_tasks is empty"),
        (on.replace(train=on.train.replace(eval_every=0)), {"eval_val": "val"}, "--eval-val: train.eval_every is 0"),
    ]:
        args = argparse.Namespace(**{"eval_requests": None, "eval_val": None, **flags})
        with pytest.raises(ConfigError, match=re.escape(said)):
            in_loop_eval(cfg, args)


def _config_json(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    make_corpus(corpus)
    cfg = tiny_config(corpus, tmp_path / "ckpt", train={"max_steps": 2, "log_every": 1}, schedule={"warmup_steps": 1})
    (tmp_path / "run.json").write_text(json.dumps(cfg.to_dict()))


def test_output_flags_never_write_through_a_symlink_and_refuse_before_training(tmp_path):
    """Issue 50: --summary-json (and --metrics-jsonl) at a symlink wrote into the file it points
    at; a directory there failed with a traceback after the whole run. Both are refused with one
    error line naming the flag before anything trains (no checkpoint written)."""
    _config_json(tmp_path)
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me\n")
    (tmp_path / "link.json").symlink_to(victim)
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("x\n")
    for args, said in (
        (["--summary-json", "link.json"], "--summary-json: link.json is a symlink; refusing to write through it"),
        (["--metrics-jsonl", "link.json"], "--metrics-jsonl: link.json is a symlink; refusing to write through it"),
        (["--summary-json", "adir"], "--summary-json: adir exists and is not a regular file"),
        (["--summary-json", "afile/summary.json"], "--summary-json: afile/summary.json: "),
    ):
        r = _run("run.json", *args, cwd=tmp_path)
        errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
        assert r.returncode == 2 and len(errors) == 1 and said in errors[0] and "Traceback" not in r.stderr, r.stderr
        assert not (tmp_path / "ckpt").exists(), args
    assert victim.read_text() == "keep me\n" and (tmp_path / "link.json").is_symlink()


def test_the_summary_replaces_an_earlier_one_through_a_temporary(tmp_path):
    _config_json(tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out/summary.json").write_text("{}\n")
    r = _run("run.json", "--summary-json", "out/summary.json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "out/summary.json").read_text())["steps"] == 2
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["summary.json"]  # no temporary left


def test_a_config_file_that_is_not_a_mapping_of_sections_is_one_error_line(tmp_path):
    """Issue 50: the config file comes in through moe.reader (bounded, no NaN, a mapping of
    sections); ExperimentConfig then checks every key."""
    for name, text, said in (
        ("list.json", "[1, 2]", "error: list.json: the file: expected a mapping, got [1, 2]"),
        ("nan.json", '{"optim": {"lr": NaN}}', "error: nan.json: not valid JSON (NaN is not a number JSON allows)"),
        ("key.json", '{"Model Size": 1}', "error: key.json: the file key: expected a string matching"),
    ):
        (tmp_path / name).write_text(text)
        r = _run(name, cwd=tmp_path)
        assert r.returncode == 2 and r.stderr.startswith(said) and "Traceback" not in r.stderr, r.stderr


def test_a_fifo_as_the_config_file_is_refused_at_once(tmp_path, capsys):
    import os
    import threading

    from moe.train.__main__ import main

    os.mkfifo(tmp_path / "run.json")
    codes = []
    t = threading.Thread(target=lambda: codes.append(main([str(tmp_path / "run.json")])), daemon=True)
    t.start()
    t.join(30)
    assert codes == [2], "reading a FIFO config blocked"
    assert "run.json: not a regular file" in capsys.readouterr().err
