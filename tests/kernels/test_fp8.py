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
    from the step sweep"): FP8 won at paper width with 1,024 rows per expert and lost at 512; at
    OLMoE width it won with 2,048 rows, tied at 1,024 and lost at 512."""
    from moe.nn.fp8_policy import Fp8Rule

    rule = Fp8Rule()
    paper = [(8192, 4096), (4096, 4096)]  # gate_up [2h, d] and down [d, h], h = d = 4096
    olmoe = [(2048, 2048), (2048, 1024)]
    cases = [(16384 * 4, paper, True), (8192 * 4, paper, False), (16384 * 8, olmoe, True), (8192 * 8, olmoe, False), (4096 * 8, olmoe, False)]
    cases += [(32768 * 8, [(1024, 1024)], True), (16384 * 8, [(1024, 1024)], False)]  # d = h = 1024: down
    for tokens, shapes, fp8 in cases:
        for out_dim, in_dim in shapes:
            plan = rule.plan(tokens, 64, out_dim, in_dim)
            assert (plan.fwd, plan.dgrad, plan.wgrad) == (fp8, fp8, fp8), (tokens, out_dim, in_dim)
    forced = Fp8Rule(0).plan(16, 8, 48, 64)
    assert forced.fwd and forced.dgrad and forced.wgrad
    assert not Fp8Rule(0).plan(16, 8, 40, 64).fwd  # FP8 operands need multiples of 16
