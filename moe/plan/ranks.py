"""Exact bytes each rank holds between steps: the model is built on the meta device and the real
layout code (expert slicing, pipeline pruning, ZeRO-1 ownership, FSDP2 sharding) applied to it
for every rank, so weight, master, gradient and AdamW bytes are those a real run allocates; an
FP8 recipe is then prepared on the same model (moe.plan.fp8) for its released weights and copies."""

from __future__ import annotations

import dataclasses
import math

import torch

from moe.config import ExperimentConfig, ResolvedLayout
from moe.config.model import ModelConfig
from moe.hardware import RECIPES as RECIPE_FACTS
from moe.hardware import recipe_on
from moe.plan.fp8 import RankFp8, planning_recipe, rank_fp8, sink_takes_expert_grads


@dataclasses.dataclass(frozen=True)
class RankState:
    """Bytes a rank holds between steps (and its gradients), from the built model's shapes."""

    rank: int
    stage: int
    params: int
    weights: int  # the model's parameters in their storage dtype
    masters: int  # fp32 master copies (bf16 recipe; owned parameters only under ZeRO-1)
    grads: int  # fp32 gradients (every parameter of the rank; ZeRO-1 reduces to the owner after backward)
    optimizer: int  # AdamW exp_avg + exp_avg_sq (owned parameters)
    layers: int  # transformer blocks on this rank
    transient_grad: int  # the largest parameter's low-precision gradient before its fp32 accumulation
    first: bool
    last: bool
    fp8: RankFp8 | None = None  # what an FP8 recipe releases and adds (None: no FP8 GEMMs)


def _param_dtype(cfg: ExperimentConfig) -> tuple[torch.dtype, bool]:
    """How the recipe stores weights on a GPU, from the device-free facts (no CUDA call: a CPU
    machine plans GPU jobs)."""
    facts = RECIPE_FACTS[recipe_on(cfg.precision.recipe, gpu=True)]
    return getattr(torch, facts.param_dtype), facts.master_weights


def _meta_model(cfg: ModelConfig, expert_gemm=None):
    """The model on the meta device; ``expert_gemm``: the recipe's, as the trainer builds it."""
    from moe.model import Transformer

    with torch.device("meta"):
        return Transformer(cfg, expert_gemm=expert_gemm)


def layout_mesh(pp: int, dp: int, ep: int, rank: int):
    """The mesh ``rank`` would have (its groups' ranks filled in), without a process group."""
    from moe.parallel.mesh import Mesh, layout_groups

    mesh = Mesh(pp=pp, dp=dp, ep=ep, rank=rank)
    for kind, groups in layout_groups(pp, dp, ep).items():
        for ranks in groups:
            if rank in ranks:
                setattr(mesh, f"{kind}_ranks", ranks)
    return mesh


def rank_states(
    cfg: ExperimentConfig, r: ResolvedLayout, param_dtype: torch.dtype | None = None, master_weights: bool | None = None
) -> list[RankState]:
    """Every rank's parameter and optimizer bytes (one meta model per pipeline stage); ``r``: the
    config's layout on the planned world (ExperimentConfig.resolve, called once by the caller)."""
    from moe.parallel.expert_parallel import apply_expert_parallel
    from moe.parallel.grad_sync import GradSync
    from moe.parallel.pipeline import prune_for_stages

    if param_dtype is None or master_weights is None:
        param_dtype, master_weights = _param_dtype(cfg)
    r.check_master_weights(master_weights)  # as FsdpLayout.optimizer refuses it
    if r.data_parallel == "fsdp":
        return _fsdp_states(cfg, r.world_size)
    elem = torch.empty((), dtype=param_dtype).element_size()
    out = []
    for stage in range(r.pp):
        mesh = layout_mesh(r.pp, r.dp, r.ep, stage * r.dp)
        model = apply_expert_parallel(_meta_model(cfg.model, planning_recipe(cfg).expert_gemm), mesh)
        if r.pp > 1:
            model, _ = prune_for_stages(model, mesh, r.virtual_stages)
        sync = GradSync(model, mesh, cfg.parallel.shard_optimizer)
        seen, params = set(), []
        for name, p in model.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                params.append((name, p.numel(), sync.kind_of(name)))
        numel = sum(n for _, n, _ in params)
        fp8 = rank_fp8(model, cfg, sync.broadcasts_expert_weights)  # last: it prepares the model in place
        for dp_rank in range(r.dp):
            if sync.zero:
                index = {"dense": dp_rank, "expert": dp_rank // r.ep}
                owned = sum(n for name, n, kind in params if sync.owner[name] == index[kind])
            else:
                owned = numel
            low = master_weights and param_dtype != torch.float32
            sunk = low and sink_takes_expert_grads(cfg)  # no bf16 gradient of an expert weight
            largest = max((n for _, n, kind in params if not (sunk and kind == "expert")), default=0)
            out.append(
                RankState(
                    rank=stage * r.dp + dp_rank,
                    stage=stage,
                    params=numel,
                    weights=numel * elem,
                    masters=owned * 4 if low else 0,
                    grads=numel * 4,
                    optimizer=owned * 8,
                    layers=len(model.layers),
                    transient_grad=largest * elem if low else 0,
                    first=model.embed is not None,
                    last=model.lm_head is not None,
                    fp8=fp8,
                )
            )
    return out


def _fsdp_states(cfg: ExperimentConfig, world: int) -> list[RankState]:
    """FSDP2 shards every parameter's first dimension over all ranks (padded to a multiple)."""
    model = _meta_model(cfg.model)
    seen, shard = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            rows = math.ceil(p.shape[0] / world) if p.dim() else 1
            shard += rows * (p.numel() // max(1, p.shape[0] if p.dim() else 1))
    numel = shard
    return [
        RankState(
            rank=i,
            stage=0,
            params=numel,
            weights=numel * 4,
            masters=0,
            grads=numel * 4,
            optimizer=numel * 8,
            layers=cfg.model.n_layers,
            transient_grad=0,
            first=True,
            last=True,
        )
        for i in range(world)
    ]
