"""The fused expert MLP behind the expert-GEMM seam (``model.moe.gemm: fused``).

The whole routed-expert computation, rows = x[row_index], a = swiglu(rows @ gate_up[g].T),
y = a @ down[g].T, runs as two persistent Triton grouped GEMMs forward and four backward
(moe.kernels.expert_mlp): the gather happens in the up projection's prologue (the expert-ordered
copy of the tokens is neither written nor saved), SwiGLU in its epilogue, dSwiGLU in the
epilogue of the down projection's dgrad, and the up projection's weight gradient reads the token
rows through the same indices. What remains outside the GEMMs is the combine and the sum of each
token's k input-gradient rows (moe.kernels.routing, no atomics). Saved for backward: h [N, 2H]
and a [N, H] (as the unfused path), but not the gathered rows [N, D].

Deterministic (fixed-order tile arithmetic). Where Triton does not run (CPU without the
interpreter), and for fp32 on CUDA, the same function runs on torch's grouped GEMM, so a config
that names ``fused`` trains anywhere. The two forward GEMMs are torch ops (``moe::expert_up_swiglu``,
``moe::expert_down``), so selective activation recompute keeps their outputs as it keeps torch's
grouped GEMM's (moe.parallel.recompute); it then keeps a [N, H] as well as h and y (the
unfused path recomputes a from h), about 0.27 GB more per MoE layer at OLMoE width and 16K
tokens, which ``moe plan`` does not model yet. ``fused`` with an FP8 recipe is refused by the config
(the recipe brings its own expert GEMM).
"""

from __future__ import annotations

from typing import Optional

import torch

from moe.kernels.expert_mlp import grouped_gemm, grouped_wgrad
from moe.kernels.routing import gather_reduce, use_triton
from moe.kernels.swiglu import swiglu
from moe.layers.dispatch import combine_rows
from moe.layers.gemm import GroupedMM, _grouped_mm, compute_dtype
from moe.spans import span


@torch.library.custom_op("moe::expert_up_swiglu", mutates_args=())
def expert_up_swiglu(
    x: torch.Tensor,
    row_index: Optional[torch.Tensor],  # noqa: UP045 (torch 2.11's schema inference reads typing.Optional)
    ends: torch.Tensor,
    gate_up: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, swiglu(h)) for h = x[row_index] @ gate_up[g].T. A torch op (not a bare launch) so
    activation recompute's policies can keep its outputs like torch's grouped GEMM's."""
    return grouped_gemm(x, gate_up.transpose(1, 2), ends, row_index=row_index, swiglu_epilogue=True)


@expert_up_swiglu.register_fake
def _(x, row_index, ends, gate_up):
    rows = row_index.shape[0] if row_index is not None else x.shape[0]
    return x.new_empty(rows, gate_up.shape[1]), x.new_empty(rows, gate_up.shape[1] // 2)


@torch.library.custom_op("moe::expert_down", mutates_args=())
def expert_down(act: torch.Tensor, ends: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """act @ down[g].T per expert group (a torch op, as :func:`expert_up_swiglu`)."""
    return grouped_gemm(act, down.transpose(1, 2), ends)[0]


@expert_down.register_fake
def _(act, ends, down):
    return act.new_empty(act.shape[0], down.shape[1])


# what activation recompute keeps (moe.parallel.recompute)
FORWARD_OPS = (torch.ops.moe.expert_up_swiglu, torch.ops.moe.expert_down)


class _FusedExpertMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, row_index, inverse, top_k, ends, gate_up, down):
        ctx.gather = gather = inverse is not None
        with span("expert_gemm"):
            h, act = expert_up_swiglu(x, row_index if gather else None, ends, gate_up)
            y = expert_down(act, ends, down)
        ctx.save_for_backward(x, row_index if gather else None, inverse, ends, gate_up, down, h, act)
        ctx.top_k = top_k
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, row_index, inverse, ends, gate_up, down, h, act = ctx.saved_tensors
        grad_y = grad_y.contiguous()
        need_x, need_gu, need_down = ctx.needs_input_grad[0], ctx.needs_input_grad[5], ctx.needs_input_grad[6]
        with span("expert_gemm"):
            (dh,) = grouped_gemm(grad_y, down, ends, dswiglu_h=h)
            d_down = grouped_wgrad(grad_y, act, ends) if need_down else None
            d_gu = grouped_wgrad(dh, x, ends, row_index=row_index) if need_gu else None
            dx_rows = grouped_gemm(dh, gate_up, ends)[0] if need_x else None
        dx = None
        if need_x:
            if ctx.gather:
                with span("dispatch"):
                    dx = gather_reduce(dx_rows, inverse, None, ctx.top_k)
            else:
                dx = dx_rows
        return dx, None, None, None, None, d_gu, d_down


def _reference_mlp(x, row_index, ends, gate_up, down):
    """The same computation on torch ops (devices where Triton does not run)."""
    rows = x.index_select(0, row_index) if row_index is not None else x
    h = _grouped_mm(rows, gate_up.transpose(-2, -1), offs=ends)
    return _grouped_mm(swiglu(h), down.transpose(-2, -1), offs=ends)


class FusedExpertMLP(GroupedMM):
    """Expert GEMMs with the gather and SwiGLU fused in (see the module docstring).

    Called as a plain grouped GEMM (``gemm(x, w, offsets)``) it is torch's; the experts call
    :meth:`expert_mlp` for the whole MLP, with token rows and their routing indices when the
    dispatcher is local."""

    deterministic = True

    def expert_mlp(
        self,
        x: torch.Tensor,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        offsets: torch.Tensor,
        *,
        order: torch.Tensor | None = None,
        inverse: torch.Tensor | None = None,
        weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Rows already in expert order [N, D] -> y [N, D]; or token rows [T, D] with the routing
        permutation (``order`` [T*k]: the slot of each expert-ordered row, ``inverse`` its inverse,
        ``weights`` [T, k]) -> the weighted combine [T, D], the rows read through order // k."""
        routed = check_routing_args(order, inverse, weights)
        dtype = compute_dtype(x, gate_up)
        x, gate_up, down = x.to(dtype), gate_up.to(dtype), down.to(dtype)
        offsets = offsets.to(torch.int32)
        top_k = weights.shape[1] if routed else 1
        row_index = order // top_k if routed else None
        if not use_triton(x) or (x.is_cuda and dtype == torch.float32):  # fp32 on CUDA: torch's (the kernels' tiles are sized for bf16)
            y = _reference_mlp(x, row_index, offsets, gate_up, down)
        else:
            if routed:
                row_index, inverse = row_index.contiguous(), inverse.contiguous()
            y = _FusedExpertMLP.apply(x.contiguous(), row_index, inverse if routed else None, top_k, offsets, gate_up, down)
        return combine_rows(y, inverse, weights) if routed else y


def check_routing_args(order, inverse, weights) -> bool:
    """Whether the expert MLP gets token rows and a permutation (all three) or expert-ordered rows."""
    given = [a is not None for a in (order, inverse, weights)]
    if any(given) and not all(given):
        raise ValueError("expert_mlp: order, inverse and weights go together (token rows) or are all None (expert-ordered rows)")
    return all(given)
