"""Gradient reduction of ``train.layout_invariant``: the same bits at any data-parallel size.

Every micro-batch's gradient is rounded once to int64 multiples of 2^-e as the backward
produces it (moe.parallel.fixed_point), the integers are summed over micro-batches and over
ranks (integer all-reduce, reduce to the ZeRO-1 owner, or FSDP's reduce-scatter: all exact in
any order), and each gradient is turned back into fp32 once. The loss is each micro-batch's
loss divided by the step's number of micro-batches on every layout (never by a rank's share and
then by the data-parallel size), so each micro-batch's gradient is itself layout-independent.
The loss and the gradient norm are summed in a fixed order too. Memory: an int64 sum per
gradient in place of the fp32 one while the step accumulates (4 bytes per parameter more than
the default, and one int64 conversion buffer the size of the largest gradient); FSDP keeps it
for its shard beside its own fp32 shard gradient (8 bytes more).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _unflatten_dense_tensors

from moe.kernels import fixed_point as kernels
from moe.kernels.fixed_point import use_triton
from moe.optim import MasterParam, MasterWeightAdamW
from moe.parallel.fixed_point import FixedPointScales, dequantize, exact_norm, quantize, square_sum_count
from moe.parallel.grad_sync import GradSync, _flat
from moe.parallel.mesh import Mesh

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def micro_batches_per_step(global_batch_size: int, micro_batch_size: int) -> int:
    """The step's micro-batches over all data-parallel ranks: what every loss is divided by."""
    return global_batch_size // micro_batch_size


