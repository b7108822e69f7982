"""FP8 expert GEMMs behind the expert-GEMM seam (selected by precision.recipe, not by the model).

Rowwise FP8 (``fp8_rowwise``, Hopper and later), for out = x_g @ w[g].T of every expert g:

| GEMM | A (row-major, e4m3) | B (column-major, e4m3) | scales (fp32, powers of two) |
| --- | --- | --- | --- |
| forward | x [N, K] | w [G, M, K] viewed [G, K, M] | per row of x; per (g, row of w) |
| dgrad | grad [N, M] | w transposed [G, K, M] viewed [G, M, K] | per row of grad; per (g, column of w) |
| wgrad | grad^T [M, N'] | x^T [K, N'] viewed [N', K] | per (g, column) of grad and of x |

Every scale runs along the GEMM's contraction dimension, so one outlier only coarsens its own
row/column (tensorwise scales let one token's outlier flush everyone else's small values).
Scales are powers of two (exact rescaling). wgrad contracts over each expert's tokens, so its
scales are per expert and its token groups are padded to multiples of 16 (N' >= N) with zeros.
Everything is e4m3 (also gradients: with per-row scales e5m2's extra range buys nothing and
costs a mantissa bit). Accumulation is fp32 and outputs are bf16 (torch._scaled_grouped_mm).
Quantisation is fused where the data is produced: SwiGLU writes the down projection's FP8
input and its scales directly (moe.kernels.fp8), and the bf16 product is never stored (the
backward recomputes it from the saved gate/up activations, which the SwiGLU backward keeps).
Weights are quantised once per weight version (:class:`WeightCache`: the micro-batches of a
step share the copies). With the local dispatcher the experts get token rows and the routing
permutation (:meth:`Fp8GroupedGemm.expert_mlp`): the up projection quantises the T tokens once
and gathers their FP8 bytes (k copies of a row share its scale) and its wgrad quantises columns
reading the tokens through the indices, so the bf16 expert-ordered copy is neither written nor
saved; the down projection and the combine share one backward that quantises grad_out per
token (routing weight folded into the row scale) and its columns through the indices, so the
combine's [N, D] gradient is never stored. Not fused yet: the wgrad operands' column passes
(two reads each), dSwiGLU's output (quantised by the up projection's backward), and the weight
copies (one pass per optimizer step). Measured on one H200: bench/NOTES.md.

Where the optimizer bound a gradient sink to an expert weight (``optim.expert_wgrad: gemm``, the
default; :meth:`ExpertGemm.bind`), wgrad runs inside a GEMM that adds it into the fp32 master gradient
(moe.kernels.grouped_wgrad): the FP8 one (the columnwise operands above, their scales applied
in the epilogue) where the rule's ``Fp8Gemms.sink_wgrad`` says so (the widest GEMMs), else the bf16
one (moe.layers.gemm.sink_weight_grad decides). FP8 wgrad with a separate add lost at every width: writing the bf16 result and adding it
into the fp32 gradient took 101 ms of a 2-layer paper-width step (bench.model --profile,
bench/NOTES.md).

Which GEMMs run in FP8 is decided per GEMM shape by :class:`Fp8Rule` (FP8 does not pay for
thin GEMMs: the quantisation passes and the FP8 kernel's fixed costs exceed the saving), the
rest run in bf16 through torch's grouped GEMM. The router, norms, softmax, loss and optimizer
never see FP8. The optimizer keeps fp32 masters of every weight; in training the expert
weights' own bf16 values are dropped and their FP8 copies made from the masters
(:meth:`WeightCache.read_from`), so the FP8 pair replaces the bf16 weight (2 bytes per expert
parameter, not 4). Checkpoints hold the masters and do not depend on the recipe.

``mxfp8`` (Blackwell, compute capability >= 10) quantises with 32-element e8m0 blocks
(moe.kernels.mxfp8). Its native MX grouped GEMM has not been run on sm100 hardware here, so
this module runs it as MX fake quantisation (quantise-dequantise, then the bf16 grouped GEMM)
for forward and dgrad, wgrad in bf16: MXFP8 numerics, not MXFP8 speed.

``emulate=True`` replaces torch._scaled_grouped_mm by dequantise + fp32 grouped GEMM: the same
quantised operands and scale layouts, runnable on CPU (tests).
"""

