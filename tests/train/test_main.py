"""`python -m moe.train run.json`, the library's own entry point (moe/train/process.py is the
lifecycle it shares with the pipeline's worker): a run, and bad input as one error line."""

import json
import subprocess
import sys

from tests.helpers import REPO, make_corpus, tiny_config


def _run(*args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "moe.train", *args], capture_output=True, text=True, cwd=cwd, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    )


def test_a_run_from_a_json_config_and_bad_input_as_one_error_line(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    make_corpus(corpus)
    cfg = tiny_config(corpus, tmp_path / "ckpt", train={"max_steps": 3, "log_every": 1}, schedule={"warmup_steps": 1})
    (tmp_path / "run.json").write_text(json.dumps(cfg.to_dict()))
    r = _run("run.json", "--summary-json", "out/summary.json", "--metrics-jsonl", "out/metrics.jsonl", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    summary = json.loads((tmp_path / "out/summary.json").read_text())
    assert summary["steps"] == 3 and len((tmp_path / "out/metrics.jsonl").read_text().splitlines()) >= 3

    (tmp_path / "broken.json").write_text("{not json")
    r = _run("broken.json", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("error: broken.json: not valid JSON") and "Traceback" not in r.stderr
    r = _run("run.json", "--set", "optim.lr=-1", cwd=tmp_path)
    assert r.returncode == 2 and "optim.lr" in r.stderr and "Traceback" not in r.stderr, r.stderr


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
