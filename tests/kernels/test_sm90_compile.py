"""The fused expert-MLP and FP8 gather kernels compiled for sm90 here (no GPU needed): they
compile with the library's launch options, use Hopper's wgmma, stay pipelined (shared memory for
more than one stage of operands) and spill no registers. Speed itself is measured on the GPU
machine (bench/h200/kernels.sh)."""

import pytest

pytest.importorskip("triton")

from moe.kernels import expert_mlp as em  # noqa: E402
from moe.kernels import fp8  # noqa: E402
from tests.kernels.sm90 import compile_for_sm90  # noqa: E402

GEMM_TYPES = {
    "a": "*bf16",
    "row_index": "*i64",
    "row_scale": "*fp32",
    "b": "*bf16",
    "ends": "*i32",
    "block_ends": "*i32",
    "out": "*bf16",
    "act": "*bf16",
    "h_saved": "*bf16",
    "dh": "*bf16",
    **dict.fromkeys(["G", "K", "N", "stride_am", "stride_bg", "stride_bk", "stride_bn"], "i32"),
}


# What the library launches: the up projection and the down projection's forward read the
# weight transposed in place (its contraction stride is 1), dgrad reads it as stored (output
# stride 1); a real launch specialises an integer argument equal to 1 into a constant.
LAUNCHES = {
    "up_swiglu": ("swiglu", "stride_bk"),
    "down_forward": ("plain", "stride_bk"),
    "down_dgrad_dswiglu": ("dswiglu", "stride_bn"),
    "up_dgrad": ("plain", "stride_bn"),
}


@pytest.mark.parametrize("launch", sorted(LAUNCHES))
@pytest.mark.parametrize("gather", [True, False])
def test_grouped_gemm_compiles_for_sm90_pipelined_without_spills(launch, gather):
    mode, unit_stride = LAUNCHES[launch]
    block_n = em.BLOCK_N // 2 if mode != "plain" else em.BLOCK_N
    types = {k: v for k, v in GEMM_TYPES.items() if k != unit_stride}
    stats = compile_for_sm90(
        em._grouped_gemm_kernel,
        types,
        {
            unit_stride: 1,
            "GATHER": gather,
            "ROW_SCALE": gather and mode == "dswiglu",  # the combine's gradient read through the indices
            "SWIGLU": mode == "swiglu",
            "DSWIGLU": mode == "dswiglu",
            "IEEE": False,
            "LOG2_G": 8,
            "BLOCK_M": em.BLOCK_M,
            "BLOCK_N": block_n,
            "BLOCK_K": em.BLOCK_K,
        },
        **em.CUDA_LAUNCH,
    )
    assert stats["wgmma"], stats
    assert stats["spill_stack_bytes"] == 0 and stats["local_bytes"] == 0, stats
    one_stage = (em.BLOCK_M * em.BLOCK_K + em.BLOCK_K * block_n * (2 if mode == "swiglu" else 1)) * 2
    assert stats["shared_bytes"] >= 2 * one_stage, stats


# the up projection's wgrad gathers the token rows; the down projection's the combine's gradient
# (grad_out through the indices, times the routing weight); without a dispatcher neither
WGRAD_LAUNCHES = {"up_tokens": (True, False), "down_combine": (False, True), "rows": (False, False)}


@pytest.mark.parametrize("launch", sorted(WGRAD_LAUNCHES))
def test_grouped_wgrad_compiles_for_sm90_pipelined_without_spills(launch):
    gather, gather_grad = WGRAD_LAUNCHES[launch]
    stats = compile_for_sm90(
        em._grouped_wgrad_kernel,
        {
            "grad": "*bf16",
            "a": "*bf16",
            "row_index": "*i64",
            "grad_index": "*i64",
            "grad_scale": "*fp32",
            "ends": "*i32",
            "out": "*bf16",
            **dict.fromkeys(["G", "M", "K", "stride_am"], "i32"),
        },
        {
            "GATHER": gather,
            "GATHER_GRAD": gather_grad,
            "GRAD_SCALE": gather_grad,
            "IEEE": False,
            "BLOCK_M": em.WGRAD_BLOCK_M,
            "BLOCK_N": em.WGRAD_BLOCK_N,
            "BLOCK_K": em.WGRAD_BLOCK_K,
        },
        **em.CUDA_LAUNCH,
    )
    assert stats["wgmma"], stats
    assert stats["spill_stack_bytes"] == 0 and stats["local_bytes"] == 0, stats
    one_stage = (em.WGRAD_BLOCK_M + em.WGRAD_BLOCK_N) * em.WGRAD_BLOCK_K * 2
    assert stats["shared_bytes"] >= 2 * one_stage, stats


def test_fp8_column_quantisation_through_indices_compiles_for_sm90_without_spills():
    stats = compile_for_sm90(
        fp8._quant_cols_grouped_kernel,
        {
            "x": "*bf16",
            "row_index": "*i64",
            "row_scale": "*fp32",
            "ends": "*i32",
            "dst_ends": "*i32",
            "q": "*fp8e4nv",
            "s": "*fp32",
            **dict.fromkeys(["C", "stride_x", "stride_g", "stride_c"], "i32"),
        },
        {"PAD": True, "GATHER": True, "ROW_SCALE": True, "BLOCK_R": 64, "BLOCK_C": 64},
        num_warps=4,
    )
    assert stats["spill_stack_bytes"] == 0 and stats["local_bytes"] == 0, stats


def test_combine_weight_gradient_kernel_compiles_for_sm90():
    from moe.kernels import routing

    stats = compile_for_sm90(
        routing._combine_backward_kernel,
        {"grad_out": "*bf16", "y": "*bf16", "idx": "*i64", "w": "*fp32", "grad_y": "*fp32", "grad_w": "*fp32", "D": "i32"},
        {"K": 8, "BLOCK": 1024, "WRITE_GRAD_Y": False},
        num_warps=4,
    )
    assert stats["spill_stack_bytes"] == 0, stats


def test_single_group_column_quantiser_compiles_for_sm90_without_spills():
    stats = compile_for_sm90(
        fp8._quant_cols_kernel,
        {"x": "*bf16", "enc": "*fp32", "q": "*fp8e4nv", **dict.fromkeys(["R", "C", "W", "stride_x"], "i32")},
        {"BLOCK_R": 64, "BLOCK_C": 64},
        num_warps=4,
    )
    assert stats["spill_stack_bytes"] == 0 and stats["local_bytes"] == 0, stats
