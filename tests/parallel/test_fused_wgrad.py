"""Issue 38: the expert weight gradient accumulated inside its GEMM keeps a data-parallel run's
overlapped reduction working (two gloo ranks, ZeRO-1, under the Triton interpreter, where the
fused kernel runs on CPU)."""

import pytest

from tests.helpers import run_under_triton_interpreter

pytestmark = pytest.mark.distributed


def test_overlapped_zero1_reduction_with_the_gradient_accumulated_in_the_gemm():
    run_under_triton_interpreter(["tests/parallel/fused_wgrad_ranks_check.py"], "fused wgrad ranks ok")
