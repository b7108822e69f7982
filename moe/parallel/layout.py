"""The layout seam: how a model and its gradients are spread over processes.

A layout is applied to an unmodified model from the outside. ``SingleProcess`` does nothing;
``DataParallel`` replicates every weight and averages gradients over all ranks (bucketed
all-reduce after backward).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from moe.config import ConfigError, ExperimentConfig, ResolvedLayout
from moe.parallel.env import DistEnv


class Layout(Protocol):
    resolved: ResolvedLayout
    dp_rank: int
    dp_size: int

    def parallelize(self, model: nn.Module) -> nn.Module: ...

    def reduce_gradients(self, grads: list[torch.Tensor]) -> None: ...


class SingleProcess:
    def __init__(self, resolved: ResolvedLayout) -> None:
        self.resolved, self.dp_rank, self.dp_size = resolved, 0, 1

    def parallelize(self, model: nn.Module) -> nn.Module:
        return model

    def reduce_gradients(self, grads: list[torch.Tensor]) -> None:
        return None


class DataParallel:
    """Replicated weights; gradients averaged over the world in ~25 MB buckets."""

    bucket_bytes = 25 * 2**20

    def __init__(self, resolved: ResolvedLayout, env: DistEnv) -> None:
        self.resolved, self.dp_rank, self.dp_size = resolved, env.rank, env.world_size

    def parallelize(self, model: nn.Module) -> nn.Module:
        with torch.no_grad():
            for tensor in list(model.parameters()) + list(model.buffers()):
                dist.broadcast(tensor, src=0)
        return model

    def reduce_gradients(self, grads: list[torch.Tensor]) -> None:
        for bucket in _buckets(grads, self.bucket_bytes):
            flat = _flatten_dense_tensors(bucket)
            dist.all_reduce(flat)
            flat.div_(self.dp_size)
            for g, reduced in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
                g.copy_(reduced)


def _buckets(tensors: list[torch.Tensor], limit: int) -> list[list[torch.Tensor]]:
    out: list[list[torch.Tensor]] = []
    current: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        if current and (size + t.numel() * t.element_size() > limit or t.dtype != current[0].dtype):
            out.append(current)
            current, size = [], 0
        current.append(t)
        size += t.numel() * t.element_size()
    if current:
        out.append(current)
    return out


def build_layout(cfg: ExperimentConfig, env: DistEnv) -> Layout:
    resolved = cfg.check_world(env.world_size)
    if resolved.pp > 1 or resolved.ep > 1 or cfg.parallel.shard_optimizer or cfg.parallel.data_parallel != "ddp":
        raise ConfigError(
            "parallel: only data parallelism (pp=1, ep=1, data_parallel=ddp, shard_optimizer=false) "
            "is available in this version"
        )
    if env.world_size == 1:
        return SingleProcess(resolved)
    return DataParallel(resolved, env)
