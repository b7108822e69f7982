"""The tensors of a checkpoint, keyed so that any parallel layout can write and read them.

Dense parameters are saved under their names as fp32 masters, AdamW moments beside them.
Stacked expert weights ([E, ...]) are saved one expert per key (``<name>.expert_00017``), so a
rank holding experts [e0, e1) under expert parallelism, or a row shard of them under FSDP, writes
and reads exactly those keys, as plain views of what it holds (DCP loads them in place; a
DTensor's ``[i]`` would be a gathered copy, and a load into it would be lost).
Under ZeRO-1 only the owning rank of a parameter contributes its master and moments;
replicated tensors are written once (DCP deduplicates equal keys).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moe.layers.experts import expert_param_layout
from moe.optim import MasterWeightAdamW

EXPERT_KEY = "{name}.expert_{index:05d}"


def split_experts(name: str, tensor: torch.Tensor, offset: int) -> dict[str, torch.Tensor]:
    return {EXPERT_KEY.format(name=name, index=offset + i): tensor[i] for i in range(tensor.shape[0])}


def local_experts(name: str, tensor: torch.Tensor, experts: dict[str, tuple[int, int]]) -> tuple[torch.Tensor, int]:
    """The expert rows of a stacked weight (or its optimizer state) that this rank holds, and
    the global index of the first: its expert-parallel slice, or its FSDP shard (a DTensor)."""
    from torch.distributed.tensor import DTensor

    offset = experts[name][0]
    if isinstance(tensor, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, start = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        return tensor.detach().to_local(), offset + start[0]
    return tensor, offset


def _entries(name: str, tensor: torch.Tensor, experts: dict[str, tuple[int, int]]) -> dict[str, torch.Tensor]:
    if name in experts:
        return split_experts(name, *local_experts(name, tensor, experts))
    return {name: tensor}


def persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    keys = set(model.state_dict().keys())
    return {n: b for n, b in model.named_buffers() if n in keys}


def save_entries(model: nn.Module, opt: MasterWeightAdamW) -> dict[str, Any]:
    experts = expert_param_layout(model)
    weights: dict[str, torch.Tensor] = {}
    for name, master in opt.named_masters().items():
        weights.update(_entries(name, master, experts))
    weights.update(persistent_buffers(model))
    optim: dict[str, dict[str, torch.Tensor]] = {}
    for name, state in opt.named_state().items():
        if name in experts:
            avg, offset = local_experts(name, state["exp_avg"], experts)
            avg_sq, _ = local_experts(name, state["exp_avg_sq"], experts)
            for i in range(avg.shape[0]):
                optim[EXPERT_KEY.format(name=name, index=offset + i)] = {"step": state["step"], "exp_avg": avg[i], "exp_avg_sq": avg_sq[i]}
        else:
            optim[name] = state
    return {"model": weights, "optim": optim}


def load_targets(model: nn.Module, opt: MasterWeightAdamW, with_optim: bool = True) -> tuple[dict[str, Any], list[tuple[nn.Parameter, torch.Tensor]]]:
    """Tensors to load in place, and (parameter, fp32 buffer) pairs to copy afterwards for the
    parameters this rank does not own (their values are still needed)."""
    experts = expert_param_layout(model)
    weights: dict[str, torch.Tensor] = {}
    copies: list[tuple[nn.Parameter, torch.Tensor]] = []
    for p in opt.params:
        if p.owned:
            weights.update(_entries(p.name, p.master, experts))
        else:
            buf = torch.empty(p.param.shape, dtype=torch.float32, device=p.param.device)
            weights.update(_entries(p.name, buf, experts))
            copies.append((p.param, buf))
    weights.update(persistent_buffers(model))
    targets: dict[str, Any] = {"model": weights}
    if with_optim:
        targets["optim"] = save_entries(model, opt)["optim"]
    return targets, copies


def full_model_targets(
    shapes: dict[str, torch.Size], experts: dict[str, int], dtype=torch.float32
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(full tensors by parameter name, load targets with per-expert views into them)."""
    full = {n: torch.empty(s, dtype=dtype) for n, s in shapes.items()}
    targets: dict[str, torch.Tensor] = {}
    for n, t in full.items():
        targets.update(split_experts(n, t, 0) if n in experts else {n: t})
    return full, targets
