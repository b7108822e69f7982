"""The fixed-point kernels of train.layout_invariant under Triton's interpreter (a subprocess: the
interpreter must be chosen before triton is imported), bitwise against the torch path."""

from tests.helpers import run_under_triton_interpreter


def test_fixed_point_kernels_match_the_torch_path_bitwise_under_the_interpreter():
    run_under_triton_interpreter(["tests/kernels/fixed_point_check.py"], "fixed point kernels ok")
