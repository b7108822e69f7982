"""The deterministic mode (``train.deterministic``): bitwise-identical reruns on CUDA.

A GPU step is not reproducible by default because some kernels accumulate in an order that
varies from run to run (atomics in the flash-attention backward, sort-free index/scatter
backwards, cuBLAS workspaces shared between streams, NCCL algorithms picked by size). The
mode switches each of them to a fixed-order variant, once per process, before CUDA/NCCL
start:

- ``torch.use_deterministic_algorithms(True)`` (not warn-only): PyTorch's own deterministic
  paths (e.g. the flash/memory-efficient attention backwards without atomic dQ accumulation)
  and an error from any op that has none;
- cuDNN deterministic, no cuDNN autotuning, and no cuDNN attention (it has no deterministic
  backward);
- environment read when the libraries initialise: ``CUBLAS_WORKSPACE_CONFIG=:4096:8``,
  ``NCCL_ALGO=Ring`` and ``NCCL_PROTO=Simple`` (order-stable reductions for a fixed topology);
- our own kernels declare whether they are deterministic (``deterministic = True`` on the
  dispatcher, the expert GEMM and the precision recipe); a seam that does not say so fails the
  run with one line naming it; the router counts tokens per expert with a fixed-order
  reduction instead of ``scatter_add_``.

The settings are recorded in every checkpoint (``meta.json: determinism``) and as MLflow
tags (``determinism.*``). A resume under a different mode than the checkpoint's is allowed
but *warned about* (and tagged ``determinism.resume_mismatch``): the weights are valid
either way, only the bitwise reproducibility of the continuation is lost.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import MutableMapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moe.config import ConfigError
from moe.switches import choice

log = logging.getLogger("moe.train")

# Environment the libraries read once at initialisation -> the values the mode needs
# (first: the one it sets; the rest: also accepted when already set).
ENVIRONMENT: dict[str, tuple[str, ...]] = {
    "CUBLAS_WORKSPACE_CONFIG": (":4096:8", ":16:8"),
    "NCCL_ALGO": ("Ring",),
    "NCCL_PROTO": ("Simple",),
}
_NCCL_KEYS = ("NCCL_ALGO", "NCCL_PROTO")


class DeterminismError(ConfigError):
    """The deterministic mode cannot be honoured; the message names what is in the way."""


@dataclasses.dataclass(frozen=True)
class Determinism:
    """The mode of this process and every setting it changed (flat, string values)."""

    enabled: bool
    settings: dict[str, str] = dataclasses.field(default_factory=dict)

    def to_meta(self) -> dict[str, Any]:
        return {"enabled": self.enabled, "settings": dict(self.settings)}

    def tags(self) -> dict[str, str]:
        return {"determinism.enabled": str(self.enabled).lower(), **{f"determinism.{k}": v for k, v in self.settings.items()}}


def set_environment(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set the mode's environment variables (call before CUDA and NCCL initialise).

    A variable already set to an accepted value is kept; any other value is an error naming it."""
    environ = os.environ if environ is None else environ
    out = {}
    for key, accepted in ENVIRONMENT.items():
        current = environ.get(key)
        if current is None:
            environ[key] = accepted[0]
        elif current not in accepted:
            raise DeterminismError(
                f"train.deterministic: the environment sets {key}={current!r}; the deterministic mode needs "
                f"{' or '.join(repr(a) for a in accepted)} (unset it or set train.deterministic=false)"
            )
        out[f"env.{key}"] = environ[key]
    return out


