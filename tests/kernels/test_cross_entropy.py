"""The fused cross-entropy kernel under Triton's interpreter (a subprocess, since the interpreter
must be chosen before triton is imported) against torch's loss, value and gradient, with the
logit z-loss and ignored targets, writing its gradient to a copy and over the logits."""

from tests.helpers import run_under_triton_interpreter


def test_fused_cross_entropy_matches_torch_under_the_interpreter():
    run_under_triton_interpreter(["tests/kernels/cross_entropy_check.py"], "cross entropy ok")