from __future__ import annotations

import torch

from moe.kernels.fp8 import gather_quantized_rows, quantize_cols_grouped, quantize_rows, swiglu_quantize
from moe.kernels.mxfp8 import mx_dequantize, mx_quantize
from moe.kernels.routing import combine_backward, combine_weight_grad, gather_reduce, gather_token_rows
from moe.kernels.swiglu import swiglu
from moe.layers.gemm import ExpertGemm, GradientSink, GroupedLinear, check_routing_args, grouped_mm, sink_route, sink_weight_grad
from moe.nn.fp8_policy import Fp8Gemms, Fp8Rule, WeightCache


def scaled_grouped_mm(a, b, scale_a, scale_b, offsets, emulate: bool) -> torch.Tensor:
    """torch._scaled_grouped_mm (bf16 out, fp32 accumulation), or its emulation on any device."""
    if not emulate:
        return torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offsets, out_dtype=torch.bfloat16, use_fast_accum=True)
    if b.dim() == 3:  # 2d x 3d: per-row scales of a, per (group, column) scales of b
        a32 = a.float() * scale_a[:, None]
        b32 = b.float() * scale_b[:, None, :]
    else:  # 2d x 2d, groups along the contraction: per (group, row) of a and (group, column) of b
        groups = offsets.numel()
        group = torch.searchsorted(offsets.long(), torch.arange(a.shape[1], device=a.device), right=True).clamp_max(groups - 1)
        a32 = a.float() * scale_a.view(groups, a.shape[0])[group].t()
        b32 = b.float() * scale_b.view(groups, b.shape[1])[group]
    return grouped_mm(a32, b32, offs=offsets).to(torch.bfloat16)


def _forward_fp8(xq, sx, w, offsets, emulate, cache: WeightCache | None = None):
    wq, sw = (cache or WeightCache()).rows(w)
    return scaled_grouped_mm(xq, wq.transpose(-2, -1), sx, sw, offsets, emulate)


def _dgrad(grad, w, offsets, fp8: bool, emulate: bool, cache: WeightCache | None = None):
    """grad [N, M] @ w[g] [M, K] -> [N, K]."""
    if not fp8:
        return grouped_mm(grad, (cache or WeightCache()).dense(w), offs=offsets)
    gq, sg = quantize_rows(grad)
    wt, swt = (cache or WeightCache()).cols(w)
    return scaled_grouped_mm(gq, wt.transpose(-2, -1), sg, swt, offsets, emulate)


def _fp8_wgrad_operands(grad, x, offsets, grad_index=None, grad_scale=None, x_index=None):
    """wgrad's FP8 operands: both quantised per (expert, column) and transposed, each expert's
    rows a zero-padded run (grad_index/grad_scale: grad's rows read through the routing indices
    and weighted; x_index: x's rows read through them)."""
    gt, sgt, padded = quantize_cols_grouped(grad, offsets, pad=True, row_index=grad_index, row_scale=grad_scale)
    xt, sxt, _ = quantize_cols_grouped(x, offsets, pad=True, row_index=x_index)
    return gt, sgt, xt, sxt, padded


def _wgrad(grad, x, offsets, fp8: bool, emulate: bool, row_index=None):
    """grad_g^T [M, n_g] @ x_g [n_g, K] -> [G, M, K] (w's own layout); x_g = x[row_index]_g when
    the rows are token rows read through the routing indices."""
    if not fp8:
        rows = x.index_select(0, row_index) if row_index is not None else x  # bf16: a transient copy
        return grouped_mm(grad.t(), rows, offs=offsets)
    gt, sgt, xt, sxt, padded = _fp8_wgrad_operands(grad, x, offsets, x_index=row_index)
    return scaled_grouped_mm(gt, xt.t(), sgt, sxt, padded, emulate)


