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