class FixedPointGradSync(GradSync):
    """GradSync (DDP, ZeRO-1, and any layout on one process) with integer sums.

    ``attach`` registers a post-accumulate hook on every parameter after the optimizer's own,
    so it sees the fp32 gradient of one micro-batch (expert weights too, whichever GEMM wrote
    it); the hook adds it to the parameter's int64 sum and drops it. At a run's first step the
    first micro-batch's gradients wait in fp32 until global micro-batch 0's maxima (the first
    data-parallel rank's) set the exponents (``after_micro``). ``reduce`` sums the integer
    buckets (SUM; ZeRO-1: to the owner) and writes fp32 gradients where the rank needs them."""

    def __init__(self, model: nn.Module, mesh: Mesh, zero: bool, bucket_bytes: int, micro_batches: int) -> None:
        if mesh.pp != 1 or mesh.ep != 1:
            raise ValueError("fixed-point gradient sums run with pp=1 and ep=1 (train.layout_invariant)")
        super().__init__(model, mesh, zero, torch.float32, bucket_bytes)
        self.micro_batches = micro_batches
        self.scales: FixedPointScales | None = None
        self.params: list[MasterParam] = []
        self.sums: dict[int, torch.Tensor] = {}
        self.scratch: torch.Tensor | None = None  # while a step accumulates
        self.index: dict[str, int] = {}
        self.overflow: torch.Tensor | None = None
        self.side: torch.cuda.Stream | None = None  # CUDA: where the fixed-point adds run (_add_beside)
        self.pending = False  # adds launched there since the compute stream last waited

    def attach(self, opt: MasterWeightAdamW) -> None:
        self.params = opt.params
        self.index = {p.name: i for i, p in enumerate(opt.params)}
        self.scales = FixedPointScales([p.name for p in opt.params], self.micro_batches, opt.params[0].param.device)
        for i, p in enumerate(opt.params):
            p.param.register_post_accumulate_grad_hook(self._hook(i, p))

    def _hook(self, i: int, p: MasterParam):
        def hook(_: torch.Tensor) -> None:
            if p.grad is None:
                return
            if self.scales.calibrated:
                self._add(i, p)
            else:
                self.scales.observe(i, p.grad)

        return hook

    @torch.no_grad()
    def _add(self, i: int, p: MasterParam) -> None:
        g = p.grad
        if g.is_cuda and use_triton(g):
            self._add_beside(i, g)
        else:
            if i in self.sums and self.scratch is None:  # the torch path's conversion buffer
                self.scratch = torch.empty(max(q.param.numel() for q in self.params), dtype=torch.int64, device=g.device)
            self.sums[i] = self.scales.observe_and_add(i, self.sums.get(i), g, self.scratch)
        p.grad_holder.grad = None

    def _add_beside(self, i: int, g: torch.Tensor) -> None:
        """The fixed-point add on a side stream, beside the rest of the backward: it only moves
        memory while the GEMMs compute, and integer adds and maxima give the same bits in any
        order. The sum is allocated on the compute stream (its home), the gradient is kept from
        reuse until the side stream has read it, and ``reduce`` waits for the side stream."""
        if self.side is None:
            self.side = torch.cuda.Stream(device=g.device)
        total = self.sums.get(i)
        fresh = total is None
        if fresh:
            total = torch.empty(g.shape, dtype=torch.int64, device=g.device)
        self.side.wait_stream(torch.cuda.current_stream(g.device))
        with torch.cuda.stream(self.side):
            kernels.observe_quantize_add(total, g, self.scales.scales, self.scales.max_abs, i, accumulate=not fresh)
        g.record_stream(self.side)
        self.sums[i] = total
        self.pending = True

    @torch.no_grad()
    def after_micro(self) -> None:
        """After each micro-batch's backward: at a run's first step, calibrate and fold in."""
        if self.scales.calibrated:
            return
        self.scales.calibrate(None, self.mesh.dp_group, self.mesh.dp_ranks[0])
        self.scales.calibrated = True
        for i, p in enumerate(self.params):
            if p.grad is not None:
                self._add(i, p)

    def _take(self, p: MasterParam) -> torch.Tensor:
        q = self.sums.pop(self.index[p.name], None)
        return q if q is not None else torch.zeros(p.param.shape, dtype=torch.int64, device=p.param.device)

    def _set_grad(self, p: MasterParam, q: torch.Tensor) -> None:
        p.grad_holder.grad = dequantize(q, self.scales.inverses[self.index[p.name]]).view(p.param.shape)

    def _launch_bucket_now(self, b, async_op: bool) -> None:
        b.grads = [self._take(p) for p in b.params]
        b.flat = _flat(b.grads)
        if self.zero:
            b.work = dist.reduce(b.flat, dst=b.spec.ranks[b.owner], op=dist.ReduceOp.SUM, group=b.spec.group, async_op=async_op)
        else:
            b.work = dist.all_reduce(b.flat, op=dist.ReduceOp.SUM, group=b.spec.group, async_op=async_op)

    def _finish_bucket(self, b) -> None:
        if b.work is not None:
            b.work.wait()
        if not self.zero or b.owner == b.spec.my_index:
            for p, q in zip(b.params, _unflatten_dense_tensors(b.flat, b.grads), strict=True):
                self._set_grad(p, q)
        else:  # another rank owns these: its sum is all that counts
            for p in b.params:
                p.grad_holder.grad = None
        b.work, b.flat, b.grads = None, None, []

    def _finish_local(self) -> None:
        for p in self.local:
            self._set_grad(p, self._take(p))

    def wait_for_adds(self) -> None:
        """The compute stream waits for the side stream's adds (their sums and maxima are read next)."""
        if self.pending:
            torch.cuda.current_stream(self.side.device).wait_stream(self.side)
            self.pending = False

    @torch.no_grad()
    def reduce(self, opt: MasterWeightAdamW) -> None:
        self.wait_for_adds()
        self.scratch = None
        super().reduce(opt)
        self.overflow = self.scales.end_step(self.mesh.dp_group)


