"""FP8 quantisation kernels: Triton (interpreter, in a subprocess since the interpreter must be
chosen before triton is imported) and the torch fallback, against the reference in fp8_check."""

from tests.helpers import run_under_triton_interpreter
from tests.kernels import fp8_check


def test_torch_path_matches_the_reference():
    assert fp8_check.main() == 0


def test_triton_kernels_match_the_reference_under_the_interpreter():
    run_under_triton_interpreter(["tests/kernels/fp8_check.py"], "fp8 kernels ok")
