"""Parallel layouts applied to an unmodified model from the outside."""

from moe.parallel.env import DistEnv, init_distributed, pick_device, shutdown_distributed
from moe.parallel.layout import FsdpLayout, Layout, ParallelLayout, build_layout
from moe.parallel.mesh import Mesh, build_mesh, layout_groups

__all__ = [
    "DistEnv",
    "FsdpLayout",
    "Layout",
    "Mesh",
    "ParallelLayout",
    "build_layout",
    "build_mesh",
    "init_distributed",
    "layout_groups",
    "pick_device",
    "shutdown_distributed",
]
