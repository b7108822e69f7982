"""The hardware a stage measures on: CPU processes, or N GPUs of a known memory size.

Local runs look at this machine; Slurm runs take the GPU count from ``slurm:`` and the model
from ``paper.gpu`` (the submitting host may have no GPU)."""

from __future__ import annotations

import dataclasses
from typing import Any

from moe.config import ConfigError
from moe.hardware import GPUS
from pipeline.executors import world_size
from pipeline.paper.config import PaperParams
from pipeline.units import gib


@dataclasses.dataclass(frozen=True)
class Hardware:
    kind: str  # "cpu" | "gpu"
    name: str  # e.g. "NVIDIA H200" or "cpu"
    count: int  # processes (one per GPU)
    memory_gib: float | None  # per GPU (GiB: what the memory plan's GiB are compared against)
    capability: tuple[int, int] | None = None

    def describe(self) -> str:
        if self.kind == "cpu":
            return f"{self.count} CPU process{'es' if self.count > 1 else ''} (gloo)"
        mem = f", {self.memory_gib:.0f} GiB" if self.memory_gib else ""
        return f"{self.count}x {self.name}{mem}"

    @classmethod
    def from_record(cls, hw: dict[str, Any]) -> Hardware:
        """The hardware a stage's result file names (``memory_gb`` in results before issue 49)."""
        cap = hw.get("capability")
        return cls(hw["kind"], hw["name"], hw["count"], gib(hw, "memory_gib"), tuple(cap) if isinstance(cap, list | tuple) else None)


def detect(params: PaperParams) -> Hardware:
    base, paper = params.base, params.paper
    world = world_size(base)
    if base.executor.kind == "slurm":
        gpus = base.slurm.gpus_per_node > 0
        if paper.scale == "gpu" and not gpus:
            raise ConfigError("paper.scale: gpu needs slurm.gpus_per_node > 0")
        if not gpus or paper.scale == "cpu":
            return Hardware("cpu", "cpu", world, None)
        if paper.gpu == "auto":
            raise ConfigError("paper.gpu: name the GPU model (h100, h200, b200, b300) for Slurm runs")
        spec = GPUS[paper.gpu]
        return Hardware("gpu", spec.name, world, spec.memory_gib, spec.capability)
    import torch

    if paper.scale == "cpu" or not torch.cuda.is_available():
        if paper.scale == "gpu":
            raise ConfigError("paper.scale: gpu, but no CUDA GPU is visible here")
        return Hardware("cpu", "cpu", world, None)
    if world > torch.cuda.device_count():
        raise ConfigError(f"executor.nprocs: {world} processes but {torch.cuda.device_count()} GPUs visible")
    props = torch.cuda.get_device_properties(0)
    return Hardware("gpu", props.name, world, props.total_memory / 2**30, (props.major, props.minor))
