"""The fused expert-MLP kernels (moe.kernels.expert_mlp) under Triton's interpreter, in a
subprocess since the interpreter must be chosen before triton is imported."""

from tests.helpers import run_under_triton_interpreter


def test_fused_expert_mlp_matches_the_per_expert_loop_under_the_interpreter():
    run_under_triton_interpreter(["tests/kernels/expert_mlp_check.py"], "expert mlp kernels ok")
