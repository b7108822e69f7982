"""The library's implementation switches: environment variables that pick between two ways of
doing one thing, each kept for a side-by-side measurement (bench/h200) or a check.

Every switch is declared here, once, with its values (the first is the default) and where it
acts; a module reads its switch through :func:`choice`, which refuses a value not declared, by
name (a typo must not silently time the other path). ``bench.common`` records every switch set
in a run's JSON from this table, and tests/test_switches.py holds that no module reads a ``MOE_``
variable any other way.
"""

from __future__ import annotations

import dataclasses
import os


@dataclasses.dataclass(frozen=True)
class Switch:
    name: str
    values: tuple[str, ...]  # the first is the default
    acts_in: str  # the module that reads it
    doc: str


SWITCHES: dict[str, Switch] = {
    s.name: s
    for s in (
        Switch("MOE_NORM_BACKWARD", ("triton", "torch"), "moe.kernels.rmsnorm", "torch: torch's RMSNorm backward under its fused forward"),
        Switch("MOE_RESIDUAL_NORM", ("1", "0"), "moe.kernels.rmsnorm", "0: autograd adds the residual's gradient, not the norm's backward"),
        Switch("MOE_WGRAD_ORDER", ("heaviest", "index"), "moe.kernels.grouped_wgrad", "index: the wgrad kernel's experts in index order"),
        Switch("MOE_WGRAD_KERNEL", ("ws", "triton"), "moe.kernels.grouped_wgrad_ws", "triton: the Triton wgrad kernel, not the warp-specialised one"),
        Switch("MOE_GRAD_ADD", ("triton", "torch"), "moe.kernels.grad_add", "torch: torch's add of each micro-batch's gradient into fp32"),
        Switch("MOE_RESIDUAL_ADD", ("combine", "separate"), "moe.layers.moe_layer", "separate: the block's own residual add after an MoE layer"),
        Switch(
            "MOE_ROUTER_INPUT_GRAD",
            ("gemm", "autograd"),
            "moe.layers.moe_layer",
            "autograd: the router's input gradient added to the gather's by autograd",
        ),
        Switch(
            "MOE_EXPERT_GRAD_SQUARES",
            ("epilogue", "foreach"),
            "moe.optim",
            "foreach: the norm reads the expert gradients again, not the sums of squares from the last wgrad GEMM's epilogue",
        ),
        Switch("MOE_SHARED_INPUT_GRAD", ("gemm", "autograd"), "moe.nn.shared_input", "autograd: autograd's adds of the q/k/v input gradients"),
        Switch("MOE_DETERMINISTIC_FILL", ("0", "1"), "moe.train.determinism", "1: torch's NaN fill of new memory in the deterministic mode"),
    )
}


def choice(name: str) -> str:
    """The switch's value in this process's environment (its default where unset)."""
    switch = SWITCHES[name]
    value = os.environ.get(name, switch.values[0])
    if value not in switch.values:
        allowed = ", ".join(repr(v) for v in switch.values)
        raise ValueError(f"{name}={value!r}: expected one of {allowed} (the first is the default)")
    return value


def set_in_environment() -> str | None:
    """'NAME=value ...' for every declared switch set in the environment (a benchmark's record), or None."""
    return " ".join(f"{name}={os.environ[name]}" for name in SWITCHES if name in os.environ) or None
