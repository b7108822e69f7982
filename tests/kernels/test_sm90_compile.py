"""The FP8 gather and the combine's weight-gradient kernels compiled for sm90 here (no GPU needed):
they compile with the library's launch options and spill no registers. Speed itself is measured
on the GPU machine (bench/h200/kernels.sh)."""

import pytest

pytest.importorskip("triton")

from moe.kernels import fp8  # noqa: E402
from tests.kernels.sm90 import compile_for_sm90  # noqa: E402


def test_fp8_column_quantisation_through_indices_compiles_for_sm90_without_spills():
    """Both passes (the split column maxima, then the transposed quantise) at the shipped launch."""
    launch = fp8.COLS_LAUNCH
    blocks = {"BLOCK_R": launch["BLOCK_R"], "BLOCK_C": launch["BLOCK_C"]}
    operands = {"x": "*bf16", "row_index": "*i64", "row_scale": "*fp32", "ends": "*i32"}
    amax = compile_for_sm90(
        fp8._amax_cols_grouped_kernel,
        {**operands, "amax": "*fp32", "C": "i32", "stride_x": "i32"},
        {"GATHER": True, "ROW_SCALE": True, **blocks},
        num_warps=launch["num_warps"],
    )
    quant = compile_for_sm90(
        fp8._quant_cols_grouped_kernel,
        {
            **operands,
            "dst_ends": "*i32",
            "amax": "*fp32",
            "q": "*fp8e4nv",
            "s": "*fp32",
            **dict.fromkeys(["C", "stride_x", "stride_g", "stride_c"], "i32"),
        },
        {"PAD": True, "ALIGNED": True, "GATHER": True, "ROW_SCALE": True, **blocks},
        num_warps=launch["num_warps"],
    )
    for stats in (amax, quant):
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


def test_norm_backward_with_the_residual_gradient_compiles_for_sm90_without_spills():
    from moe.kernels import rmsnorm

    launch = rmsnorm.TORCH_FORWARD_BACKWARD_LAUNCH
    types = {"dy": "*bf16", "x": "*bf16", "w": "*bf16", "rstd": "*fp32", "dx": "*bf16", "dw": "*fp32", "res": "*bf16"}
    stats = compile_for_sm90(
        rmsnorm._rmsnorm_bwd,
        types | {"M": "i32", "D": "i32", "rows_per_program": "i32"},
        {"HAS_DW": True, "ROUND_N": False, "HAS_RES": True, "ROWS": launch["rows"], "BLOCK": 2048},
        num_warps=launch["warps"],
        num_stages=launch["stages"],
    )
    assert stats["spill_stack_bytes"] == 0 and stats["local_bytes"] == 0, stats


def test_single_group_column_quantiser_compiles_for_sm90_without_spills():
    stats = compile_for_sm90(
        fp8._quant_cols_kernel,
        {"x": "*bf16", "enc": "*fp32", "q": "*fp8e4nv", **dict.fromkeys(["R", "C", "W", "stride_x"], "i32")},
        {"BLOCK_R": 64, "BLOCK_C": 64},
        num_warps=4,
    )
    assert stats["spill_stack_bytes"] == 0 and stats["local_bytes"] == 0, stats
