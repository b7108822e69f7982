"""Sync-free, dropless expert-parallel dispatch into worst-case-sized symmetric buffers.

Every rank's receive buffer has ``capacity`` rows, by default ``ep * T * k`` (every slot of
every source to one rank), so no routing can overflow it and nothing is ever dropped. The
rows land in expert-major order, sources in rank order within an expert:

    [expert 0: src 0 | src 1 | ...][expert 1: src 0 | src 1 | ...] ...

which is exactly what the grouped GEMM reads, with per-expert row counts that stay on the
device. Offsets come from a scan over the counts of all sources (one fixed-size all-gather of
[E] counts; no host copy): source s writes its j-th slot of global expert g = (r, e) to row

    start_r[e] + sum_{s' < s} c[s', g] + j     on rank r.

Combine sends every expert output row straight back to its slot on the source (the reverse
map is recomputed on the receiver from the same counts), and the backward passes travel the
same two maps in reverse. The transport (NVSHMEM peer stores on GPUs, an emulation of the same
layout on gloo) is a separate seam: ``moe.parallel.transport``.

An optional capacity bound (``parallel.ep_capacity_factor``: rows per rank = factor * T * k)
trades memory for a limit. Overflow is detected on the device; overflowing rows are not
written anywhere, the layer's output turns NaN (so the trainer's non-finite check skips the
step on the device) and the overflow count is telemetry that names the layer: never a silent
drop.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

from moe.kernels.routing import gather_reduce
from moe.layers.dispatch import LocalDispatcher, LocalDispatchState, sort_by_expert
from moe.layers.router import Routing
from moe.parallel.transport import Transport


@dataclasses.dataclass
class Route:
    """Where each row goes: rank (-1: nowhere) and row of that rank's buffer."""

    rank: torch.Tensor  # [n] int64
    row: torch.Tensor  # [n] int64


@dataclasses.dataclass
class SymmetricState:
    local: LocalDispatchState
    to_experts: Route  # [T*k] source slots (expert-sorted) -> receive rows of the owners
    to_sources: Route  # [capacity] receive rows -> source slots (rank -1 for empty rows)
    overflow: torch.Tensor  # bool scalar: some rank received more rows than its capacity
    received: torch.Tensor  # int64 scalar: rows this rank received (the valid prefix of its buffer)


