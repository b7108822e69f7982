"""Parallel layouts applied to an unmodified model from the outside."""

from moe.parallel.env import DistEnv, init_distributed, pick_device, shutdown_distributed
from moe.parallel.layout import DataParallel, Layout, SingleProcess, build_layout

__all__ = [
    "DataParallel",
    "DistEnv",
    "Layout",
    "SingleProcess",
    "build_layout",
    "init_distributed",
    "pick_device",
    "shutdown_distributed",
]
