"""The fixed-point gradient sums of ``train.layout_invariant`` in one pass each (Triton on CUDA).

moe.parallel.fixed_point states the arithmetic in torch: per micro-batch and parameter, an
``aminmax`` for the tensor's largest |g|, then ``g * 2^e``, a round, an int64 conversion and an
int64 add (about 56 bytes of traffic per gradient value), and for the exact norm six float64
passes per value. At OLMoE width, 8 layers, that made the mode's step 1.38x the deterministic
one's (bench/NOTES.md). Here each is one kernel: ``observe_quantize_add`` reads the fp32 (or
bf16) gradient once, folds its largest |g| into the tensor's running maximum (an integer atomic
max on the float's bits: non-negative floats order as their bits do, and a max is exact in any
order) and writes ``total + rint(g * 2^e)`` (20 bytes per value, 12 for a micro-batch that
starts the sum); ``square_sums`` reads each value once; ``dequantize`` converts once.

Every result is bitwise the torch path's (tests/kernels/fixed_point_check.py): ``_rint`` is the
same round-half-to-even as ``torch.round``, products with powers of two are exact, the squares'
integer sums are exact in any order. A NaN gradient counts as an infinite maximum (torch's
keeps the NaN): either marks the step non-finite, which is all the maximum decides then.
"""

from __future__ import annotations

import torch

from moe.kernels.routing import HAVE_TRITON, use_triton

__all__ = ["observe_quantize_add", "square_sums", "dequantize", "use_triton"]

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _rint(y):
        """Round half to even (torch.round's), exactly: floor and the fraction are exact in any
        float (libdevice's rint is the same on CUDA but absent from Triton's interpreter)."""
        r = tl.floor(y)
        d = y - r
        up = (d > 0.5) | ((d == 0.5) & ((r.to(tl.int64) & 1) != 0))
        return tl.where(up, r + 1.0, r)

    @triton.jit
    def _observe_quantize_add(total, g, scales, max_bits, i, n, ACCUMULATE: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr):
        """ITERS blocks: total (+)= rint(g * scales[i]); their max |g| into max_bits[i] (int32 bits)
        with one atomic (many programs on one address contend)."""
        base = tl.program_id(0).to(tl.int64) * (BLOCK * ITERS)
        scale = tl.load(scales + i)
        top = tl.zeros((), tl.float32)
        for it in tl.static_range(ITERS):
            offs = base + it * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            x = tl.load(g + offs, mask=mask, other=0.0).to(tl.float32)
            a = tl.abs(x)
            a = tl.where(a == a, a, float("inf"))  # NaN: an infinite maximum (the step is non-finite)
            top = tl.maximum(top, tl.max(a, 0))
            q = _rint(x * scale).to(tl.int64)
            if ACCUMULATE:
                q += tl.load(total + offs, mask=mask, other=0)
            tl.store(total + offs, q, mask=mask)
        tl.atomic_max(max_bits + i, top.to(tl.int32, bitcast=True))

    @triton.jit
    def _square_sums(x, out, SEG: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr):
        """One segment of SEG values: the exact sum of round((x 2^(HALF-k))^2), times 2^(2(k-HALF)),
        k the exponent of the segment's largest |x| (torch.frexp's)."""
        seg = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        v = tl.load(x + seg * SEG + cols, mask=cols < SEG, other=0.0).to(tl.float32)
        top = tl.max(tl.abs(v), 0)
        # frexp's exponent: top < 2^k; a subnormal top scaled into the normal range first
        subnormal = top < 1.1754943508222875e-38
        scaled = tl.where(subnormal, top * 18446744073709551616.0, top)  # 2^64: exact
        biased = (scaled.to(tl.int32, bitcast=True) >> 23) & 0xFF
        k = tl.where(top == 0.0, 0, biased - 126 - tl.where(subnormal, 64, 0))
        up = ((HALF - k).to(tl.int64) + 1023) << 52
        y = v.to(tl.float64) * up.to(tl.float64, bitcast=True)
        s = tl.sum(_rint(y * y), 0)
        down = ((2 * (k - HALF)).to(tl.int64) + 1023) << 52
        tl.store(out + seg, s * down.to(tl.float64, bitcast=True))

    @triton.jit
    def _dequantize(q, inverse, out, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        v = tl.load(q + offs, mask=mask, other=0).to(tl.float32)
        tl.store(out + offs, v * tl.load(inverse), mask=mask)


_BLOCK = 4096
# observe_quantize_add's launch: elements per block, blocks per program, warps (bench/fixed_point.py)
# (8 warps: 3.97 TB/s against 3.81 with 4 on an H200, fixed_point-NVIDIA-H200-20261204T083020Z.json)
QUANTIZE_LAUNCH = {"BLOCK": 4096, "ITERS": 1, "num_warps": 8}


def observe_quantize_add(
    total: torch.Tensor | None, g: torch.Tensor, scales: torch.Tensor, max_abs: torch.Tensor, i: int, accumulate: bool | None = None
) -> torch.Tensor:
    """``total`` + rint(g * scales[i]) as int64 (a new sum when ``total`` is None, or written over
    an allocated ``total`` with ``accumulate=False``), and g's largest |g| folded into the fp32
    ``max_abs[i]`` (non-negative). ``g`` is left as it was."""
    flat = g.detach().reshape(-1)
    accumulate = total is not None if accumulate is None else accumulate
    if total is None:
        total = torch.empty(g.shape, dtype=torch.int64, device=g.device)
    n = flat.numel()
    if n:
        launch = QUANTIZE_LAUNCH
        grid = (triton.cdiv(n, launch["BLOCK"] * launch["ITERS"]),)
        _observe_quantize_add[grid](total, flat, scales, max_abs.view(torch.int32), i, n, ACCUMULATE=accumulate, **launch)
    return total


def square_sums(x: torch.Tensor, seg: int, half: int) -> torch.Tensor:
    """float64 [numel / seg]: the fixed_point.square_sums of ``x`` cut into segments of ``seg``."""
    flat = x.detach().reshape(-1)
    out = torch.empty(flat.numel() // seg, dtype=torch.float64, device=x.device)
    if out.numel():
        _square_sums[(out.numel(),)](flat, out, SEG=seg, HALF=half, BLOCK=max(16, triton.next_power_of_2(seg)))
    return out


def dequantize(q: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """int64 ``q`` * ``inverse`` (a 0-d fp32 power of two) as fp32, q's shape."""
    flat = q.reshape(-1)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    if flat.numel():
        _dequantize[(triton.cdiv(flat.numel(), _BLOCK),)](flat, inverse, out, flat.numel(), BLOCK=_BLOCK)
    return out