class FixedPointReduceScatter:
    """FSDP2's reduce-scatter of one module's gradients (``set_custom_reduce_scatter``), in
    integers: each micro-batch's unsharded gradient (FSDP's flat input, one segment per parameter
    in every rank's row) is quantized with its parameters' exponents, reduce-scattered as int64
    (SUM) and added to this rank's int64 shard sum. FSDP's fp32 output gets zeros (it adds them
    to the sharded gradient); ``finish`` writes the sums there once."""

    def __init__(self, scales: FixedPointScales, params: list[tuple[int, nn.Parameter, int]], world: int, device: torch.device) -> None:
        self.scales, self.world = scales, world
        self.indices = [i for i, _, _ in params]
        self.params = [p for _, p, _ in params]
        self.sizes = [n for _, _, n in params]
        self.total = sum(self.sizes)
        self._index = torch.tensor(self.indices, device=device)
        self._sizes = torch.tensor(self.sizes, device=device)
        self.sum: torch.Tensor | None = None

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    @torch.no_grad()
    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op, async_op: bool = False) -> None:
        if input_tensor.numel() != self.world * self.total:
            raise RuntimeError(f"FSDP reduced {input_tensor.numel()} gradient values where train.layout_invariant expects {self.world * self.total}")
        rows = input_tensor.view(self.world, self.total)
        for i, segment in zip(self.indices, rows.split(self.sizes, dim=1), strict=True):
            self.scales.observe(i, segment)
        if not self.scales.calibrated:  # this rank's first micro-batch: rank 0's is global micro-batch 0
            self.scales.calibrate(self.indices, group, dist.get_global_rank(group, 0))
        scale = torch.repeat_interleave(self.scales.scales[self._index], self._sizes, output_size=self.total)  # (no host sync)
        q = quantize(rows, scale)
        out = torch.empty(self.total, dtype=torch.int64, device=q.device)
        _reduce_scatter(out, q.view(-1), op=dist.ReduceOp.SUM, group=group)
        self.sum = out if self.sum is None else self.sum.add_(out)
        output_tensor.zero_()
        return None

    @torch.no_grad()
    def finish(self) -> None:
        """This rank's shards of the summed gradients into the parameters' (DTensor) gradients."""
        for i, p, segment in zip(self.indices, self.params, self.sum.split(self.sizes), strict=True):
            local = p.grad.to_local()
            local.copy_(dequantize(segment[: local.numel()], self.scales.inverses[i]).view(local.shape))
        if self.sum.is_cuda:  # made on FSDP's reduce-scatter stream, last read on this one
            self.sum.record_stream(torch.cuda.current_stream(self.sum.device))
        self.sum = None


class FsdpFixedPoint:
    """Integer gradient sums for an FSDP2-sharded model: one FixedPointReduceScatter per
    ``fully_shard``-ed module, sharing the exponents."""

    def __init__(self, modules: list[nn.Module], opt: MasterWeightAdamW, micro_batches: int, world: int) -> None:
        device = opt.params[0].param.device
        self.scales = FixedPointScales([p.name for p in opt.params], micro_batches, device)
        index = {id(p.param): i for i, p in enumerate(opt.params)}
        self.comms: list[FixedPointReduceScatter] = []
        for module in modules:
            for group in _param_groups(module):
                params = [(index[id(fp.sharded_param)], fp.sharded_param, fp.padded_sharded_param_size.numel()) for fp in group.fsdp_params]
                comm = FixedPointReduceScatter(self.scales, params, world, device)
                group._reduce_scatter_comm = comm  # what FSDPModule.set_custom_reduce_scatter sets
                group.reduce_scatter_unused_params = True  # every parameter in every reduction: fixed segments
                self.comms.append(comm)
        self.overflow: torch.Tensor | None = None

    def after_micro(self) -> None:
        self.scales.calibrated = True  # every module's comm calibrated its own parameters

    def finish(self) -> None:
        for comm in self.comms:
            comm.finish()
        self.overflow = self.scales.end_step(None)


def _param_groups(module: nn.Module) -> list:
    """A fully_shard-ed module's FSDP parameter groups (torch 2.13 keeps a list; 2.11 one or None)."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    for group in groups:
        if not hasattr(group, "_reduce_scatter_comm"):
            raise RuntimeError(f"train.layout_invariant with FSDP needs FSDP's custom reduce-scatter (torch {torch.__version__} has none)")
    return groups


def layout_invariant_norm(grads: list[torch.Tensor], count: int, overflow: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The global gradient norm from each rank's share (whole tensors or FSDP row shards),
    summed exactly in any order; inf when a micro-batch overflowed the fixed-point range (the
    step is then skipped, or stops the run, as a non-finite one)."""
    norm = exact_norm(grads, count, device)
    return torch.where(overflow, torch.full_like(norm, float("inf")), norm)


def norm_terms(opt: MasterWeightAdamW) -> int:
    """The values the exact norm sums over the whole model (the same on every layout)."""
    return sum(square_sum_count(p.param.shape) for p in opt.params)


def fixed_order_mean(losses: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """[M] per-micro-batch losses, this rank's at their global places and zeros elsewhere -> the
    step's mean: the all-reduce adds only zeros to each value (exact), the sum runs in index order."""
    total = losses.clone()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    return total.sum() / total.numel()
