"""The expert GEMM seam: out[rows of group g] = x[rows of group g] @ w[g].T.

One declared base (:class:`ExpertGemm`) so FP8 (Hopper) and MXFP8 (Blackwell) kernels can
replace the bf16 grouped GEMM without touching the MoE layer: a backend implements the GEMM and
may override the expert MLP's hooks.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from moe.kernels import grouped_wgrad as fused_wgrad
from moe.kernels.swiglu import swiglu

# torch's grouped GEMM (public in newer torch, torch._grouped_mm before): every backend's bf16 path
grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm


class ExpertGemm:
    """The expert GEMM seam. A backend implements :meth:`__call__` and may override the hooks:

    - :meth:`swiglu_linear`: the down projection of SwiGLU(h) (FP8: the SwiGLU writes the FP8
      operand);
    - :meth:`expert_mlp`: the whole expert MLP; with ``reads_token_rows`` it also takes token rows
      and the routing permutation and returns the weighted combine (the rows are never gathered
      into a bf16 copy);
    - ``deterministic``: same inputs, same bits (``train.deterministic`` refuses a backend that
      does not declare it)."""

    deterministic: bool = False
    reads_token_rows: bool = False

    def __call__(self, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """x: [N, K] rows sorted by group; w: [G, M, K]; offsets: [G] int32 cumulative row ends
        (on the device). Returns [N, M]."""
        raise NotImplementedError

    def swiglu_linear(self, h: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self(swiglu(h), w, offsets)

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
        """The expert MLP on expert-ordered rows (the unfused default: up, SwiGLU, down)."""
        if check_routing_args(order, inverse, weights):
            raise NotImplementedError(f"{type(self).__name__} does not read token rows (reads_token_rows is False)")
        return self.swiglu_linear(self(x, gate_up, offsets), down, offsets)


def compute_dtype(x: torch.Tensor, w: torch.Tensor) -> torch.dtype:
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return w.dtype


class GradientSink(Protocol):
    """Where a weight's gradient goes when its GEMM accumulates it (the optimizer's holder)."""

    def accumulate(self, write) -> None:
        """Call ``write(buffer, add)`` once: the GEMM writes (``add`` False) or adds into
        ``buffer``; then do what autograd's AccumulateGrad would have done after it."""
        ...


# parameter -> its sink, registered by the optimizer (moe.optim) for the expert weights
gradient_sinks: WeakIdKeyDictionary = WeakIdKeyDictionary()


class GroupedLinear(torch.autograd.Function):
    """x_g @ w[g].T with a backward that writes the weight gradient straight in w's own
    [G, M, K] layout (autograd's default produces it transposed, and AccumulateGrad then copies
    the whole expert-weight gradient to match the parameter's strides).

    Where the optimizer registered a gradient sink for ``w`` and the fused kernel takes the
    operands (CUDA), the weight gradient is accumulated inside its GEMM
    (moe.kernels.grouped_wgrad) instead of written and then added by a separate pass."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w, offsets)
        ctx.sink = gradient_sinks.get(w)
        return grouped_mm(x, w.transpose(-2, -1), offs=offsets)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w, offsets = ctx.saved_tensors
        grad = grad.contiguous()  # grouped_mm rejects stride-0 gradients
        grad_x = grouped_mm(grad, w, offs=offsets) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            if ctx.sink is not None and fused_wgrad.supports(grad, x):
                ctx.sink.accumulate(lambda buf, add: fused_wgrad.grouped_wgrad(grad, x, offsets, buf, accumulate=add))
            else:
                grad_w = grouped_mm(grad.t(), x, offs=offsets)
        return grad_x, grad_w, None


class GroupedMM(ExpertGemm):
    """torch's grouped GEMM (full speed in bf16 on sm90/sm100; runs on CPU too).

    Rows must have 16-byte strides (bf16: K and M multiples of 8). Empty groups are fine."""

    # Same inputs, same bits (train.deterministic relies on it; bench/determinism.py checks it).
    deterministic = True

    def __call__(self, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        dtype = compute_dtype(x, w)
        return GroupedLinear.apply(x.to(dtype), w.to(dtype), offsets)


def check_routing_args(order, inverse, weights) -> bool:
    """Whether the expert MLP gets token rows and a permutation (all three) or expert-ordered rows."""
    given = [a is not None for a in (order, inverse, weights)]
    if any(given) and not all(given):
        raise ValueError("expert_mlp: order, inverse and weights go together (token rows) or are all None (expert-ordered rows)")
    return all(given)
