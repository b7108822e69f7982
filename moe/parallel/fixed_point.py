"""Sums whose bits do not depend on their order: int64 fixed point (``train.layout_invariant``).

A float sum depends on the order of its terms, so gradients accumulated over micro-batches and
reduced over ranks change in their last bits when the data-parallel size changes which rank
holds which micro-batch. Integers add exactly in any order: each micro-batch's fp32 gradient is
rounded once to a multiple of 2^-e (e per tensor, the same on every rank), the multiples are
summed as int64 (locally and by the integer all-reduce/reduce-scatter) and turned back into
fp32 once. The rounding is finer than fp32's own for every value within 2^20 of its tensor's
largest (up to 1,024 micro-batches a step), and the sum is rounded once where fp32 accumulation
rounds at every term.

The exponent follows the previous step's largest micro-batch gradient of the tensor (an exact
max over all ranks) with 2^HEADROOM_BITS of room to grow; the first step takes it from global
micro-batch 0, which every layout has. A micro-batch beyond the range is flagged on the device
(the step counts as non-finite), never wrapped around.

The gradient norm is summed the same way, with an exponent per segment of a row (a slice along
dim 0, what FSDP never splits), so it is a function of the values alone, however they are sharded.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from moe.kernels import fixed_point as kernels

# Bits the sum of all micro-batches' integers may use (one below int64's 63 for the sign's room).
SUM_BITS = 62
# Factor (as bits) the largest micro-batch gradient of a tensor may grow by from one step to the next.
HEADROOM_BITS = 8
# fp32 powers of two used as scales: normal numbers, so scaling by them is exact.
MAX_EXPONENT = 120
NORM_CHUNK = 1 << 25  # elements the exact norm squares at a time (256 MiB of float64 scratch; 2^20 made
# 3,400 chunks of ~10 launches each at OLMoE width, 8 layers: the GPU idled for the launches)
SEGMENT = 4096  # elements at most whose squares the norm sums under one exponent


def ceil_log2(n: int) -> int:
    return max(0, math.ceil(math.log2(n))) if n > 0 else 0


def power_of_two(e: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """2^e, built from its exponent bits: exact on every device (pow and exp2 need not be)."""
    if dtype == torch.float32:
        return ((e.to(torch.int32) + 127) << 23).view(torch.float32)
    return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)


def exponents_for(max_abs: torch.Tensor, limit_bits: int) -> torch.Tensor:
    """The exponent e (int32) that keeps |g| * 2^e below 2^limit_bits for |g| up to
    2^HEADROOM_BITS times ``max_abs`` (a zero max: as if it were just below 1)."""
    _, k = torch.frexp(max_abs.float())  # max_abs < 2^k
    k = torch.where(max_abs > 0, k, torch.zeros_like(k))
    return (limit_bits - HEADROOM_BITS - k).clamp(-MAX_EXPONENT, MAX_EXPONENT).to(torch.int32)


def quantize(g: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """round(g * scale) as int64 (``scale`` a power of two: the product is exact)."""
    return torch.round(g.float() * scale).to(torch.int64)


def add_quantized_(total: torch.Tensor | None, g: torch.Tensor, scale: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """``total`` + round(g * scale) as int64 (``total`` None: a new sum), overwriting the fp32
    ``g`` (a gradient about to be dropped) and converting through ``scratch`` (a flat int64
    buffer of at least g's size) when given: no temporaries the size of g."""
    g.mul_(scale).round_()
    if total is None:
        return g.to(torch.int64)
    if scratch is None:
        return total.add_(g.to(torch.int64))
    return total.add_(scratch[: g.numel()].view(g.shape).copy_(g))


def dequantize(q: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """int64 multiples of 2^-e back to fp32: one correctly rounded conversion (IEEE's, the same
    at any element position), then an exact scaling."""
    if kernels.use_triton(q):
        return kernels.dequantize(q, inverse)
    return q.to(torch.float32).mul_(inverse)


def segment_length(row: int) -> int:
    """Elements of a row whose squares are summed together: the largest divisor of the row's
    length up to SEGMENT (a function of the shape alone, so every layout cuts the same way)."""
    return next((d for d in range(min(row, SEGMENT), 0, -1) if row % d == 0), 1)


def square_sums(x: torch.Tensor) -> torch.Tensor:
    """[rows, ...] -> float64 sums of squares, one per segment (segment_length) of each row: a
    function of that segment's values only, never of how many rows sit beside it or of the order a
    kernel visits them (an exponent per segment; squares exact in float64 and rounded to integers
    below 2^52 / segment, whose float64 sum is exact in any order)."""
    seg = segment_length(math.prod(x.shape[1:]))
    half = (52 - ceil_log2(seg)) // 2  # y = x * 2^(half - k): y^2 < 2^(2 half) <= 2^52 / seg
    if kernels.use_triton(x):
        return kernels.square_sums(x, seg, half)
    segments = x.detach().reshape(-1, seg)
    per = max(1, NORM_CHUNK // seg)
    parts = [_square_sums(segments[i : i + per], half) for i in range(0, segments.shape[0], per)]
    return torch.cat(parts) if parts else x.new_zeros(0, dtype=torch.float64)


def _square_sums(segments: torch.Tensor, half: int) -> torch.Tensor:
    top = torch.maximum(segments.amax(dim=1), segments.amin(dim=1).neg_())  # (aminmax along a dim: slower on CPU)
    _, k = torch.frexp(top.float())  # each segment's values are < 2^k
    y = segments.to(torch.float64).mul_(power_of_two(half - k, torch.float64).unsqueeze(1))
    return y.square_().round_().sum(dim=1).mul_(power_of_two(2 * (k - half), torch.float64))


def square_sum_count(shape: torch.Size) -> int:
    """How many values square_sums gives for a tensor of ``shape`` (the same on every layout)."""
    return math.prod(shape) // segment_length(math.prod(shape[1:]))


def exact_total(values: torch.Tensor, count: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The sum over all ranks of non-negative float64 ``values`` (``count`` of them over the
    world), order-independent: an exponent from their exact maximum, int64 multiples, one
    integer all-reduce. Relative error below about count^2 * 2^-61."""
    top = values.max() if values.numel() else values.new_zeros(())
    if _distributed(group):
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    _, k = torch.frexp(top)
    t = SUM_BITS - ceil_log2(count)
    q = torch.round(values * power_of_two(t - k, torch.float64)).to(torch.int64).sum()
    if _distributed(group):
        dist.all_reduce(q, group=group)
    return q.to(torch.float64) * power_of_two(k - t, torch.float64)


def exact_norm(grads: list[torch.Tensor], count: int, device: torch.device, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """sqrt of the world-wide sum of squares of ``grads`` (each rank its own tensors, or shards
    of whole rows; ``count``: square_sum_count of every gradient of the model), as fp32."""
    parts = [square_sums(g) for g in grads]
    values = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64, device=device)
    return exact_total(values, count, group).sqrt().float()


def _distributed(group: dist.ProcessGroup | None) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


class FixedPointScales:
    """The exponent of every gradient tensor and this step's largest micro-batch gradient.

    ``observe`` folds a micro-batch's max |g| in; ``end_step`` takes the exact max over the
    data-parallel group, flags a micro-batch beyond the range and sets the next step's
    exponents. Until calibrated (the first step of a run, or a checkpoint without exponents),
    the exponents come from global micro-batch 0's gradient (``calibrate``)."""

    def __init__(self, names: list[str], micro_batches: int, device: torch.device) -> None:
        self.names = names
        # every micro-batch's integers stay below 2^limit_bits, so the sum of all of them fits
        self.limit_bits = SUM_BITS - ceil_log2(micro_batches)
        self.exponents = torch.zeros(len(names), dtype=torch.int32, device=device)
        self.max_abs = torch.zeros(len(names), dtype=torch.float32, device=device)
        self.calibrated = False
        self.overflow = torch.zeros((), dtype=torch.bool, device=device)
        self._refresh()

    def _refresh(self) -> None:
        self.scales = power_of_two(self.exponents)
        self.inverses = power_of_two(-self.exponents)

    def observe(self, i: int, g: torch.Tensor) -> None:
        """Fold |g|'s max into tensor i's (NaN stays NaN: the step is then non-finite)."""
        lo, hi = torch.aminmax(g.detach().float())
        torch.maximum(self.max_abs[i], torch.maximum(-lo, hi), out=self.max_abs[i])

    def observe_and_add(self, i: int, total: torch.Tensor | None, g: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
        """observe(i, g), then add_quantized_ with tensor i's scale (one kernel on CUDA; the torch
        path overwrites ``g``, an fp32 gradient about to be dropped, and converts through ``scratch``)."""
        if kernels.use_triton(g):
            return kernels.observe_quantize_add(total, g, self.scales, self.max_abs, i)
        self.observe(i, g)
        return add_quantized_(total, g if g.dtype == torch.float32 else g.float(), self.scales[i], scratch)

    def calibrate(self, indices: list[int] | None, group: dist.ProcessGroup | None, src: int) -> None:
        """Exponents of ``indices`` (all: None) from the maxima observed on rank ``src`` of
        ``group``, whose first micro-batch is global micro-batch 0 (a broadcast; none alone)."""
        picked = slice(None) if indices is None else torch.tensor(indices, device=self.max_abs.device)
        first = self.max_abs[picked].clone()
        if _distributed(group):
            dist.broadcast(first, src=src, group=group)
        self.exponents[picked] = exponents_for(first, self.limit_bits)
        self._refresh()

    @torch.no_grad()
    def end_step(self, group: dist.ProcessGroup | None) -> torch.Tensor:
        """After the step's reduction: the exact max over ``group``; whether a micro-batch
        overflowed (device bool); the next step's exponents. Resets the maxima."""
        if _distributed(group):
            dist.all_reduce(self.max_abs, op=dist.ReduceOp.MAX, group=group)
        finite = torch.isfinite(self.max_abs)
        self.overflow = ((self.max_abs * self.scales >= 2.0**self.limit_bits) | ~finite).any()
        # a tensor without gradient (or a non-finite one) keeps its exponent
        seen = finite & (self.max_abs > 0)
        self.exponents.copy_(torch.where(seen, exponents_for(self.max_abs, self.limit_bits), self.exponents))
        self._refresh()
        self.max_abs.zero_()
        self.calibrated = True
        return self.overflow

    def state_dict(self) -> dict[str, int]:
        """Name -> exponent (host ints: a checkpoint's meta.json; read at a checkpoint only)."""
        return dict(zip(self.names, self.exponents.tolist(), strict=True)) if self.calibrated else {}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Exponents by name ({}: calibrate again at the next step). ValueError names a bad entry."""
        if not state:
            self.calibrated = False
            return
        if set(state) != set(self.names):
            missing = sorted(set(self.names) ^ set(state))
            raise ValueError(f"its gradient exponents do not match this model's parameters (first: {missing[0]})")
        for name, e in state.items():
            if type(e) is not int or abs(e) > MAX_EXPONENT:
                raise ValueError(f"gradient exponent of {name} is {e!r}, not an integer in [-{MAX_EXPONENT}, {MAX_EXPONENT}]")
        self.exponents.copy_(torch.tensor([state[n] for n in self.names], dtype=torch.int32))
        self._refresh()
        self.calibrated = True
