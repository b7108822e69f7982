"""Fused kernels for the MoE layer's memory-bound steps (Triton on CUDA, torch elsewhere)."""

from moe.kernels.rmsnorm import rms_norm
from moe.kernels.routing import combine, gather_reduce, gather_rows, use_triton
from moe.kernels.swiglu import swiglu

__all__ = ["combine", "gather_reduce", "gather_rows", "rms_norm", "swiglu", "use_triton"]