def _weight_grad(ctx, grad, x, offsets, row_index=None):
    """The weight gradient of grad = x[row_index] @ w.T: into the optimizer's gradient sink where
    there is one (FP8 where the plan's ``sink_wgrad`` says so, else bf16; the sink kernels add
    inside the GEMM), else returned. None when the sink took it."""
    rows = lambda: x.index_select(0, row_index) if row_index is not None else x  # noqa: E731
    fp8_operands = (lambda: _fp8_wgrad_operands(grad, x, offsets, x_index=row_index)) if ctx.plan.sink_wgrad else None
    if sink_weight_grad(ctx.sink, grad, rows, offsets, fp8_operands):
        return None
    return _wgrad(grad, x, offsets, ctx.plan.wgrad, ctx.emulate, row_index=row_index)


class _Fp8Linear(torch.autograd.Function):
    """x_g @ w[g].T with each of the three GEMMs in FP8 or bf16 as the plan says."""

    @staticmethod
    def forward(ctx, x, w, offsets, plan: Fp8Gemms, emulate: bool, cache: WeightCache, sink: GradientSink | None):
        ctx.save_for_backward(x, w, offsets)
        ctx.plan, ctx.emulate, ctx.cache, ctx.sink = plan, emulate, cache, sink
        if plan.fwd:
            xq, sx = quantize_rows(x)
            return _forward_fp8(xq, sx, w, offsets, emulate, cache)
        return grouped_mm(x, cache.dense(w).transpose(-2, -1), offs=offsets)

    @staticmethod
    def backward(ctx, grad):
        x, w, offsets = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = _dgrad(grad, w, offsets, ctx.plan.dgrad, ctx.emulate, ctx.cache) if ctx.needs_input_grad[0] else None
        grad_w = _weight_grad(ctx, grad, x, offsets) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None, None, None, None, None


class _Fp8GatheredLinear(torch.autograd.Function):
    """tokens[row_index]_g @ w[g].T without the expert-ordered bf16 copy of the tokens: the T
    token rows are quantised once and their FP8 bytes gathered (k copies of a row share its
    scale), wgrad quantises columns reading through the indices, and only the tokens are saved
    (T rows, not T*k). dgrad's rows are summed per token through ``inverse`` (no atomics)."""

    @staticmethod
    def forward(ctx, tokens, row_index, inverse, top_k, w, offsets, plan: Fp8Gemms, emulate: bool, cache: WeightCache, sink: GradientSink | None):
        ctx.save_for_backward(tokens, row_index, inverse, w, offsets)
        ctx.top_k, ctx.plan, ctx.emulate, ctx.cache, ctx.sink = top_k, plan, emulate, cache, sink
        if plan.fwd:
            xq, sx = gather_quantized_rows(*quantize_rows(tokens), row_index)
            return _forward_fp8(xq, sx, w, offsets, emulate, cache)
        return grouped_mm(tokens.index_select(0, row_index), cache.dense(w).transpose(-2, -1), offs=offsets)

    @staticmethod
    def backward(ctx, grad):
        tokens, row_index, inverse, w, offsets = ctx.saved_tensors
        grad = grad.contiguous()
        grad_tokens = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_rows = _dgrad(grad, w, offsets, ctx.plan.dgrad, ctx.emulate, ctx.cache)
            grad_tokens = gather_reduce(grad_rows, inverse, None, ctx.top_k)
            del grad_rows  # freed before wgrad gathers its token rows: this was the FP8 step's peak
        if ctx.needs_input_grad[4]:
            grad_w = _weight_grad(ctx, grad, tokens, offsets, row_index=row_index)
        return grad_tokens, None, None, None, grad_w, None, None, None, None, None


