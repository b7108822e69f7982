"""A micro-batch's low-precision gradient added into its fp32 accumulator in one vectorised pass.

torch runs ``acc.add_(bf16_grad)`` and the first micro-batch's ``bf16_grad.float()`` through its
mixed-dtype elementwise path (``unrolled_elementwise_kernel``: no vector loads), which moved
about 2.2 TB/s on an H200 (the 75 dense gradients of the 8-layer OLMoE-width step: 5.9 ms a
step, bench/results/wgrad_order/step-gaps-90c6d54.log). This kernel reads the gradient (2
bytes) and the accumulator (4) and writes the sum (4) with wide loads and stores; the first
micro-batch writes the cast (reads 2, writes 4). The values are torch's bit for bit: the
gradient widened exactly to fp32 and one fp32 add, rounded to nearest even.
On by default since it was measured (one H100, 6 layers, bench/NOTES.md 2026-12-07: the step's gradient
accumulation 5.5 -> 4.0 ms); ``MOE_GRAD_ADD=torch`` takes torch's add (the side-by-side).
"""

from __future__ import annotations

import contextlib

import torch

from moe.kernels.routing import HAVE_TRITON, use_triton
from moe.switches import choice

TRITON_ADD = choice("MOE_GRAD_ADD") == "triton"
BLOCK = 4096
WARPS = 8

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _grad_add_kernel(acc, grad, n, ADD: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(grad + offs, mask=mask).to(tl.float32)
        if ADD:
            g = tl.load(acc + offs, mask=mask) + g
        tl.store(acc + offs, g, mask=mask)


def _plain(t: torch.Tensor) -> bool:
    # a DTensor (FSDP) or another subclass keeps torch's own ops
    return type(t) is torch.Tensor or type(t) is torch.nn.Parameter


def _fits(grad: torch.Tensor, acc: torch.Tensor | None) -> bool:
    return (
        TRITON_ADD
        and use_triton(grad)
        and _plain(grad)
        and grad.is_contiguous()
        and grad.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and (
            acc is None
            or (_plain(acc) and acc.is_contiguous() and acc.dtype == torch.float32 and acc.shape == grad.shape and acc.device == grad.device)
        )
    )


def accumulate_fp32(acc: torch.Tensor | None, grad: torch.Tensor) -> torch.Tensor:
    """``acc + grad`` in fp32, in place in ``acc``; with no ``acc`` yet, ``grad`` in a new fp32
    tensor. The same values as ``acc.add_(grad)`` / ``grad.float()``."""
    if not _fits(grad, acc):
        return grad.float() if acc is None else acc.add_(grad)
    out = torch.empty(grad.shape, dtype=torch.float32, device=grad.device) if acc is None else acc
    n = grad.numel()
    if n:
        with torch.cuda.device(grad.device) if grad.is_cuda else contextlib.nullcontext():  # a hook may run on another device's thread
            _grad_add_kernel[(triton.cdiv(n, BLOCK),)](out, grad, n, ADD=acc is not None, BLOCK=BLOCK, num_warps=WARPS)
    return out