# torch >= 2.12 renames all_gather_into_tensor; the GPU machine runs 2.11
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _exclusive_cumsum(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x.cumsum(dim) - x


def plan_routes(counts_all: torch.Tensor, me: int, n_slots: int, capacity: int) -> tuple[Route, Route, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole offset arithmetic, on the device, from the all-gathered counts.

    counts_all: [ep, E] slots each source sends to each global expert (n_slots = T*k per
    source). Returns the route of my expert-sorted slots, the route back of each of my
    ``capacity`` receive rows, my rows per local expert (clipped to the capacity), my received
    row count, and the overflow flag (some rank receives more than ``capacity`` rows)."""
    ep, num_experts = counts_all.shape
    el = num_experts // ep
    dev = counts_all.device
    c = counts_all.view(ep, ep, el)  # [source, destination, local expert]
    per_expert = c.sum(0)  # [destination, local expert]
    expert_start = _exclusive_cumsum(per_expert, 1)  # expert blocks within each receiver
    source_start = _exclusive_cumsum(c, 0)  # source sub-blocks within each expert block
    local_start = _exclusive_cumsum(counts_all, 1)  # [source, E] first sorted slot of each expert
    received = per_expert.sum(1)  # [destination]
    overflow = (received > capacity).any()

    # Forward: my sorted slot i of global expert g -> rank g // el, row base[g] + i.
    base = (expert_start + source_start[me]).reshape(num_experts) - local_start[me]
    slot = torch.arange(n_slots, device=dev)
    expert_of_slot = torch.repeat_interleave(torch.arange(num_experts, device=dev), counts_all[me], output_size=n_slots)
    row = base[expert_of_slot] + slot
    fits = row < capacity  # only false when a capacity bound overflows; such rows go nowhere
    to_experts = Route(torch.where(fits, expert_of_slot // el, -1), torch.where(fits, row, 0))

    # Back: my receive row j lies in block b = (local expert e, source s), expert-major.
    blocks = c[:, me, :].t().reshape(-1)  # [el * ep]
    block_end = blocks.cumsum(0)
    j = torch.arange(capacity, device=dev)
    b = torch.bucketize(j, block_end, right=True).clamp_(max=blocks.numel() - 1)
    e, s = b // ep, b % ep
    src_slot = local_start[s, me * el + e] + j - (block_end[b] - blocks[b])
    valid = j < received[me]
    to_sources = Route(torch.where(valid, s, -1), torch.where(valid, src_slot, 0))

    rows_per_expert = torch.diff(per_expert[me].cumsum(0).clamp(max=capacity), prepend=per_expert.new_zeros(1))
    return to_experts, to_sources, rows_per_expert, received[me], overflow


class _Exchange(torch.autograd.Function):
    """Push rows along ``fwd``; the gradient travels ``bwd`` (the inverse map) back.

    With ``gather`` = (token index, inverse, k) the rows are read from the token matrix in
    the same kernel (the permutation fused into the send) and the backward sums each token's
    k gradient rows."""

    @staticmethod
    def forward(ctx, x, fwd: Route, bwd: Route, n_out: int, transport: Transport, gather, valid: tuple):
        ctx.bwd, ctx.n_in, ctx.transport, ctx.gather, ctx.valid = bwd, fwd.rank.numel(), transport, gather, valid
        index = gather[0] if gather is not None else None
        return transport.push(x, index, fwd.rank, fwd.row, n_out, valid[0])

    @staticmethod
    def backward(ctx, grad):
        back = ctx.transport.push(grad.contiguous(), None, ctx.bwd.rank, ctx.bwd.row, ctx.n_in, ctx.valid[1])
        if ctx.gather is not None:
            _, inverse, k = ctx.gather
            back = gather_reduce(back, inverse, None, k)
        return back, None, None, None, None, None, None


class SymmetricDispatcher:
    """Dropless EP dispatcher with no host sync (see the module docstring)."""

    def __init__(self, group, ep_size: int, num_experts: int, transport: Transport, capacity_factor: float | None = None, name: str = "") -> None:
        self.group, self.ep, self.num_experts = group, ep_size, num_experts
        self.local_experts = num_experts // ep_size
        self.rank = dist.get_rank(group) if group is not None else 0
        self.transport, self.capacity_factor, self.name = transport, capacity_factor, name
        self.local = LocalDispatcher()
        # telemetry, on the device: peak fraction of the receive buffer used, overflowing calls
        self.peak_buffer_use: torch.Tensor | None = None
        self.overflows: torch.Tensor | None = None
        self._checked_slots: set[int] = set()

    def _check_same_slots(self, n_slots: int) -> None:
        """Symmetric buffers need the same token count on every EP rank. Checked on the host
        once per new shape (like the buffer allocation itself), never in the steady state."""
        sizes: list = [None] * self.ep
        dist.all_gather_object(sizes, n_slots, group=self.group)
        if len(set(sizes)) != 1:
            raise ValueError(
                f"{self.name or 'moe layer'}: parallel.ep_backend=nvshmem needs the same tokens x top_k on every expert-parallel rank, got {sizes}"
            )
        self._checked_slots.add(n_slots)

    def capacity(self, n_slots: int) -> int:
        worst = self.ep * n_slots
        if self.capacity_factor is None:
            return worst
        return min(worst, max(1, math.ceil(self.capacity_factor * n_slots)))

    def dispatch(self, x: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor, SymmetricState]:
        n_tokens, top_k = routing.experts.shape
        n_slots = n_tokens * top_k
        if n_slots not in self._checked_slots:
            self._check_same_slots(n_slots)
        order, inverse = sort_by_expert(routing.experts.reshape(-1))
        counts = routing.tokens_per_expert
        counts_all = counts.new_empty(self.ep * self.num_experts)
        _all_gather(counts_all, counts.contiguous(), group=self.group)  # fixed size: no host sync
        counts_all = counts_all.view(self.ep, self.num_experts)
        capacity = self.capacity(n_slots)
        to_experts, to_sources, rows_per_expert, received, overflow = plan_routes(counts_all, self.rank, n_slots, capacity)
        self._record(received, capacity, overflow)
        # only the first `received` rows of a receive buffer hold data (no copy of the rest)
        received = received.clamp(max=capacity)
        rows = _Exchange.apply(x, to_experts, to_sources, capacity, self.transport, (order // top_k, inverse, top_k), (received, None))
        state = SymmetricState(LocalDispatchState(order, inverse, routing.weights), to_experts, to_sources, overflow, received)
        return rows, rows_per_expert, state

    def combine(self, y: torch.Tensor, state: SymmetricState) -> torch.Tensor:
        back = _Exchange.apply(y, state.to_sources, state.to_experts, state.to_experts.rank.numel(), self.transport, None, (None, state.received))
        out = self.local.combine(back, state.local)
        # a capacity overflow poisons the output: the step is skipped on the device, never silently short
        return out.masked_fill(state.overflow, float("nan"))

    def _record(self, received: torch.Tensor, capacity: int, overflow: torch.Tensor) -> None:
        with torch.no_grad():
            use = received.float() / capacity
            over = overflow.to(torch.int64)
            if self.peak_buffer_use is None:
                self.peak_buffer_use, self.overflows = use, over
            else:
                self.peak_buffer_use = torch.maximum(self.peak_buffer_use, use)
                self.overflows = self.overflows + over

    def telemetry(self) -> dict[str, torch.Tensor]:
        """Device tensors since the last call (then reset): peak buffer use, overflowing calls."""
        out = {} if self.peak_buffer_use is None else {"ep_buffer_use": self.peak_buffer_use, "ep_overflows": self.overflows}
        self.peak_buffer_use = self.overflows = None
        return out