class _Fp8SwiGLULinearCombine(torch.autograd.Function):
    """out[t] = sum_j weights[t, j] * (swiglu(h) @ w[g].T)[inverse[t*k + j]]: the down projection
    and the weighted combine in one backward, so the combine's gradient rows
    (weights[slot] * grad_out[token], [N, D]) are never stored in bf16:

    - dgrad's A operand is the token gradients quantised once per token ([T, D], not [N, D]) with
      their FP8 bytes gathered and each row's decode scale multiplied by its routing weight (the
      scale is a per-row fp32 factor of the GEMM, so this is the weighted row to e4m3 precision);
    - wgrad's columns are quantised per expert reading grad_out through the indices and
      multiplying by the weight in fp32 (moe.kernels.fp8.quantize_cols_grouped(row_scale=...));
    - the routing weights' gradient is the combine's dot products alone (no row writes).
    A GEMM the rule keeps in bf16 gets the weighted rows materialised, as before."""

    @staticmethod
    def forward(ctx, h, w, offsets, order, inverse, weights, plan: Fp8Gemms, emulate: bool, cache: WeightCache, sink: GradientSink | None):
        h = h.contiguous()
        if plan.fwd:
            aq, sa = swiglu_quantize(h)
            y = _forward_fp8(aq, sa, w, offsets, emulate, cache)
        else:
            y = grouped_mm(swiglu(h), cache.dense(w).transpose(-2, -1), offs=offsets)
        top_k = weights.shape[1]
        out = gather_reduce(y, inverse, weights, top_k)
        ctx.save_for_backward(h, w, offsets, order, inverse, weights, y)
        ctx.plan, ctx.emulate, ctx.cache, ctx.top_k, ctx.sink = plan, emulate, cache, top_k, sink
        return out

    @staticmethod
    def backward(ctx, grad_out):
        h, w, offsets, order, inverse, weights, y = ctx.saved_tensors
        plan, emulate, cache, top_k = ctx.plan, ctx.emulate, ctx.cache, ctx.top_k
        grad_out = grad_out.contiguous()
        row_index = order // top_k
        row_weight = weights.reshape(-1).index_select(0, order).float()  # the weight of each expert-ordered row
        rows_bf16 = grad_weights = None
        sink = ctx.sink if ctx.needs_input_grad[1] else None
        route = sink_route(sink, grad_out, plan.sink_wgrad)  # decided before the weighted rows are made (or not)
        fp8_sink, bf16_sink = route == "fp8", route == "bf16"
        if not (plan.dgrad and plan.wgrad) or bf16_sink:
            # the weighted rows (routing weight x token gradient, in expert order) and the
            # weights' gradient in one pass
            rows_bf16, grad_weights = combine_backward(grad_out, y, inverse, weights)
            grad_weights = grad_weights.to(weights.dtype)
        elif ctx.needs_input_grad[5]:
            grad_weights = combine_weight_grad(grad_out, y, inverse, top_k).to(weights.dtype)
        if not ctx.needs_input_grad[5]:
            grad_weights = None
        with torch.enable_grad():
            hh = h.detach().requires_grad_(True)
            a = swiglu(hh)
        if plan.dgrad:
            gq, sg = gather_quantized_rows(*quantize_rows(grad_out), row_index)
            wt, swt = cache.cols(w)
            grad_a = scaled_grouped_mm(gq, wt.transpose(-2, -1), sg * row_weight, swt, offsets, emulate)
        else:
            grad_a = grouped_mm(rows_bf16, cache.dense(w), offs=offsets)
        grad_w = None
        if fp8_sink:
            operands = lambda: _fp8_wgrad_operands(grad_out, a.detach(), offsets, grad_index=row_index, grad_scale=row_weight)  # noqa: E731
            sink_weight_grad(sink, grad_out, None, offsets, operands)
        elif ctx.needs_input_grad[1] and not sink_weight_grad(sink if bf16_sink else None, rows_bf16, a.detach, offsets):
            if plan.wgrad:
                gt, sgt, at, sat, padded = _fp8_wgrad_operands(grad_out, a.detach(), offsets, grad_index=row_index, grad_scale=row_weight)
                grad_w = scaled_grouped_mm(gt, at.t(), sgt, sat, padded, emulate)
            else:
                grad_w = grouped_mm(rows_bf16.t(), a.detach(), offs=offsets)
        (grad_h,) = torch.autograd.grad(a, hh, grad_a)
        return grad_h, grad_w, None, None, None, grad_weights, None, None, None, None


