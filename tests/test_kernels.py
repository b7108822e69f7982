"""The Triton kernels, run by Triton's interpreter on the CPU (a subprocess, since the
interpreter must be chosen before triton is imported)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
REPO = Path(__file__).resolve().parents[1]


def test_triton_kernels_match_torch_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, str(REPO / "tests/kernels_check.py")], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "kernels ok" in r.stdout
