"""The Triton kernels, run by Triton's interpreter on the CPU (a subprocess, since the
interpreter must be chosen before triton is imported)."""

import pytest

from tests.helpers import run_under_triton_interpreter

pytest.importorskip("triton")


def test_triton_kernels_match_torch_under_the_interpreter():
    run_under_triton_interpreter(["tests/kernels/routing_swiglu_check.py"], "kernels ok")
