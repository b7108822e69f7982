"""The fused expert MLP behind the expert-GEMM seam (``model.moe.gemm: fused``).

The whole routed-expert computation, rows = x[row_index], a = swiglu(rows @ gate_up[g].T),
y = a @ down[g].T, runs as two persistent Triton grouped GEMMs forward and four backward
(moe.kernels.expert_mlp): the gather happens in the up projection's prologue (the expert-ordered
copy of the tokens is neither written nor saved), SwiGLU in its epilogue, dSwiGLU in the
epilogue of the down projection's dgrad, and the up projection's weight gradient reads the token
rows through the same indices. The combine's backward goes into the down projection's GEMMs
(grad_out read through the indices, each row scaled by its routing weight), so
its [N, D] gradient is never stored. What remains outside the GEMMs: the combine's forward
(a weighted sum without atomics), its weights' gradient (dot products) and the sum of each
token's k input-gradient rows (moe.kernels.routing). Saved for backward: h [N, 2H], a [N, H]
and y [N, D] (for the weights' gradient, as the unfused combine saves it), the permutation and
the weights, but not the gathered rows [N, D].

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
from moe.kernels.routing import combine_weight_grad, gather_reduce, use_triton
from moe.kernels.swiglu import swiglu
from moe.layers.dispatch import combine_rows
from moe.layers.gemm import GroupedMM, _grouped_mm, check_routing_args, compute_dtype
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
    """Rows (or token rows read through ``row_index``) -> y in expert order; with ``weights``
    and ``order`` also the weighted combine -> [T, D], whose backward never stores the combine's
    gradient rows: the down projection's dgrad reads grad_out through the indices and scales its
    accumulator rows by the routing weights in the epilogue, its wgrad scales the gathered rows
    in the prologue (rounded to bf16, as the separate combine backward would store them; the
    dgrad's rows are not rounded first), and the weights' gradient is the combine's dot products
    alone."""

    @staticmethod
    def forward(ctx, x, row_index, inverse, top_k, ends, gate_up, down, weights, order):
        ctx.gather = gather = inverse is not None
        ctx.combine = combine = weights is not None
        with span("expert_gemm"):
            h, act = expert_up_swiglu(x, row_index if gather else None, ends, gate_up)
            y = expert_down(act, ends, down)
        keep_y = combine and weights.requires_grad  # only the weights' gradient reads y
        ctx.save_for_backward(x, row_index, inverse, ends, gate_up, down, h, act, y if keep_y else None, weights, order)
        ctx.top_k = top_k
        if not combine:
            return y
        with span("dispatch"):
            return gather_reduce(y, inverse, weights, top_k)

    @staticmethod
    def backward(ctx, grad):
        x, row_index, inverse, ends, gate_up, down, h, act, y, weights, order = ctx.saved_tensors
        grad = grad.contiguous()
        need_x, need_gu, need_down = ctx.needs_input_grad[0], ctx.needs_input_grad[5], ctx.needs_input_grad[6]
        grad_weights = None
        if ctx.combine:  # grad is grad_out [T, D]; the rows' gradient is weight * grad_out[token]
            with span("dispatch"):
                if ctx.needs_input_grad[7]:
                    grad_weights = combine_weight_grad(grad, y, inverse, ctx.top_k).to(weights.dtype)
                row_weight = weights.reshape(-1).index_select(0, order).float()
            rows_in = {"row_index": row_index, "row_scale": row_weight}
            wgrad_in = {"grad_index": row_index, "grad_scale": row_weight}
        else:
            rows_in, wgrad_in = {}, {}
        with span("expert_gemm"):
            (dh,) = grouped_gemm(grad, down, ends, dswiglu_h=h, **rows_in)
            d_down = grouped_wgrad(grad, act, ends, **wgrad_in) if need_down else None
            d_gu = grouped_wgrad(dh, x, ends, row_index=row_index if ctx.gather else None) if need_gu else None
            dx_rows = grouped_gemm(dh, gate_up, ends)[0] if need_x else None
        dx = None
        if need_x:
            if ctx.gather:
                with span("dispatch"):
                    dx = gather_reduce(dx_rows, inverse, None, ctx.top_k)
            else:
                dx = dx_rows
        return dx, None, None, None, None, d_gu, d_down, grad_weights, None


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
            return combine_rows(y, inverse, weights) if routed else y
        if not routed:
            return _FusedExpertMLP.apply(x.contiguous(), None, None, 1, offsets, gate_up, down, None, None)
        args = (row_index.contiguous(), inverse.contiguous(), top_k, offsets, gate_up, down, weights.contiguous(), order.contiguous())
        return _FusedExpertMLP.apply(x.contiguous(), *args)
