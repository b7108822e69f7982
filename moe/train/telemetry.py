"""Per-layer MoE telemetry accumulated on the device, reduced to floats only when logged.

Forward hooks on the MoE layers fold in every forward (micro-batches and pipeline schedules
alike). The load numbers are real token counts per expert, summed over data-parallel ranks
(not the balancing loss, which can improve while the real load gets worse: the paper's
"token gerrymandering"). With pipeline stages, every stage reduces its own layers and the
logging rank gathers them."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from moe.layers.moe_layer import MoELayer


class MoETelemetry:
    def __init__(self, model: nn.Module, device: torch.device, dp_group: dist.ProcessGroup | None = None) -> None:
        self.layers = [(name.split(".")[1], m) for name, m in model.named_modules() if isinstance(m, MoELayer)]
        self.device, self.dp_group = device, dp_group
        n = len(self.layers)
        num_experts = self.layers[0][1].router.num_experts if self.layers else 0
        self.counts = torch.zeros(n, num_experts, dtype=torch.int64, device=device)
        self.lb = torch.zeros(n, device=device)
        self.z = torch.zeros(n, device=device)
        self.forwards = torch.zeros(n, device=device)
        for i, (_, layer) in enumerate(self.layers):
            layer.register_forward_hook(self._hook(i))

    def _hook(self, i: int):
        def hook(module: MoELayer, args, out) -> None:
            if not module.training:
                return
            s = module.last_stats
            self.counts[i] += s.tokens_per_expert
            self.lb[i] += s.lb_loss
            self.z[i] += s.z_loss
            self.forwards[i] += 1

        return hook

    def reduce(self) -> dict[str, float]:
        """Host floats since the last reduce; then reset. Collective when distributed: every
        rank must call it at the same step."""
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        per_layer: dict[str, tuple[list[int], float, float]] = {}
        if self.layers:
            counts = self.counts.clone()
            lb = self.lb / self.forwards.clamp_min(1)
            z = self.z / self.forwards.clamp_min(1)
            if distributed and self.dp_group is not None:
                dist.all_reduce(counts, group=self.dp_group)
                size = dist.get_world_size(self.dp_group)
                dist.all_reduce(lb, group=self.dp_group)
                dist.all_reduce(z, group=self.dp_group)
                lb, z = lb / size, z / size
            for (name, _), c, lb_v, z_v in zip(self.layers, counts.tolist(), lb.tolist(), z.tolist(), strict=True):
                per_layer[name] = (c, lb_v, z_v)
            self.counts.zero_()
            self.lb.zero_()
            self.z.zero_()
            self.forwards.zero_()
        if distributed:
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, per_layer)
            for part in gathered:
                per_layer.update(part)
        if not per_layer:
            return {}
        out: dict[str, float] = {}
        ratios, lbs, zs = [], [], []
        for name in sorted(per_layer, key=int):
            c, lb_v, z_v = per_layer[name]
            mean = sum(c) / len(c)
            ratio = max(c) / mean if mean > 0 else 0.0
            out[f"expert_load_max_over_mean/layer_{name}"] = ratio
            out[f"lb_loss/layer_{name}"] = lb_v
            ratios.append(ratio)
            lbs.append(lb_v)
            zs.append(z_v)
        out.update({"lb_loss": sum(lbs) / len(lbs), "z_loss": sum(zs) / len(zs), "expert_load_max_over_mean": max(ratios)})
        out.update(self._dispatch_telemetry())
        return out

    def _dispatch_telemetry(self) -> dict[str, float]:
        """This rank's symmetric EP dispatcher figures (parallel.ep_backend=nvshmem): peak
        receive-buffer use and capacity overflows per layer (an overflow also turns the step's
        loss NaN, so the non-finite policy skips or stops it; this names the layer)."""
        out: dict[str, float] = {}
        for name, layer in self.layers:
            stats = getattr(layer.dispatcher, "telemetry", lambda: {})()
            for key, value in stats.items():
                out[f"{key}/layer_{name}"] = float(value)
        return out
