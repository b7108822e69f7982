"""bench.eval end to end on CPU at toy size: `moe tasks --export` writes the tokenised suite,
the bench checks its scores (batched vs unbatched, the peers beside) and writes its JSON."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(cwd)},
    )


def test_export_then_bench_on_cpu(tmp_path):
    from pipeline.tokenizer import train_bpe

    words = ["the", "of", "and", "a", "to", "in", "is", "was", "question", "answer", "which", "what"]
    words += ["science", "water", "energy", "plants", "animals"]
    train_bpe([" ".join(words[i:] + words[:i]) for i in range(len(words))] * 20, 400).save(str(tmp_path / "tokenizer.json"))
    r = _run(
        "-m",
        "pipeline.cli",
        "tasks",
        "--export",
        "reqs.json.gz",
        "--tokenizer",
        "tokenizer.json",
        "--task",
        "arc_easy",
        "--task",
        "winogrande",
        "--task",
        "mmlu_stem_mc_5shot",
        "--limit",
        "4",
        "--max-len",
        "2048",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "3 tasks, 12 documents" in r.stdout + r.stderr
    body = json.loads(gzip.decompress((tmp_path / "reqs.json.gz").read_bytes()))
    assert body["format"] == "moe-eval-requests/1" and body["vocab_size"] >= 257 and len(body["tasks"]) == 3

    r = _run(
        "-m",
        "bench.eval",
        "--requests",
        "reqs.json.gz",
        "--device",
        "cpu",
        "--layers",
        "1",
        "--d-model",
        "64",
        "--experts",
        "8",
        "--expert-hidden",
        "32",
        "--batch-tokens",
        "4096",
        "--repeats",
        "2",
        "--peer-repeats",
        "1",
        "--check-samples",
        "6",
        "--no-save",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    assert "batched vs unbatched (no padding), 6 sampled requests: max |diff| 0.0000" in out
    for row in ("ours (subset)", "ours, plain batches (subset)", "transformers OlmoeForCausalLM (subset)", "ours (whole suite)"):
        assert row in out, out


@pytest.mark.parametrize("content", [b"not gzip", gzip.compress(b'{"format": "other"}', mtime=0)], ids=["not-gzip", "other-format"])
def test_a_file_that_is_not_an_export_is_one_error(tmp_path, content):
    from moe.errors import ConfigError
    from moe.eval.requests import load_task_requests

    (tmp_path / "x.json.gz").write_bytes(content)
    with pytest.raises(ConfigError, match="x.json.gz: not a"):
        load_task_requests(tmp_path / "x.json.gz")
