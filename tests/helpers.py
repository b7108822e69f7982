"""Shared test helpers: small token corpora and configs, and Triton interpreter runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

from moe.config import ExperimentConfig
from moe.data import write_token_file


def make_corpus(directory: Path, *, files: int = 2, tokens: int = 4000, vocab: int = 256, seed: int = 0,
                tokenizer_hash: str | None = "tok-hash") -> list[Path]:
    """Token files of a learnable synthetic language: noisy repeated phrases separated by EOS=0."""
    rng = np.random.default_rng(seed)
    phrases = [rng.integers(1, vocab, size=rng.integers(4, 12)) for _ in range(16)]
    paths = []
    for f in range(files):
        out: list[int] = []
        while len(out) < tokens:
            for _ in range(rng.integers(3, 8)):
                out.extend(phrases[rng.integers(len(phrases))].tolist())
            out.append(0)
        path = directory / f"part-{f:05d}.npy"
        write_token_file(path, np.array(out[:tokens]), vocab_size=vocab, eos_id=0, tokenizer_hash=tokenizer_hash)
        paths.append(path)
    return paths


def tiny_config(data_dir: Path, ckpt_dir: Path, **sections: Any) -> ExperimentConfig:
    base: dict[str, Any] = {
        "model": {"preset": "tiny", "vocab_size": 256},
        "data": {"paths": [str(data_dir)], "seq_len": 32},
        "train": {"max_steps": 6, "log_every": 1, "global_batch_size": 4, "micro_batch_size": 2},
        "schedule": {"warmup_steps": 2},
        "checkpoint": {"dir": str(ckpt_dir)},
    }
    for key, value in sections.items():
        base.setdefault(key, {}).update(value)
    return ExperimentConfig.load(base)


REPO = Path(__file__).resolve().parents[1]


def run_under_triton_interpreter(args: list[str], expect: str, timeout: int = 600) -> None:
    """Run ``python *args`` with TRITON_INTERPRET=1 (a fresh process: the interpreter must be
    chosen before triton is imported) and assert it exits 0 and prints ``expect``."""
    import pytest

    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr
    assert expect in r.stdout, r.stdout + r.stderr


SKIP_IN_COPIES = ("data/", "runs/", "metrics/", "plots/")


def copy_checkout(dest: Path, skip_prefixes: tuple[str, ...] = (), skip_files: tuple[str, ...] = ()) -> Path:
    """Copy this checkout's tracked and untracked-but-not-ignored files into ``dest`` (a project
    as a user would have it), without pipeline outputs (data/, runs/, metrics/, plots/, dvc.lock)
    and whatever else the caller names."""
    import shutil

    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True, text=True,
                           check=True).stdout.split()
    skip = SKIP_IN_COPIES + tuple(skip_prefixes)
    for f in files:
        src = REPO / f
        if src.is_file() and not f.startswith(skip) and f not in ("dvc.lock", *skip_files):
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / f)
    return dest

