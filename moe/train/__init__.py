"""Training: optimizer, schedule, checkpoints, accounting, telemetry and the loop.

Submodules are imported on first use (moe.parallel uses the optimizer, the trainer uses
moe.parallel), so ``from moe.train import Trainer`` works without import cycles."""

from __future__ import annotations

import importlib

_EXPORTS = {
    "ParamCounts": "accounting", "flops_per_token": "accounting", "param_counts": "accounting",
    "peak_tflops": "accounting", "throughput": "accounting",
    "CheckpointError": "checkpoint", "CheckpointManager": "checkpoint", "latest_checkpoint": "checkpoint",
    "resolve_checkpoint": "checkpoint",
    "ConsoleSink": "sinks", "JsonlSink": "sinks", "MetricsSink": "sinks",
    "NonFiniteLossError": "trainer", "TrainSummary": "trainer", "Trainer": "trainer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"moe.train.{_EXPORTS[name]}"), name)
    raise AttributeError(name)
