"""The fp32 gradient-accumulation kernel (moe.kernels.grad_add) under Triton's interpreter."""

from tests.helpers import run_under_triton_interpreter


def test_grad_add_matches_torch_bitwise_under_the_interpreter():
    run_under_triton_interpreter(["tests/kernels/grad_add_check.py"], "grad add ok")