class _Fp8SwiGLULinear(torch.autograd.Function):
    """swiglu(h)_g @ w[g].T; forward quantises inside the SwiGLU kernel and keeps only h."""

    @staticmethod
    def forward(ctx, h, w, offsets, plan: Fp8Gemms, emulate: bool, cache: WeightCache, sink: GradientSink | None):
        h = h.contiguous()
        ctx.save_for_backward(h, w, offsets)
        ctx.plan, ctx.emulate, ctx.cache, ctx.sink = plan, emulate, cache, sink
        if plan.fwd:
            aq, sa = swiglu_quantize(h)
            return _forward_fp8(aq, sa, w, offsets, emulate, cache)
        return grouped_mm(swiglu(h), cache.dense(w).transpose(-2, -1), offs=offsets)

    @staticmethod
    def backward(ctx, grad):
        h, w, offsets = ctx.saved_tensors
        grad = grad.contiguous()
        with torch.enable_grad():
            hh = h.detach().requires_grad_(True)
            a = swiglu(hh)
        grad_a = _dgrad(grad, w, offsets, ctx.plan.dgrad, ctx.emulate, ctx.cache)
        grad_w = _weight_grad(ctx, grad, a.detach(), offsets) if ctx.needs_input_grad[1] else None
        (grad_h,) = torch.autograd.grad(a, hh, grad_a)
        return grad_h, grad_w, None, None, None, None, None


