"""Training: optimizer, schedule, checkpoints, accounting, telemetry and the loop."""

from moe.train.accounting import ParamCounts, flops_per_token, param_counts, peak_tflops, throughput
from moe.train.checkpoint import CheckpointError, CheckpointManager, latest_checkpoint, resolve_checkpoint
from moe.train.sinks import ConsoleSink, JsonlSink, MetricsSink
from moe.train.trainer import NonFiniteLossError, Trainer, TrainSummary

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "ConsoleSink",
    "JsonlSink",
    "MetricsSink",
    "NonFiniteLossError",
    "ParamCounts",
    "TrainSummary",
    "Trainer",
    "flops_per_token",
    "latest_checkpoint",
    "param_counts",
    "peak_tflops",
    "resolve_checkpoint",
    "throughput",
]
