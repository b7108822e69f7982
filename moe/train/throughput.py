"""Throughput and MFU of the steps a log point covers (FLOPs per token: moe.plan.accounting)."""

from __future__ import annotations

import dataclasses

import torch

from moe.hardware import gpu_by_device_name


def peak_tflops(device: torch.device, override: float | None = None) -> float | None:
    """Dense bf16 peak of ``device`` (None when unknown, e.g. CPUs)."""
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    spec = gpu_by_device_name(torch.cuda.get_device_name(device))
    return spec.peak_bf16_tflops if spec else None


@dataclasses.dataclass(frozen=True)
class Throughput:
    tokens_per_s: float
    tokens_per_s_per_device: float
    tflops_per_device: float
    mfu: float | None


def throughput(tokens: int, seconds: float, devices: int, flops_token: float, peak: float | None) -> Throughput:
    tps = tokens / seconds
    per_device = tps / devices
    tflops = per_device * flops_token / 1e12
    return Throughput(tps, per_device, tflops, tflops / peak if peak else None)