def configure(enabled: bool, layout_invariant: bool = False) -> Determinism:
    """Put this process in (or leave it out of) the deterministic mode; process-wide.

    Off does nothing (the process keeps whatever it had). On: call before the process group and
    the first cuBLAS handle exist (the Trainer calls it first thing). ``layout_invariant``
    (train.layout_invariant, which implies the mode) is recorded with the settings, so a resume
    under the other setting is warned about."""
    if not enabled and not layout_invariant:
        return Determinism(False)
    preset = {k: os.environ.get(k) for k in ENVIRONMENT}
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        missing = [k for k in _NCCL_KEYS if preset[k] not in ENVIRONMENT[k]]
        if missing:
            raise DeterminismError(
                f"train.deterministic: the NCCL process group was created without {', '.join(missing)} "
                "set; launch with the mode's environment (moe.train.determinism.ENVIRONMENT) already set"
            )
    settings = set_environment()
    if preset["CUBLAS_WORKSPACE_CONFIG"] is None and torch.cuda.is_available() and torch.cuda.is_initialized():
        log.warning(
            "train.deterministic: CUBLAS_WORKSPACE_CONFIG was set after CUDA started; it applies only to "
            "cuBLAS handles created from now on (set it in the launch environment to be sure)"
        )
        settings["env.CUBLAS_WORKSPACE_CONFIG"] += " (set after CUDA init)"
    torch.use_deterministic_algorithms(True, warn_only=False)
    # torch's guard fills every new tensor with NaN (integers: their max) so that a kernel reading
    # memory nobody wrote cannot differ between runs. Our kernels write what they read, which
    # the guard itself proves: a run with it and one without give the same bits (bench/h200/
    # determinism_fill.sh), while it cost 46 ms of a 760 ms step at OLMoE width (bench/NOTES.md).
    # MOE_DETERMINISTIC_FILL=1 keeps it (to check a new kernel the same way).
    torch.utils.deterministic.fill_uninitialized_memory = choice("MOE_DETERMINISTIC_FILL") == "1"
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.enable_cudnn_sdp(False)
    settings.update(
        {
            "torch.use_deterministic_algorithms": "true",
            "torch.utils.deterministic.fill_uninitialized_memory": str(torch.utils.deterministic.fill_uninitialized_memory).lower(),
            "torch.backends.cudnn.deterministic": "true",
            "torch.backends.cudnn.benchmark": "false",
            "sdpa.cudnn": "false",
            "router.counts": "fixed-order",
        }
    )
    if layout_invariant:
        settings["layout_invariant"] = "int64 gradient sums, per-micro-batch seeds"
    return Determinism(True, settings)


def prepare_model(model: nn.Module, recipe: Any, mode: Determinism) -> None:
    """Check every kernel seam of the (parallelised) model and switch the routers' counting.

    A seam object is deterministic only when it says so (``deterministic = True``)."""
    if not mode.enabled:
        return
    from moe.layers.moe_layer import MoELayer

    if getattr(recipe, "deterministic", False) is not True:
        raise DeterminismError(f"train.deterministic: precision recipe {getattr(recipe, 'name', recipe)!r} has no deterministic variant")
    for name, module in model.named_modules():
        if not isinstance(module, MoELayer):
            continue
        for role, obj in (("dispatcher", module.dispatcher), ("experts.gemm", module.experts.gemm)):
            if getattr(obj, "deterministic", False) is not True:
                raise DeterminismError(f"train.deterministic: {name}.{role} ({type(obj).__name__}) has no deterministic variant")
        module.router.deterministic = True


def resume_mismatch(saved: dict[str, Any] | None, current: Determinism, path: Any) -> str | None:
    """A one-line description of how the checkpoint's mode differs from this run's (None: same)."""
    saved = saved or {"enabled": False, "settings": {}}  # checkpoints from before the mode: off
    was = bool(saved.get("enabled"))
    if was != current.enabled:
        return (
            f"{path}: written with train.deterministic={str(was).lower()}, resumed with "
            f"{str(current.enabled).lower()}; the continuation is not bitwise reproducible against the original run"
        )
    old, new = saved.get("settings") or {}, current.settings
    for key in sorted(set(old) | set(new)):
        if old.get(key) != new.get(key):
            return (
                f"{path}: deterministic-mode setting {key}={old.get(key)!r} there, {new.get(key)!r} here; "
                "the continuation may differ from the original run"
            )
    return None
