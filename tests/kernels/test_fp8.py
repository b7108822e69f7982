"""FP8 quantisation kernels: Triton (interpreter, in a subprocess since the interpreter must be
chosen before triton is imported) and the torch fallback, against the reference in fp8_check."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kernels import fp8_check

REPO = Path(__file__).resolve().parents[2]


def test_torch_path_matches_the_reference():
    assert fp8_check.main() == 0


def test_triton_kernels_match_the_reference_under_the_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, str(REPO / "tests/kernels/fp8_check.py")], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "fp8 kernels ok" in r.stdout
