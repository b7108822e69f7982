"""Gradient synchronisation for data parallelism with resident experts, and ZeRO-1.

Dense gradients are summed over the stage's data-parallel group, expert gradients only over
the expert-data-parallel group (the ranks holding the same experts); both are divided by the
data-parallel size, which makes the result the gradient of the global-batch mean loss.
On NCCL the division happens inside the collective (ReduceOp.AVG: no extra pass over the
gradients, which costs ~4.5 ms per step for 1.9B fp32 gradients on an H200); gloo, which has
no AVG, sums and divides. Reductions run on flat buckets of ~25 MB, in fp32 or (``reduce_dtype`` bf16, half the
traffic) in bf16 with the sum cast back into the fp32 gradients.

ZeRO-1: each parameter has one owning rank in its group (greedy by size). Gradients are
*reduced* to the owner, only the owner keeps the fp32 master and AdamW moments and steps,
and the owner then broadcasts the updated weights: the same traffic as reduce-scatter plus
all-gather, and the state is partitioned exactly, parameter by parameter.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from moe.layers.experts import expert_param_layout
from moe.optim import MasterParam, MasterWeightAdamW
from moe.parallel.mesh import Mesh
from moe.spans import span

BUCKET_BYTES = 25 * 2**20


@dataclasses.dataclass(frozen=True)
class ParamGroupSpec:
    kind: str  # "dense" or "expert"
    group: dist.ProcessGroup | None
    ranks: tuple[int, ...]  # world ranks of the group
    my_index: int


@dataclasses.dataclass
class _Bucket:
    """One reduction bucket of the plan and, while it is in flight, its collective."""

    params: list[MasterParam]
    spec: ParamGroupSpec
    owner: int  # group index of the owning rank under ZeRO-1, -1 without
    nbytes: int = 0
    pending: int = 0  # gradients still to become ready in this backward (overlapped)
    work: object | None = None
    flat: torch.Tensor | None = None
    grads: list[torch.Tensor] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Update:
    """One bucket of ZeRO-1 weight broadcasts: one owner, one group, <= 25 MB or one tensor.
    ``start`` sends (owner) or receives; ``land`` waits for it (on the device when it was
    asynchronous) and, on a receiver, unpacks it and marks the parameters as changed."""

    params: list[nn.Parameter]
    spec: ParamGroupSpec
    owner: int
    work: object | None = None
    flat: torch.Tensor | None = None

    def start(self, async_op: bool) -> None:
        sender = self.owner == self.spec.my_index
        self.flat = _receive_buffer([q.data for q in self.params], sender)
        self.work = dist.broadcast(self.flat, src=self.spec.ranks[self.owner], group=self.spec.group, async_op=async_op)

    def land(self) -> None:
        if self.flat is None:
            return
        if self.work is not None:
            self.work.wait()
        if self.owner != self.spec.my_index:
            _copy_back([q.data for q in self.params], self.flat)
            _mark_updated(self.params)
        self.work = self.flat = None


def owners(sizes: dict[str, int], n_ranks: int) -> dict[str, int]:
    """Greedy partition by size (largest first to the least loaded); deterministic."""
    load = [0] * n_ranks
    out = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        r = min(range(n_ranks), key=lambda i: (load[i], i))
        out[name] = r
        load[r] += sizes[name]
    return out


class GradSync:
    """Reduces every gradient after the backward, bucket by bucket of one plan (bucket_plan),
    the plan OverlappedGradSync reduces during the backward: one bucketing, one finish."""

    def __init__(self, model: nn.Module, mesh: Mesh, zero: bool, reduce_dtype: torch.dtype = torch.float32, bucket_bytes: int = BUCKET_BYTES) -> None:
        self.mesh, self.zero, self.reduce_dtype, self.bucket_bytes = mesh, zero, reduce_dtype, bucket_bytes
        self.buckets: list[_Bucket] = []
        self.local: list[MasterParam] = []  # parameters whose group is this rank alone
        self._planned = False
        self.expert_names = set(expert_param_layout(model))
        self.specs = {
            "dense": ParamGroupSpec("dense", mesh.dp_group, mesh.dp_ranks, mesh.dp_rank),
            "expert": ParamGroupSpec("expert", mesh.edp_group, mesh.edp_ranks, mesh.edp_rank),
        }
        self.owner: dict[str, int] = {}
        if zero:
            params = dict(model.named_parameters())
            for kind, spec in self.specs.items():
                sizes = {n: p.numel() for n, p in params.items() if self.kind_of(n) == kind}
                self.owner.update(owners(sizes, len(spec.ranks)))

    def _average_op(self, spec: ParamGroupSpec) -> tuple[dist.ReduceOp, bool]:
        """(op, divide by dp afterwards). AVG inside the collective where the backend has it and
        the group is the whole data-parallel group (expert groups under EP are smaller: their
        sum is still divided by dp)."""
        if len(spec.ranks) == self.mesh.dp and dist.get_backend(spec.group) == "nccl":
            return dist.ReduceOp.AVG, False
        return dist.ReduceOp.SUM, True

    def kind_of(self, name: str) -> str:
        return "expert" if name in self.expert_names else "dense"

    @property
    def broadcasts_expert_weights(self) -> bool:
        """ZeRO-1 over an expert group of more than one rank: each owner sends its bf16 expert
        weights to the others after the step (over one rank it shards nothing)."""
        return self.zero and len(self.specs["expert"].ranks) > 1

    def owns(self, name: str, param: nn.Parameter) -> bool:
        """For MasterWeightAdamW(owns=...)."""
        if not self.zero:
            return True
        return self.owner[name] == self.specs[self.kind_of(name)].my_index

    def bucket_plan(self, opt: MasterWeightAdamW) -> list[_Bucket]:
        """The reduction buckets, fixed once: in reverse parameter order (about the order the
        backward produces gradients), each of one kind (dense/expert), one ZeRO owner and one
        dtype, at most ``bucket_bytes`` or one tensor; parameters of one-rank groups stay local."""
        if self._planned:
            return self.buckets
        open_: dict[tuple, _Bucket] = {}
        for p in reversed(opt.params):
            spec = self.specs[self.kind_of(p.name)]
            if len(spec.ranks) == 1:
                self.local.append(p)
                continue
            owner = self.owner[p.name] if self.zero else -1
            key = (spec.kind, owner, p.grad_holder.dtype)
            nbytes = p.grad_holder.numel() * p.grad_holder.element_size()
            bucket = open_.get(key)
            if bucket is None or (bucket.params and bucket.nbytes + nbytes > self.bucket_bytes):
                bucket = open_[key] = _Bucket([], spec, owner)
                self.buckets.append(bucket)
            bucket.params.append(p)
            bucket.nbytes += nbytes
        self._planned = True
        return self.buckets

    def _launch_bucket(self, b: _Bucket, async_op: bool) -> None:
        """Flatten one bucket's fp32 gradients and start its all-reduce (or, ZeRO-1, its reduce
        to the owner); a parameter without a gradient contributes zeros."""
        with span("grad_sync"):  # also when a backward hook launches it (overlapped reduction)
            self._launch_bucket_now(b, async_op)

    def _launch_bucket_now(self, b: _Bucket, async_op: bool) -> None:
        for p in b.params:
            if p.grad is None:
                p.grad_holder.grad = torch.zeros(p.param.shape, dtype=torch.float32, device=p.param.device)
        b.grads = [p.grad for p in b.params]
        b.flat = _flat(b.grads, self.reduce_dtype)
        op, _ = self._average_op(b.spec)
        if self.zero:
            b.work = dist.reduce(b.flat, dst=b.spec.ranks[b.owner], op=op, group=b.spec.group, async_op=async_op)
        else:
            b.work = dist.all_reduce(b.flat, op=op, group=b.spec.group, async_op=async_op)

    def _finish_bucket(self, b: _Bucket) -> None:
        """Wait for a bucket, then (where this rank holds the result) divide and copy back."""
        if b.work is not None:
            b.work.wait()
        if not self.zero or b.owner == b.spec.my_index:
            if self._average_op(b.spec)[1]:
                b.flat.div_(float(self.mesh.dp))
            _copy_back(b.grads, b.flat)
        b.work, b.flat, b.grads = None, None, []

    def _finish_local(self) -> None:
        local = [p.grad for p in self.local if p.grad is not None]
        if local and self.mesh.dp != 1:
            torch._foreach_div_(local, float(self.mesh.dp))

    @torch.no_grad()
    def reduce(self, opt: MasterWeightAdamW) -> None:
        """After the backward: every bucket launched in plan order, then each finished."""
        buckets = self.bucket_plan(opt)
        for b in buckets:
            self._launch_bucket(b, async_op=True)
        for b in buckets:
            self._finish_bucket(b)
        self._finish_local()

    def counted(self, opt: MasterWeightAdamW) -> list[torch.Tensor]:
        """The gradients this rank contributes to the global norm: each parameter exactly once
        across the world (its owner under ZeRO, else the first rank of its group)."""
        out = []
        for p in opt.params:
            if p.grad is None:
                continue
            spec = self.specs[self.kind_of(p.name)]
            mine = self.owns(p.name, p.param) if self.zero else spec.my_index == 0
            if mine:
                out.append(p.grad)
        return out

    @torch.no_grad()
    def broadcast_updates(self, opt: MasterWeightAdamW) -> None:
        """ZeRO-1: every owner sends its freshly stepped weights to the rest of its group."""
        if not self.zero:
            return
        for u in self._updates(opt.params):
            u.start(async_op=False)
            u.land()

    def _updates(self, params: list[MasterParam]) -> list[_Update]:
        """ZeRO-1 broadcast buckets of ``params``: by kind, then owner, <= 25 MB or one tensor
        each (the same order on every rank); none for groups of one rank."""
        out = []
        for kind in ("dense", "expert"):
            spec = self.specs[kind]
            if len(spec.ranks) == 1:
                continue
            for owner_index in range(len(spec.ranks)):
                mine = [p.param for p in params if self.kind_of(p.name) == kind and self.owner[p.name] == owner_index]
                out += [_Update(bucket, spec, owner_index) for bucket in _buckets(mine, self.bucket_bytes)]
        return out


def global_grad_norm(local: list[torch.Tensor], device: torch.device, known: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
    """sqrt of the world-wide sum of squares (device-side; no host sync). ``known``: id(gradient)
    -> non-negative partial sums of its squares, already computed (MasterWeightAdamW.grad_squares):
    those gradients are not read again."""
    known = known or {}
    sq = torch.zeros((), device=device, dtype=torch.float32)
    rest = [t for t in local if id(t) not in known]
    if rest:  # one multi-tensor launch per dtype, not two small kernels per tensor
        sq = sq + torch.stack(torch._foreach_norm(rest, 2, dtype=torch.float32)).square().sum()
    partials = [known[id(t)] for t in local if id(t) in known]
    if partials:  # the sum of non-negative partial sums is their L1 norm: one multi-tensor launch too
        sq = sq + torch.stack(torch._foreach_norm(partials, 1, dtype=torch.float32)).sum()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(sq)
    return sq.sqrt()


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The factor that brings the global norm down to ``max_norm`` (1 when it is below); a
    device scalar for the optimizer's fused step (MasterWeightAdamW.step(grad_scale=...))."""
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


