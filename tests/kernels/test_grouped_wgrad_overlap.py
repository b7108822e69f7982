"""The Gluon wgrad kernel (moe/kernels/grouped_wgrad_overlap.py) compiled for sm90 here: wgmma on
both operands from shared memory, no spills, within an sm90 block's shared memory, and the old
sum's TMA load issued inside the main loop. Its results are checked on the GPU
(tests/kernels/grouped_wgrad_overlap_gpu_check.py); where it does not apply, the Triton kernel
serves (CPU, interpreter, paired micro-batches)."""

import re

import pytest
import torch

pytest.importorskip("triton")

from moe.kernels import grouped_wgrad_overlap as overlap  # noqa: E402

needs_gluon = pytest.mark.skipif(not overlap.HAVE_GLUON, reason="this Triton has no Gluon")


@needs_gluon
@pytest.mark.parametrize("config", list(overlap.CONFIGS))
@pytest.mark.parametrize("accumulator", ["*fp32", "*bf16"])
@pytest.mark.parametrize("accumulate", [True, False])
def test_the_overlap_kernel_compiles_for_sm90_with_wgmma_no_spills_and_fits_shared_memory(config, accumulator, accumulate):
    from tests.kernels.sm90 import compile_for_sm90

    block_m, block_n, block_k, stages, sum_buffers, sum_at, warps = overlap.CONFIGS[config]
    stats = compile_for_sm90(
        overlap._grouped_wgrad_overlap_kernel,
        {"grad": "*bf16", "x": "*bf16", "ends": "*i32", "order": "*i32", "out": accumulator, "G": "i32", "M": "i32", "K": "i32"},
        {
            "ACCUMULATE": accumulate,
            "ORDERED": True,
            "BLOCK_M": block_m,
            "BLOCK_N": block_n,
            "BLOCK_K": block_k,
            "STAGES": stages,
            "SUM_BUFFERS": sum_buffers,
            "SUM_AT": sum_at,
            "num_warps": warps,
        },
        num_warps=warps,
        return_ptx=True,
    )
    assert stats["wgmma"] and stats["spill_stack_bytes"] == 0 and stats["local_bytes"] == 0, {k: v for k, v in stats.items() if k != "ptx"}
    assert stats["shared_bytes"] <= 227 * 1024, stats["shared_bytes"]
    loads = len(re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::\w+\.global", stats["ptx"]))  # ::cluster or ::cta by version
    assert loads >= (3 if accumulate else 2), "operand loads (and the old sum's, when accumulating) through TMA"


def test_it_declines_what_it_cannot_take():
    """CPU tensors, paired micro-batches and an M that is not a multiple of the tile go to the Triton kernel."""
    grad, x = torch.zeros(8, 256, dtype=torch.bfloat16), torch.zeros(8, 128, dtype=torch.bfloat16)
    out = torch.zeros(2, 256, 128)
    assert not overlap.supports(grad, x, out)
    assert not overlap.supports(grad, x, out, paired=True)
