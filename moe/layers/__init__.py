"""MoE layer parts, each replaceable: router, dispatcher, expert GEMM, experts, layer."""

from moe.layers.dispatch import Dispatcher, LocalDispatcher
from moe.layers.experts import GroupedExperts
from moe.layers.gemm import ExpertGemm, GroupedMM
from moe.layers.moe_layer import MoELayer, MoEStats
from moe.layers.router import Router, Routing

__all__ = [
    "Dispatcher",
    "ExpertGemm",
    "GroupedExperts",
    "GroupedMM",
    "LocalDispatcher",
    "MoELayer",
    "MoEStats",
    "Router",
    "Routing",
]