def _buckets(tensors: list[torch.Tensor], limit: int = BUCKET_BYTES) -> list[list[torch.Tensor]]:
    out: list[list[torch.Tensor]] = []
    current: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if current and (size + nbytes > limit or t.dtype != current[0].dtype):
            out.append(current)
            current, size = [], 0
        current.append(t)
        size += nbytes
    if current:
        out.append(current)
    return out


def _flat(bucket: list[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
    """One tensor for a collective: a lone contiguous tensor (an expert weight's gradient is
    itself a bucket: up to a GB) is used in place, not copied out and back; several are packed.
    With another ``dtype`` each tensor is cast straight into its slice of the packed buffer."""
    if dtype is None or dtype == bucket[0].dtype:
        if len(bucket) == 1 and bucket[0].is_contiguous():
            return bucket[0].view(-1)
        return _flatten_dense_tensors(bucket)
    flat = torch.empty(sum(t.numel() for t in bucket), dtype=dtype, device=bucket[0].device)
    for t, view in zip(bucket, flat.split([t.numel() for t in bucket]), strict=True):
        view.view(t.shape).copy_(t)
    return flat


def _receive_buffer(bucket: list[torch.Tensor], sender: bool) -> torch.Tensor:
    """The broadcast's tensor: the packed weights on the sender; on a receiver the lone tensor
    itself or an empty buffer (its stale contents would be overwritten anyway)."""
    if sender or (len(bucket) == 1 and bucket[0].is_contiguous()):
        return _flat(bucket)
    return torch.empty(sum(t.numel() for t in bucket), dtype=bucket[0].dtype, device=bucket[0].device)


def _mark_updated(params: list[torch.Tensor]) -> None:
    """Bump the version of parameters written through ``.data`` or by a collective, which
    autograd does not see: caches keyed on it (the FP8 weight copies) must see new weights."""
    for p in params:
        torch.autograd.graph.increment_version(p)


def _copy_back(bucket: list[torch.Tensor], flat: torch.Tensor) -> None:
    if len(bucket) == 1 and flat.data_ptr() == bucket[0].data_ptr():
        return  # reduced in place
    for t, reduced in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
        t.copy_(reduced)


class OverlappedGradSync(GradSync):
    """GradSync whose reductions overlap the last micro-batch's backward and, under ZeRO-1,
    whose weight broadcasts overlap the next forward.

    ``attach`` fixes the buckets once, in reverse parameter order (about the order backward
    produces gradients), each of one kind (dense/expert), one ZeRO owner and <= 25 MB, and
    registers a post-accumulate-grad hook on every parameter after the optimizer's own (so
    the fp32 gradient is complete when it runs). ``arm`` before the last micro-batch; then a
    bucket whose gradients are all ready is flattened and reduced asynchronously, strictly in
    bucket order so that every rank issues the same collectives in the same order. ``reduce``
    launches what is left (parameters that got no gradient), waits, divides and copies back:
    the same results as GradSync.reduce.

    ZeRO-1 (``attach(opt, model)`` with a whole Transformer): ``broadcast_updates`` only
    launches the owners' broadcasts, unit by unit in forward order (embedding, each block, the
    final norm with the head), and a forward pre-hook on each unit waits for the broadcasts up
    to its own on the device (no host sync) before it runs. ``settle`` waits for everything:
    the trainer calls it before anything else reads the weights (a checkpoint, the end).
    """

    def __init__(self, model: nn.Module, mesh: Mesh, zero: bool, reduce_dtype: torch.dtype = torch.float32, bucket_bytes: int = BUCKET_BYTES) -> None:
        super().__init__(model, mesh, zero, reduce_dtype, bucket_bytes)
        self.armed = False
        self.next = 0
        self.launched_in_backward = 0  # buckets of the last step reduced before backward ended
        self.units: list[list[_Update]] = []  # ZeRO-1 broadcasts by forward unit (empty: not overlapped)
        self.waited = 0  # units of the pending broadcasts already waited for

    def attach(self, opt: MasterWeightAdamW, model: nn.Module | None = None) -> None:
        self._attach_reductions(opt)
        if self.zero and model is not None:
            self._attach_updates(opt, model)

    def _attach_updates(self, opt: MasterWeightAdamW, model: nn.Module) -> None:
        from moe.model import Transformer

        if not isinstance(model, Transformer) or model.embed is None or model.norm is None or model.lm_head is None:
            return  # a pipeline stage or another model: broadcasts stay after the step
        by_param = {id(p.param): p for p in opt.params}
        seen: set[int] = set()
        units = [model.embed, *model.layers.values(), model.norm]
        for i, module in enumerate(units):
            members = list(module.parameters()) + (list(model.lm_head.parameters()) if module is model.norm else [])
            params = []
            for t in members:
                if id(t) not in seen and id(t) in by_param:
                    seen.add(id(t))
                    params.append(by_param[id(t)])
            self.units.append(self._updates(params))
            module.register_forward_pre_hook(self._wait_hook(i))
        if len(seen) != len(opt.params):  # a parameter outside every unit: keep the plain broadcast
            self.units = []

    def _wait_hook(self, index: int):
        def hook(module: nn.Module, args: object) -> None:
            self.settle(index + 1)

        return hook

    @torch.no_grad()
    def broadcast_updates(self, opt: MasterWeightAdamW) -> None:
        if not self.units:
            super().broadcast_updates(opt)
            return
        self.settle()  # (the previous step's are long done: its forward waited for them)
        for updates in self.units:
            for u in updates:
                u.start(async_op=True)
        self.waited = 0

    @torch.no_grad()
    def settle(self, units: int | None = None) -> None:
        """Make the current stream wait for the weight broadcasts of the first ``units`` forward
        units (all by default), and unpack what arrived packed. A device-side wait."""
        end = len(self.units) if units is None else min(units, len(self.units))
        while self.waited < end:
            for u in self.units[self.waited]:
                u.land()
            self.waited += 1

    def _attach_reductions(self, opt: MasterWeightAdamW) -> None:
        for bucket in self.bucket_plan(opt):
            for p in bucket.params:
                p.param.register_post_accumulate_grad_hook(self._ready_hook(bucket))
        self._reset()

    def _ready_hook(self, bucket: _Bucket):
        def hook(_: torch.Tensor) -> None:
            if self.armed:
                bucket.pending -= 1
                if bucket.pending == 0:
                    self._launch(force=False)

        return hook

    def arm(self) -> None:
        """The next backward is the step's last: reduce buckets as they become ready."""
        self.armed = True

    def _reset(self) -> None:
        self.armed, self.next = False, 0
        for b in self.buckets:
            b.pending, b.work, b.flat, b.grads = len(b.params), None, None, []

    @torch.no_grad()
    def _launch(self, force: bool) -> None:
        """Start, strictly in plan order (every rank issues the same collectives in the same
        order), the buckets whose gradients are all ready (``force``: all that are left)."""
        while self.next < len(self.buckets) and (force or self.buckets[self.next].pending <= 0):
            self._launch_bucket(self.buckets[self.next], async_op=True)
            self.next += 1

    @torch.no_grad()
    def reduce(self, opt: MasterWeightAdamW) -> None:
        self.launched_in_backward = self.next
        self._launch(force=True)
        for b in self.buckets:
            self._finish_bucket(b)
        self._finish_local()
        self._reset()
