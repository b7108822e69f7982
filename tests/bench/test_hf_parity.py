"""bench.hf_parity on CPU at toy size: in fp32 the library's training step and the plain
transformers loop (with the objective written out in it) give the same losses, step by step."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import moe


@pytest.mark.slow
def test_moe_train_and_a_transformers_loop_train_alike(workspace):
    assert moe("tokenize", "--no-mlflow").returncode == 0
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.hf_parity",
            "--data",
            "data/tokens",
            "--layers",
            "2",
            "--d-model",
            "32",
            "--heads",
            "2",
            "--experts",
            "8",
            "--expert-hidden",
            "16",
            "--steps",
            "12",
            "--seq",
            "32",
            "--micro",
            "2",
            "--accum",
            "2",
            "--lr",
            "3e-3",
            "--window",
            "3",
            "--tail",
            "4",
            "--no-save",
            "--out",
            "par",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(Path("par/result.json").read_text())
    assert result["initial_logits_rel_err"] < 1e-5
    ours, hf = result["curves"]["ours"], result["curves"]["hf"]
    assert len(ours) == len(hf) == 12 and ours[-1] < ours[0]
    assert max(abs(a - b) / b for a, b in zip(ours, hf, strict=True)) < 1e-4, (ours, hf)
