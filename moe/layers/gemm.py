"""The expert GEMM seam: out[rows of group g] = x[rows of group g] @ w[g].T.

One declared base (:class:`ExpertGemm`) so FP8 (Hopper) and MXFP8 (Blackwell) kernels can
replace the bf16 grouped GEMM without touching the MoE layer: a backend implements the GEMM and
may override the expert MLP's hooks.
"""

from __future__ import annotations

from collections.abc import Callable
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
      does not declare it).

    The optimizer meets the expert weights here, once, through :meth:`bind` (called by the
    precision recipe, moe.precision.PrecisionRecipe.attach_optimizer): a weight's gradient sink
    and, for a backend that ``reads_masters``, the fp32 master its copies are made from. The
    backend hands the sink to its autograd Functions as an argument, and
    :func:`sink_weight_grad` decides there whether the sink or autograd takes the gradient (a
    Function that takes no sink says so by name: moe.layers.gemm_fp8._MxFakeQuant)."""

    deterministic: bool = False
    reads_token_rows: bool = False
    # whether bind(master=...) is taken: the backend makes its weight copies from fp32 masters
    reads_masters: bool = False

    def bind(self, weight: torch.Tensor, *, sink: GradientSink | None = None, master: torch.Tensor | None = None) -> None:
        """Declare where ``weight``'s gradient goes (``sink``: the optimizer's accumulator, see
        :class:`GradientSink`) and where its values live (``master``: the fp32 master, once the
        optimizer dropped the weight's own values). Called once per weight, before training."""
        if sink is not None:
            bound = self._sinks().get(weight)
            if bound is not None and bound is not sink:
                raise ValueError(f"{type(self).__name__}.bind: the weight has a gradient sink already (one optimizer per model)")
            self._sinks()[weight] = sink
        if master is not None:
            if not self.reads_masters:
                raise ValueError(f"{type(self).__name__} does not read weights from fp32 masters")
            self._read_master(weight, master)

    def sink_for(self, weight: torch.Tensor) -> GradientSink | None:
        """The sink bound to ``weight`` (this very tensor), or None: autograd takes its gradient."""
        sinks = self.__dict__.get("_weight_sinks")
        return sinks.get(weight) if sinks is not None else None

    def _sinks(self) -> WeakIdKeyDictionary:
        # per GEMM object, keyed by the weight tensor itself (weakly: a dropped model frees it)
        return self.__dict__.setdefault("_weight_sinks", WeakIdKeyDictionary())

    def _read_master(self, weight: torch.Tensor, master: torch.Tensor) -> None:
        raise NotImplementedError

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

    def accumulate_rows(self, rows: tuple, write_rows) -> None:
        """As ``accumulate`` for a GEMM over ``rows``: ``write_rows(rows, earlier, buffer, add,
        squares)``, where ``earlier`` is another micro-batch's rows the sink held for this GEMM, or
        None; ``squares``: return partial sums whose total is the buffer's sum of squares after
        the GEMM (else None)."""
        ...


def sink_route(sink: GradientSink | None, grad: torch.Tensor, fp8: bool) -> str | None:
    """Where an expert weight's gradient goes, decided here for every backend: ``"fp8"`` (the
    sink, through the FP8 accumulating GEMM, where the caller offers FP8 operands and the kernel
    runs here), ``"bf16"`` (the sink, through the bf16 accumulating GEMM, where it takes
    ``grad``), or None (no sink or no kernel: the caller returns the gradient to autograd, whose
    result the optimizer's hook adds to the fp32 gradient or keeps in bf16)."""
    if sink is None:
        return None
    if fp8 and fused_wgrad.supports_fp8(grad):
        return "fp8"
    return "bf16" if fused_wgrad.supports(grad, grad) else None


def sink_weight_grad(
    sink: GradientSink | None,
    grad: torch.Tensor,
    rows: Callable[[], torch.Tensor] | None,
    offsets: torch.Tensor,
    fp8_operands: Callable[[], tuple] | None = None,
) -> bool:
    """grad_g^T @ rows_g added into ``sink`` inside the GEMM, by :func:`sink_route`: FP8 from
    ``fp8_operands()`` (moe.layers.gemm_fp8's column quantisations; their scales applied in the
    epilogue), else bf16 from ``rows()`` (a callable: the row operand is made only when the
    kernel takes the gradient). False where the sink did not take it: the caller computes the
    gradient and returns it."""
    route = sink_route(sink, grad, fp8_operands is not None)
    if route == "fp8":
        gt, sgt, xt, sxt, padded = fp8_operands()
        sink.accumulate(lambda buf, add: fused_wgrad.grouped_wgrad_fp8(gt, sgt, xt, sxt, padded, buf, accumulate=add))
        return True
    if route is None:
        return False
    x = rows()
    if not fused_wgrad.supports(grad, x):
        return False
    sink.accumulate_rows((grad, x, offsets), _write_rows)
    return True


def _write_rows(rows: tuple, earlier: tuple | None, buf: torch.Tensor, add: bool, squares: bool = False) -> torch.Tensor | None:
    """The bf16 accumulating GEMM over a micro-batch's (grad, x, offsets), and an earlier
    micro-batch's in the same sum where the sink held them (optim.expert_wgrad=paired);
    ``squares``: the buffer's sum of squares from its epilogue (partial sums)."""
    grad, x, offsets = rows
    if squares:
        return fused_wgrad.grouped_wgrad(grad, x, offsets, buf, accumulate=add, pair=earlier, squares=True)
    fused_wgrad.grouped_wgrad(grad, x, offsets, buf, accumulate=add, pair=earlier)
    return None


class GroupedLinear(torch.autograd.Function):
    """x_g @ w[g].T with a backward that writes the weight gradient straight in w's own
    [G, M, K] layout (autograd's default produces it transposed, and AccumulateGrad then copies
    the whole expert-weight gradient to match the parameter's strides).

    ``sink``: the weight's gradient sink (:meth:`ExpertGemm.sink_for`); where the fused kernel
    takes the operands (CUDA) the weight gradient is accumulated into it inside its GEMM
    (moe.kernels.grouped_wgrad) instead of written and then added by a separate pass."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, sink: GradientSink | None) -> torch.Tensor:
        ctx.save_for_backward(x, w, offsets)
        ctx.sink = sink
        return grouped_mm(x, w.transpose(-2, -1), offs=offsets)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w, offsets = ctx.saved_tensors
        grad = grad.contiguous()  # grouped_mm rejects stride-0 gradients
        grad_x = grouped_mm(grad, w, offs=offsets) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1] and not sink_weight_grad(ctx.sink, grad, lambda: x, offsets):
            grad_w = grouped_mm(grad.t(), x, offs=offsets)
        return grad_x, grad_w, None, None


class GroupedMM(ExpertGemm):
    """torch's grouped GEMM (full speed in bf16 on sm90/sm100; runs on CPU too).

    Rows must have 16-byte strides (bf16: K and M multiples of 8). Empty groups are fine."""

    # Same inputs, same bits (train.deterministic relies on it; bench/determinism.py checks it).
    deterministic = True

    def __call__(self, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        dtype = compute_dtype(x, w)
        w = w.to(dtype)
        return GroupedLinear.apply(x.to(dtype), w, offsets, self.sink_for(w))


def check_routing_args(order, inverse, weights) -> bool:
    """Whether the expert MLP gets token rows and a permutation (all three) or expert-ordered rows."""
    given = [a is not None for a in (order, inverse, weights)]
    if any(given) and not all(given):
        raise ValueError("expert_mlp: order, inverse and weights go together (token rows) or are all None (expert-ordered rows)")
    return all(given)