class Fp8GroupedGemm(ExpertGemm):
    """The ``fp8_rowwise`` expert GEMM (see the module docstring). Weights and activations arrive
    in bf16 (or fp32) and leave in bf16; the FP8 copies live only inside the GEMM calls."""

    reads_token_rows = True
    reads_masters = True  # a released weight's copies are made from its fp32 master (WeightCache)

    def __init__(self, rule: Fp8Rule | None = None, *, emulate: bool = False) -> None:
        self.rule, self.emulate = rule or Fp8Rule(), emulate
        self.cache = WeightCache()

    def _read_master(self, weight: torch.Tensor, master: torch.Tensor) -> None:
        self.cache.read_from(weight, master)

    def _plan(self, x: torch.Tensor, w: torch.Tensor) -> Fp8Gemms:
        groups, out_dim, in_dim = w.shape
        return self.rule.plan(x.shape[0], groups, out_dim, in_dim)

    def _cache_for(self, w: torch.Tensor) -> WeightCache:
        # only the parameter itself has a meaningful version; a converted copy is new each call
        return self.cache if w.dtype == torch.bfloat16 else WeightCache()

    def __call__(self, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        cache = self._cache_for(w)
        x, w = x.to(torch.bfloat16), w.to(torch.bfloat16)
        plan = self._plan(x, w)
        if not plan.any and not cache.reads_master(w):
            return GroupedLinear.apply(x, w, offsets, self.sink_for(w))
        return _Fp8Linear.apply(x, w, offsets, plan, self.emulate, cache, self.sink_for(w))

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
        """The expert MLP on expert-ordered rows x (-> rows), or on token rows with the routing
        permutation (-> the weighted combine [T, D]): then an FP8 up projection quantises the T
        tokens, not their k copies, and an FP8 down projection takes the combine's gradient
        without storing it (:class:`_Fp8SwiGLULinearCombine`)."""
        from moe.layers.dispatch import combine_rows

        offsets = offsets.to(torch.int32)
        if not check_routing_args(order, inverse, weights):
            return self.swiglu_linear(self(x, gate_up, offsets), down, offsets)
        top_k = weights.shape[1]
        row_index = order // top_k
        rows = row_index.numel()
        cache = self._cache_for(gate_up)
        x, w = x.to(torch.bfloat16), gate_up.to(torch.bfloat16)
        groups, out_dim, in_dim = w.shape
        plan = self.rule.plan(rows, groups, out_dim, in_dim)
        if plan.fwd or plan.wgrad:
            h = _Fp8GatheredLinear.apply(x, row_index, inverse, top_k, w, offsets, plan, self.emulate, cache, self.sink_for(w))
        else:  # bf16 forward and wgrad: today's gather and torch's grouped GEMM
            h = self(gather_token_rows(x, row_index, inverse, top_k), gate_up, offsets)
        down_cache = self._cache_for(down)
        wd = down.to(torch.bfloat16)
        groups, out_dim, in_dim = wd.shape
        down_plan = self.rule.plan_down(rows, groups, out_dim, in_dim)
        if down_plan.dgrad or down_plan.wgrad:
            h = h.to(torch.bfloat16)
            sink = self.sink_for(wd)
            return _Fp8SwiGLULinearCombine.apply(h, wd, offsets, order, inverse, weights, down_plan, self.emulate, down_cache, sink)
        return combine_rows(self.swiglu_linear(h, down, offsets), inverse, weights)

    def swiglu_linear(self, h: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """self(swiglu(h), w, offsets), with the SwiGLU writing FP8 when the GEMM is FP8."""
        cache = self._cache_for(w)
        h, w = h.to(torch.bfloat16), w.to(torch.bfloat16)
        plan = self.rule.plan_down(h.shape[0], *w.shape)
        if not plan.any and not cache.reads_master(w):
            return GroupedLinear.apply(swiglu(h), w, offsets, self.sink_for(w))
        return _Fp8SwiGLULinear.apply(h, w, offsets, plan, self.emulate, cache, self.sink_for(w))


class _MxFakeQuant(torch.autograd.Function):
    """x_g @ w[g].T with forward and dgrad operands MX-quantised along their contraction. Takes
    no gradient sink: wgrad (bf16) is always returned to autograd."""

    @staticmethod
    def forward(ctx, x, w, offsets):
        ctx.save_for_backward(x, w, offsets)
        return grouped_mm(_mx(x), _mx(w).transpose(-2, -1), offs=offsets)

    @staticmethod
    def backward(ctx, grad):
        x, w, offsets = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = grouped_mm(_mx(grad), _mx(w.transpose(-2, -1).contiguous()).transpose(-2, -1), offs=offsets)
        grad_w = grouped_mm(grad.t(), x, offs=offsets)
        return grad_x, grad_w, None


def _mx(t: torch.Tensor) -> torch.Tensor:
    return mx_dequantize(*mx_quantize(t)).to(t.dtype)


class MxFp8GroupedGemm(ExpertGemm):
    """The ``mxfp8`` expert GEMM: MX fake quantisation (see the module docstring). Its MX path
    refuses the gradient sink (:class:`_MxFakeQuant` returns wgrad, torch's bf16 grouped GEMM, to
    autograd and the optimizer's hook adds it: the accumulating kernels have not been run on
    sm100 here); the bf16 fallback for shapes MX cannot block passes the sink like GroupedMM."""

    def __call__(self, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        x, w = x.to(torch.bfloat16), w.to(torch.bfloat16)
        if x.shape[1] % 32 or w.shape[1] % 32:
            return GroupedLinear.apply(x, w, offsets, self.sink_for(w))
        return _MxFakeQuant.apply(x, w, offsets)
