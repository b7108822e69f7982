"""Several bias-free projections of one input (attention's q, k and v), their input gradients
summed inside the GEMMs.

Autograd gives each ``F.linear`` its own input gradient and sums them in separate add kernels:
for q, k and v two adds of a [tokens, d] bf16 tensor per layer and micro-batch (read two, write
one: 192 MiB each at 16,384 tokens of d=2048; about 3 ms of the 6-layer OLMoE-width step on an
H100, bench/results/step_target/8e75da9/profiles.log). Here the first product writes the input
gradient and each later one adds into it in its GEMM's epilogue (``addmm_``, beta=1: a read of
the buffer, no extra kernel). The forward and the weight gradients are ``F.linear``'s own; the
input gradient is summed in fp32 inside each GEMM and rounded once per product (autograd rounds
each product, then each sum). On by default since it was timed (one H100, bench/NOTES.md 2026-12-07:
0.2-0.6% off the paired, graphed OLMoE-width step); ``MOE_SHARED_INPUT_GRAD=autograd`` keeps autograd's
adds (the side-by-side).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from moe.switches import choice

SUM_IN_GEMM = choice("MOE_SHARED_INPUT_GRAD") == "gemm"


class _SharedInputLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.save_for_backward(x, *weights)
        ctx.set_materialize_grads(False)  # an unused output's weight gets no gradient, as with F.linear
        return tuple(F.linear(x, w) for w in weights)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads: torch.Tensor | None):
        x, *weights = ctx.saved_tensors
        x2 = x.reshape(-1, x.shape[-1])
        dx, dws = None, []
        for i, (g, w) in enumerate(zip(grads, weights, strict=True)):
            if g is None:
                dws.append(None)
                continue
            g2 = g.reshape(-1, g.shape[-1])
            if ctx.needs_input_grad[0]:
                dx = torch.mm(g2, w) if dx is None else dx.addmm_(g2, w)
            dws.append(g2.t().mm(x2) if ctx.needs_input_grad[1 + i] else None)
        if dx is None and ctx.needs_input_grad[0]:
            dx = torch.zeros_like(x2)
        return (dx.view(x.shape) if dx is not None else None, *dws)


def _no_hooks(m: nn.Module) -> bool:
    # the Function does not go through the module's __call__: its hooks would not run
    return not (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks)


def _global_module_hooks() -> bool:
    from torch.nn.modules import module as mod

    return bool(mod._global_forward_hooks or mod._global_forward_pre_hooks or mod._global_backward_hooks or mod._global_backward_pre_hooks)


def _casts_under_autocast(x: torch.Tensor) -> bool:
    # autocast to x's own dtype (the bf16 recipe on bf16 weights) casts nothing: F.linear inside
    # the Function gives what it gives outside; to another dtype it would cast inside F.linear and
    # leave the backward's operands of two dtypes
    device_type = x.device.type
    return torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type) != x.dtype


def _plain_linears(linears: tuple[nn.Module, ...], x: torch.Tensor) -> bool:
    # another module (an FP8 linear of the precision recipe) keeps its own forward
    if x.device.type not in ("cuda", "cpu") or _casts_under_autocast(x) or _global_module_hooks():
        return False
    return all(
        type(m) is nn.Linear and m.bias is None and m.weight.dtype == x.dtype and type(m.weight) in (torch.Tensor, nn.Parameter) and _no_hooks(m)
        for m in linears
    )


def shared_input_linear(x: torch.Tensor, *linears: nn.Module) -> tuple[torch.Tensor, ...]:
    """(m(x) for m in linears), with one input gradient summed inside the backward's GEMMs where
    every module is a bias-free ``nn.Linear`` of x's dtype without hooks (outside autocast or under
    an autocast to x's dtype, the bf16 recipe's; on CPU or CUDA); otherwise each module's own call.
    (A backward split into input and weight halves would run the weight GEMMs in both: no pipeline
    schedule here splits it.)"""
    if SUM_IN_GEMM and len(linears) > 1 and torch.is_grad_enabled() and _plain_linears(linears, x):
        return _SharedInputLinear.apply(x, *(m.weight for m in linears))
    return tuple(m(x) for m in linears)
