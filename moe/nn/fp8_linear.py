"""FP8 rowwise for the dense projections (``precision.fp8_dense``: attention q/k/v/o, dense and
shared-expert MLPs; never the LM head or the router), on torch._scaled_mm.

The same recipe as the expert GEMMs (moe.layers.gemm_fp8): e4m3 operands with power-of-two
scales along each GEMM's contraction, fp32 accumulation, bf16 out.

| GEMM | A (row-major) | B (column-major) | scales |
| --- | --- | --- | --- |
| forward | x [M, K] | w [N, K] viewed [K, N] | per row of x; per row of w |
| dgrad | grad [M, N] | w^T [K, N] viewed [N, K] | per row of grad; per column of w |
| wgrad | grad^T [N, M'] | x^T [K, M'] viewed [M', K] | per column of grad and of x (over all tokens) |

wgrad contracts over the tokens, so its operands are quantised per column over the whole
batch and padded to a multiple of 16 tokens with zeros. Weight copies are made once per weight
version (micro-batches share them). A GEMM runs in FP8 only where the rule says so (all three
dimensions large: the quantisation passes cost more than thin GEMMs save); the rest in bf16.
Swapping the class of an ``nn.Linear`` keeps its parameter and state-dict keys, so checkpoints do
not depend on the recipe. Each projection quantises its own input (q, k and v each quantise x;
a fused qkv projection would do it once). Measured on one H200 in bench/NOTES.md (issue 39).
"""

from __future__ import annotations

import torch
from torch import nn

from moe.kernels.fp8 import quantize_cols, quantize_rows
from moe.nn.fp8_policy import DENSE_MIN_DIM, Fp8Gemms, Fp8Rule, WeightCache


def _scaled_mm(a, b, scale_a, scale_b, emulate: bool, fast_accum: bool) -> torch.Tensor:
    """a [M, K] (e4m3, row-major) @ b [K, N] (e4m3, column-major), per-row / per-column fp32
    scales -> bf16 (torch._scaled_mm), or its emulation (dequantise, matmul with fp32
    accumulation) on any device. ``fast_accum`` only for the forward: Hopper's fast FP8
    accumulation does not promote partial sums, and the gradients' contractions are the long
    ones (wgrad: every token of the micro-batch), as torchao's float8 does."""
    if emulate:
        return ((a.float() * scale_a[:, None]) @ (b.float() * scale_b[None, :])).to(torch.bfloat16)
    return torch._scaled_mm(a, b, scale_a=scale_a[:, None], scale_b=scale_b[None, :], out_dtype=torch.bfloat16, use_fast_accum=fast_accum)


class _Fp8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, plan, emulate: bool, cache: WeightCache):
        ctx.save_for_backward(x, w)
        ctx.plan, ctx.emulate, ctx.cache = plan, emulate, cache
        if plan.fwd:
            xq, sx = quantize_rows(x)
            wq, sw = cache.rows(w)
            return _scaled_mm(xq, wq.t(), sx, sw, emulate, fast_accum=True)
        return x @ w.t()

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        plan, emulate, cache = ctx.plan, ctx.emulate, ctx.cache
        grad = grad.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            if plan.dgrad:
                gq, sg = quantize_rows(grad)
                wtq, swt = cache.cols(w)
                grad_x = _scaled_mm(gq, wtq.t(), sg, swt, emulate, fast_accum=False)
            else:
                grad_x = grad @ w
        if ctx.needs_input_grad[1]:
            if plan.wgrad:
                gt, sgt = quantize_cols(grad)  # [N, M']
                xt, sxt = quantize_cols(x)  # [K, M']
                grad_w = _scaled_mm(gt, xt.t(), sgt, sxt, emulate, fast_accum=False)
            else:
                grad_w = grad.t() @ x
        return grad_x, grad_w, None, None, None


class Fp8Linear(nn.Linear):
    """An ``nn.Linear`` (no bias) whose GEMMs run in FP8 rowwise where ``rule`` says; made by
    :func:`to_fp8` from an existing module (same parameter, same state-dict keys)."""

    rule: Fp8Rule = Fp8Rule(DENSE_MIN_DIM)
    emulate = False
    _fp8_cache: WeightCache | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        w = self.weight.to(torch.bfloat16)
        out_dim, in_dim = w.shape
        tokens = x2.shape[0]
        rule = self.rule
        plan = Fp8Gemms(fwd=rule.use(tokens, out_dim, in_dim), dgrad=rule.use(tokens, in_dim, out_dim), wgrad=rule.use(tokens, out_dim, in_dim))
        if not plan.any:
            return nn.functional.linear(x2, w).view(*x.shape[:-1], out_dim)
        if self._fp8_cache is None:
            self._fp8_cache = WeightCache()
        cache = self._fp8_cache if w is self.weight else WeightCache()  # a cast copy is new each call
        return _Fp8LinearFn.apply(x2.contiguous(), w, plan, self.emulate, cache).view(*x.shape[:-1], out_dim)


def to_fp8(module: nn.Linear, rule: Fp8Rule, emulate: bool) -> Fp8Linear:
    """Turn ``module`` into an :class:`Fp8Linear` in place (its class; parameters untouched)."""
    if module.bias is not None:
        raise ValueError("to_fp8: linears with a bias are not supported (the model has none)")
    module.__class__ = Fp8Linear
    module.rule, module.emulate, module._fp8_cache = rule, emulate, WeightCache()
    return module


def dense_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The projections FP8 may take: every nn.Linear but the LM head (the router has no
    nn.Linear; its logits stay fp32)."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear) and not name.endswith("lm_head")]
