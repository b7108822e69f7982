"""FP8 quantisation kernels: Triton (interpreter, in a subprocess since the interpreter must be
chosen before triton is imported) and the torch fallback, against the reference in fp8_check."""

from tests.helpers import run_under_triton_interpreter
from tests.kernels import fp8_check


def test_torch_path_matches_the_reference():
    assert fp8_check.main() == 0


def test_triton_kernels_match_the_reference_under_the_interpreter():
    run_under_triton_interpreter(["tests/kernels/fp8_check.py"], "fp8 kernels ok")


def test_the_default_rule_sends_to_fp8_only_the_shapes_measured_faster_in_fp8():
    """The step measurements behind Fp8Rule's defaults (one H200, bench/NOTES.md "The FP8 rule
    from the step sweep"), as whole expert MLPs (up [2h, d], down [d, h]): FP8 won at the paper's
    width with 1,024 rows per expert and lost at 512; at OLMoE width it won with 2,048 rows, tied
    at 1,024 and lost at 512; at d = h = 1024 it lost at 2,048 rows and won at 4,096."""
    from moe.nn.fp8_policy import Fp8Rule

    rule = Fp8Rule()
    measured = [  # (d, h, top_k, tokens, FP8 won)
        (4096, 4096, 4, 16384, True),
        (4096, 4096, 4, 8192, False),
        (2048, 1024, 8, 16384, True),
        (2048, 1024, 8, 8192, False),
        (2048, 1024, 8, 4096, False),
        (1024, 1024, 8, 32768, True),
        (1024, 1024, 8, 16384, False),
    ]
    for d, h, top_k, tokens, fp8 in measured:
        rows = tokens * top_k
        for plan in (rule.plan(rows, 64, 2 * h, d), rule.plan_down(rows, 64, d, h)):
            assert (plan.fwd, plan.dgrad, plan.wgrad) == (fp8, fp8, fp8), (d, h, tokens)
    forced = Fp8Rule(0).plan(16, 8, 48, 64)
    assert forced.fwd and forced.dgrad and forced.wgrad
    assert not Fp8Rule(0).plan(16, 8, 40, 64).fwd  # FP8 operands need multiples of 16
