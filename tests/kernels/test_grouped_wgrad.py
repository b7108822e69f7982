"""The expert weight-gradient GEMM that accumulates in its epilogue (issue 38): under the Triton
interpreter against a per-expert float64 loop and through the optimizer's gradient sink against
the separate path; compiled for sm90 here with the shipped tile config (no GPU needed). Speed is
measured on the GPU machine (python -m bench.wgrad, bench/h200/wgrad_in_gemm.sh)."""

import pytest

from tests.helpers import run_under_triton_interpreter

pytest.importorskip("triton")


def test_kernel_and_gradient_sink_match_the_references_under_the_interpreter():
    run_under_triton_interpreter(["tests/kernels/grouped_wgrad_check.py"], "grouped wgrad ok")


@pytest.mark.parametrize("kernel", ["bf16", "fp8"])
@pytest.mark.parametrize("accumulator", ["*fp32", "*bf16"])
def test_the_shipped_tile_config_compiles_for_sm90_with_wgmma_no_spills_and_fits_shared_memory(kernel, accumulator):
    import torch

    from moe.kernels import grouped_wgrad as gw
    from tests.kernels.sm90 import compile_for_sm90

    extra = {}
    if kernel == "bf16":
        fn, config = gw._grouped_wgrad_kernel, gw.CUDA_CONFIG
        operands = {"grad": "*bf16", "x": "*bf16", "grad2": "*bf16", "x2": "*bf16", "ends2": "*i32", "order": "*i32", "sq": "*fp32"}
        extra = {"ORDERED": True, "PAIRED": True, "SQUARES": True}  # the paired kernel with the squares: the largest
    else:  # the FP8 kernel's operands are K-major e4m3 with fp32 decode scales
        fn, config = gw._grouped_wgrad_fp8_kernel, gw.FP8_CUDA_CONFIG
        operands = {"gt": "*fp8e4nv", "sg": "*fp32", "xt": "*fp8e4nv", "sx": "*fp32", "W": "i32"}
    block_m, block_n, block_k, warps, stages = config
    stats = compile_for_sm90(
        fn,
        operands | {"ends": "*i32", "out": accumulator, "G": "i32", "M": "i32", "K": "i32"},
        {
            "ACCUMULATE": True,
            "SPLIT_EPILOGUE": gw.split_epilogue(block_n, torch.float32 if accumulator == "*fp32" else torch.bfloat16),
            "IEEE": False,
            "BLOCK_M": block_m,
            "BLOCK_N": block_n,
            "BLOCK_K": block_k,
            **extra,
        },
        num_warps=warps,
        num_stages=stages,
        return_ptx=True,
    )
    assert stats["wgmma"] and stats["spill_stack_bytes"] == 0 and stats["local_bytes"] == 0, stats
    assert stats["shared_bytes"] <= 227 * 1024, stats  # an sm90 block's shared memory
    if kernel == "fp8":
        assert "e4m3.e4m3" in stats["ptx"], "FP8 tensor cores, not an upcast to bf16"


def test_the_expert_ranking_compiles_for_sm90_without_spills():
    from moe.kernels import grouped_wgrad as gw
    from tests.kernels.sm90 import compile_for_sm90

    types = {"ends": "*i32", "ends2": "*i32", "order": "*i32", "G": "i32"}
    stats = compile_for_sm90(gw._rank_kernel, types, {"PAIRED": True, "BLOCK": gw.RANK_BLOCK}, num_warps=gw.RANK_WARPS)
    assert stats["spill_stack_bytes"] == 0 and stats["local_bytes"] == 0, stats


def test_the_squares_of_skipped_experts_compile_for_sm90_without_spills():
    """moe.kernels.grouped_wgrad's _empty_squares_kernel at the shipped column block (256)."""
    from moe.kernels import grouped_wgrad as gw
    from tests.kernels.sm90 import compile_for_sm90

    types = {"out": "*fp32", "ends": "*i32", "ends2": "*i32", "sq": "*fp32", "G": "i32", "M": "i32", "K": "i32", "n_blocks": "i32"}
    stats = compile_for_sm90(gw._empty_squares_kernel, types, {"PAIRED": True, "BLOCK_M": 32, "BLOCK_N": gw.CUDA_CONFIG[1]}, num_warps=4)
    assert stats["spill_stack_bytes"] == 0 and stats["local_bytes"] == 0, stats
