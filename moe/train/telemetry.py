"""Per-layer MoE telemetry accumulated on the device, reduced to floats only when logged.

Forward hooks on the MoE layers fold in every forward (micro-batches and pipeline schedules
alike). The load numbers are real token counts per expert, summed over data-parallel ranks
(not the balancing loss, which can improve while the real load gets worse: the paper's
"token gerrymandering"); their figures are in :mod:`moe.train.load_stats`. Under expert
parallelism each rank also counts the rows its experts received at the all-to-all, and the
log point reports the busiest rank over the mean (what makes the others wait). The time
ranks actually wait at the all-to-all is not measured: it cannot be told apart from the
transfer without a barrier (a host sync), so the row ratio stands in for it. With pipeline
stages, every stage reduces its own layers and the logging rank gathers them.

With ``slots`` (train.layout_invariant: the step's micro-batches over all ranks) the balance
and z-losses are kept per global micro-batch (``slot``, set before each forward), summed over
the ranks where each slot has one contributor (exact) and over slots in index order: the same
bits at any data-parallel size."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moe.layers.moe_layer import MoELayer
from moe.train.load_stats import LOAD_STATS, load_stats, max_over_mean, relative_load

# Per-expert relative loads (``expert_load/layer_L/expert_E``): the heatmap's data.
PER_EXPERT_PREFIX = "expert_load/"


class MoETelemetry:
    def __init__(self, model: nn.Module, device: torch.device, dp_group: dist.ProcessGroup | None = None, slots: int | None = None) -> None:
        self.layers = [(name.split(".")[1], m) for name, m in model.named_modules() if isinstance(m, MoELayer)]
        self.device, self.dp_group = device, dp_group
        n = len(self.layers)
        num_experts = self.layers[0][1].router.num_experts if self.layers else 0
        self.counts = torch.zeros(n, num_experts, dtype=torch.int64, device=device)
        self.rows = torch.zeros(n, dtype=torch.int64, device=device)
        self.slotted = slots is not None
        self.slot = 0  # the global micro-batch the next forward belongs to (slotted)
        self.lb = torch.zeros(n, slots or 1, device=device)
        self.z = torch.zeros(n, slots or 1, device=device)
        self.forwards = torch.zeros(n, device=device)
        self.expert_parallel = any(getattr(m.dispatcher, "ep", 1) > 1 for _, m in self.layers)
        for i, (_, layer) in enumerate(self.layers):
            layer.register_forward_hook(self._hook(i))

    def _hook(self, i: int):
        def hook(module: MoELayer, args, out) -> None:
            if not module.training:
                return
            s = module.last_stats
            self.counts[i] += s.tokens_per_expert
            if s.rows_received is not None:
                self.rows[i] += s.rows_received
            self.lb[i, self.slot] += s.lb_loss
            self.z[i, self.slot] += s.z_loss
            self.forwards[i] += 1

        return hook

    def _reduce_local(self, distributed: bool) -> dict[str, dict[str, Any]]:
        """This process's layers: figures computed on the device, one copy to the host."""
        counts = self.counts.clone()
        computed = self.rows.clone()  # rows the experts computed, against the slots routed
        rank_rows = None
        if self.slotted:
            lb, z = self._slotted_means(distributed)
        else:
            lb = self.lb[:, 0] / self.forwards.clamp_min(1)
            z = self.z[:, 0] / self.forwards.clamp_min(1)
        if distributed and self.dp_group is not None:
            dist.all_reduce(counts, group=self.dp_group)
            dist.all_reduce(computed, group=self.dp_group)
            size = dist.get_world_size(self.dp_group)
            if not self.slotted:
                dist.all_reduce(lb, group=self.dp_group)
                dist.all_reduce(z, group=self.dp_group)
                lb, z = lb / size, z / size
            if self.expert_parallel:
                gathered = [torch.empty_like(self.rows) for _ in range(size)]
                dist.all_gather(gathered, self.rows, group=self.dp_group)
                rank_rows = max_over_mean(torch.stack(gathered))
        n, num_experts = counts.shape
        dropped = 1 - computed.double() / counts.sum(1).clamp_min(1).double()
        parts = [load_stats(counts).flatten(), relative_load(counts).flatten(), lb.double(), z.double(), dropped]
        if rank_rows is not None:
            parts.append(rank_rows)
        host = torch.cat(parts).tolist()  # the one device-to-host copy
        stats, host = host[: n * len(LOAD_STATS)], host[n * len(LOAD_STATS) :]
        loads, host = host[: n * num_experts], host[n * num_experts :]
        per_layer = {}
        for i, (name, _) in enumerate(self.layers):
            per_layer[name] = {
                "stats": stats[i * len(LOAD_STATS) : (i + 1) * len(LOAD_STATS)],
                "load": loads[i * num_experts : (i + 1) * num_experts],
                "lb": host[i],
                "z": host[n + i],
                "dropped": host[2 * n + i],
                "ep_rows": host[3 * n + i] if rank_rows is not None else None,
            }
        for t in (self.counts, self.rows, self.lb, self.z, self.forwards):
            t.zero_()
        return per_layer

    def _slotted_means(self, distributed: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-layer means over every forward of every rank, summed slot by slot in index order."""
        lb, z, forwards = self.lb.clone(), self.z.clone(), self.forwards.clone()
        if distributed and self.dp_group is not None:
            for t in (lb, z, forwards):  # a slot has one rank's values, the others' zeros; counts are integers
                dist.all_reduce(t, group=self.dp_group)
        return lb.sum(dim=1) / forwards.clamp_min(1), z.sum(dim=1) / forwards.clamp_min(1)

    def reduce(self) -> dict[str, float]:
        """Host floats since the last reduce; then reset. Collective when distributed: every
        rank must call it at the same step."""
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        per_layer = self._reduce_local(distributed) if self.layers else {}
        if distributed:
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, per_layer)
            for part in gathered:
                per_layer.update(part)
        if not per_layer:
            return {}
        out: dict[str, float] = {}
        by_stat: dict[str, list[float]] = {s: [] for s in LOAD_STATS}
        lbs, zs, ep_rows, dropped = [], [], [], []
        for name in sorted(per_layer, key=int):
            layer = per_layer[name]
            for stat, value in zip(LOAD_STATS, layer["stats"], strict=True):
                out[f"expert_load_{stat}/layer_{name}"] = value
                by_stat[stat].append(value)
            for e, value in enumerate(layer["load"]):
                out[f"{PER_EXPERT_PREFIX}layer_{name}/expert_{e}"] = value
            out[f"lb_loss/layer_{name}"] = layer["lb"]
            out[f"z_loss/layer_{name}"] = layer["z"]
            dropped.append(layer["dropped"])
            lbs.append(layer["lb"])
            zs.append(layer["z"])
            if layer["ep_rows"] is not None:
                out[f"ep_rows_max_over_mean/layer_{name}"] = layer["ep_rows"]
                ep_rows.append(layer["ep_rows"])
        # Over layers: the worst layer for each figure, the total of idle experts.
        out.update(
            {
                "lb_loss": sum(lbs) / len(lbs),
                "z_loss": sum(zs) / len(zs),
                "expert_load_max_over_mean": max(by_stat["max_over_mean"]),
                "expert_load_min_over_mean": min(by_stat["min_over_mean"]),
                "expert_load_cv": max(by_stat["cv"]),
                "expert_load_idle": sum(by_stat["idle"]),
                "expert_load_entropy": min(by_stat["entropy"]),
                # Routed slots no expert computed (a capacity bound's drops; 0 when dropless).
                "tokens_dropped_fraction": max(dropped),
            }
        )
        if ep_rows:
            out["ep_rows_max_over_mean"] = max(ep_rows)
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
