"""Gradient synchronisation for data parallelism with resident experts, and ZeRO-1.

Dense gradients are summed over the stage's data-parallel group, expert gradients only over
the expert-data-parallel group (the ranks holding the same experts); both are divided by the
data-parallel size, which makes the result the gradient of the global-batch mean loss.
Reductions run on flat buckets of ~25 MB.

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

from moe.parallel.mesh import Mesh
from moe.train.optim import MasterParam, MasterWeightAdamW
from moe.train.state import expert_param_layout

BUCKET_BYTES = 25 * 2**20


@dataclasses.dataclass(frozen=True)
class ParamGroupSpec:
    kind: str  # "dense" or "expert"
    group: dist.ProcessGroup | None
    ranks: tuple[int, ...]  # world ranks of the group
    my_index: int


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
    def __init__(self, model: nn.Module, mesh: Mesh, zero: bool) -> None:
        self.mesh, self.zero = mesh, zero
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

    def kind_of(self, name: str) -> str:
        return "expert" if name in self.expert_names else "dense"

    def owns(self, name: str, param: nn.Parameter) -> bool:
        """For MasterWeightAdamW(owns=...)."""
        if not self.zero:
            return True
        return self.owner[name] == self.specs[self.kind_of(name)].my_index

    def _by_kind(self, opt: MasterWeightAdamW) -> dict[str, list[MasterParam]]:
        out: dict[str, list[MasterParam]] = {"dense": [], "expert": []}
        for p in opt.params:
            out[self.kind_of(p.name)].append(p)
        return out

    @torch.no_grad()
    def reduce(self, opt: MasterWeightAdamW) -> None:
        divisor = float(self.mesh.dp)
        for kind, params in self._by_kind(opt).items():
            spec = self.specs[kind]
            params = [p for p in params if p.grad is not None]
            if len(spec.ranks) == 1:
                if divisor != 1.0:
                    torch._foreach_div_([p.grad for p in params], divisor)
                continue
            if not self.zero:
                for bucket in _buckets([p.grad for p in params]):
                    flat = _flatten_dense_tensors(bucket)
                    dist.all_reduce(flat, group=spec.group)
                    flat.div_(divisor)
                    _copy_back(bucket, flat)
                continue
            for owner_index in range(len(spec.ranks)):
                mine = [p.grad for p in params if self.owner[p.name] == owner_index]
                for bucket in _buckets(mine):
                    flat = _flatten_dense_tensors(bucket)
                    dist.reduce(flat, dst=spec.ranks[owner_index], group=spec.group)
                    if owner_index == spec.my_index:
                        flat.div_(divisor)
                        _copy_back(bucket, flat)

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
        for kind, params in self._by_kind(opt).items():
            spec = self.specs[kind]
            if len(spec.ranks) == 1:
                continue
            for owner_index in range(len(spec.ranks)):
                tensors = [p.param.data for p in params if self.owner[p.name] == owner_index]
                for bucket in _buckets(tensors):
                    flat = _flatten_dense_tensors(bucket)
                    dist.broadcast(flat, src=spec.ranks[owner_index], group=spec.group)
                    if owner_index != spec.my_index:
                        _copy_back(bucket, flat)


def global_grad_norm(local: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """sqrt of the world-wide sum of squares (device-side; no host sync)."""
    sq = torch.zeros((), device=device, dtype=torch.float32)
    if local:
        sq = sq + torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) ** 2 for g in local]).sum()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(sq)
    return sq.sqrt()


@torch.no_grad()
def clip_(grads: list[torch.Tensor], norm: torch.Tensor, max_norm: float) -> None:
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    if grads:
        torch._foreach_mul_(grads, coef)


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


def _copy_back(bucket: list[torch.Tensor], flat: torch.Tensor) -> None:
    for t, reduced in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
        t.copy_(reduced)
