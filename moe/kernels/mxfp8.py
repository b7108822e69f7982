"""MXFP8 quantisation (OCP microscaling): e4m3 elements, one e8m0 (power-of-two) scale per
32 consecutive elements along the contraction dimension.

The scale rule is "round the scale up" (RCEIL, as cuBLAS and Transformer Engine do):
scale = 2^ceil(log2(amax / 448)), so no element of a block exceeds the e4m3 range and
nothing saturates; the OCP spec's floor rule would clip the top of every block's range.
Scales stay on the device as float8_e8m0fnu; torch ops only (no host sync).
"""

from __future__ import annotations

import torch

from moe.kernels.fp8 import E4M3, E4M3_MAX

BLOCK = 32
E8M0_BIAS = 127


def mx_scale_exponents(amax: torch.Tensor) -> torch.Tensor:
    """ceil(log2(amax / 448)) as int32, clamped to e8m0's range; all-zero blocks get the minimum."""
    ratio = amax.float() / E4M3_MAX
    mantissa, exponent = torch.frexp(ratio)  # ratio = mantissa * 2^exponent, mantissa in [0.5, 1)
    exp = torch.where(mantissa == 0.5, exponent - 1, exponent)
    exp = torch.where(ratio > 0, exp, torch.full_like(exp, -E8M0_BIAS))
    return exp.clamp(-E8M0_BIAS, E8M0_BIAS).int()


def mx_quantize(x: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] (K a multiple of block) -> (e4m3 [..., K], e8m0 scales [..., K // block])."""
    if x.shape[-1] % block:
        raise ValueError(f"mxfp8: the last dimension ({x.shape[-1]}) must be a multiple of {block}")
    blocks = x.float().unflatten(-1, (x.shape[-1] // block, block))
    exp = mx_scale_exponents(blocks.abs().amax(-1))
    q = (blocks * torch.exp2(-exp.float()).unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).flatten(-2)
    scales = (exp + E8M0_BIAS).to(torch.uint8).view(torch.float8_e8m0fnu)
    return q, scales


def mx_dequantize(q: torch.Tensor, scales: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    exp = scales.view(torch.uint8).int() - E8M0_BIAS
    return (q.float().unflatten(-1, (q.shape[-1] // block, block)) * torch.exp2(exp.float()).unsqueeze(-1)).flatten(-2)
