"""Per-layer MoE telemetry accumulated on the device, reduced to floats only when logged.

The load numbers are real token counts per expert (not the balancing loss, which can
improve while the real load gets worse: the paper's "token gerrymandering")."""

from __future__ import annotations

import torch
import torch.distributed as dist

from moe.model import Transformer


class MoETelemetry:
    def __init__(self, model: Transformer, device: torch.device) -> None:
        self.layers = list(model.moe_layers())
        self.device = device
        n = len(self.layers)
        num_experts = self.layers[0][1].router.num_experts if self.layers else 0
        self.counts = torch.zeros(n, num_experts, dtype=torch.int64, device=device)
        self.lb = torch.zeros(n, device=device)
        self.z = torch.zeros(n, device=device)
        self.forwards = 0

    def add(self) -> None:
        """Fold in the stats of the forward that just ran (device ops only)."""
        if not self.layers:
            return
        stats = [layer.last_stats for _, layer in self.layers]
        self.counts += torch.stack([s.tokens_per_expert for s in stats])
        self.lb += torch.stack([s.lb_loss for s in stats])
        self.z += torch.stack([s.z_loss for s in stats])
        self.forwards += 1

    def reduce(self, group: dist.ProcessGroup | None = None) -> dict[str, float]:
        """Host floats since the last reduce (summing counts over ranks); then reset."""
        if not self.layers or self.forwards == 0:
            return {}
        counts, lb, z = self.counts.clone(), self.lb / self.forwards, self.z / self.forwards
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(counts, group=group)
            dist.all_reduce(lb, group=group)
            dist.all_reduce(z, group=group)
            world = dist.get_world_size(group)
            lb, z = lb / world, z / world
        load = counts.float()
        max_over_mean = load.max(dim=1).values / load.mean(dim=1).clamp_min(1e-9)
        out = {
            "lb_loss": lb.mean().item(),
            "z_loss": z.mean().item(),
            "expert_load_max_over_mean": max_over_mean.max().item(),
        }
        per_layer = max_over_mean.tolist()
        lbs = lb.tolist()
        for (name, _), ratio, lb_value in zip(self.layers, per_layer, lbs, strict=True):
            out[f"expert_load_max_over_mean/layer_{name}"] = ratio
            out[f"lb_loss/layer_{name}"] = lb_value
        self.counts.zero_()
        self.lb.zero_()
        self.z.zero_()
        self.forwards = 0
        return out
