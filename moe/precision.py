"""Precision recipes (a seam: FP8 / MXFP8 recipes plug in here).

A recipe says how weights are stored, whether the optimizer keeps fp32 master copies, which
autocast context wraps forward and backward, and (FP8) which expert GEMM the MoE layers use.
Router logits and the loss are computed in fp32 by the model and trainer whatever the recipe.

fp8_rowwise and mxfp8 are bf16 plus FP8 expert GEMMs (moe.layers.gemm_fp8 says which tensors
and which scaling, and why): weights are bf16 parameters with fp32 masters (in training the
expert weights' bf16 values are dropped for FP8 copies made from the masters:
:meth:`PrecisionRecipe.attach_optimizer`), so a checkpoint
written under one recipe loads under any other. The dense projections (attention, dense and
shared-expert MLPs) stay bf16 unless ``precision.fp8_dense`` (fp8_rowwise; moe.nn.fp8_linear,
torch._scaled_mm, by the same per-shape rule); the LM head and the router
never take FP8. Both FP8 recipes are refused before anything runs
where they cannot: fp8_rowwise needs compute capability >= 9.0 (torch._scaled_grouped_mm),
mxfp8 >= 10.0 (an MX kernel launched on sm90 once broke the CUDA context of the process).
``emulate`` runs their quantisation with an emulated GEMM on any device (tests, CPU).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator

import torch
from torch import nn

from moe.config import ConfigError
from moe.hardware import RECIPES as HARDWARE_RECIPES
from moe.hardware import capability_problem


@dataclasses.dataclass(frozen=True)
class PrecisionRecipe:
    name: str
    param_dtype: torch.dtype
    autocast_dtype: torch.dtype | None
    # Builds the expert GEMM that replaces every MoE layer's (None: keep the model's own).
    expert_gemm: Callable[[], object] | None = None
    # Turns a dense projection (nn.Linear) into its FP8 version in place (None: bf16).
    dense_fp8: Callable[[nn.Module], object] | None = None
    # Whether its kernels are fixed-order (train.deterministic refuses a recipe that is not).
    deterministic = True

    @property
    def master_weights(self) -> bool:
        """The optimizer steps fp32 copies when the model's own weights are lower precision."""
        return self.param_dtype != torch.float32

    def prepare(self, model: nn.Module) -> nn.Module:
        """Cast the model's floating-point parameters (buffers such as RoPE tables stay fp32)."""
        for param in model.parameters():
            if param.is_floating_point() and param.dtype != self.param_dtype:
                param.data = param.data.to(self.param_dtype)
        if self.expert_gemm is not None:
            from moe.layers.experts import GroupedExperts

            for module in model.modules():
                if isinstance(module, GroupedExperts):
                    module.gemm = self.expert_gemm()
        if self.dense_fp8 is not None:
            from moe.nn.fp8_linear import dense_linears

            for _, module in dense_linears(model):
                self.dense_fp8(module)
        return model

    def attach_optimizer(self, model: nn.Module, opt, *, broadcasts_expert_weights: bool) -> int:
        """FP8 expert GEMMs: the expert weights' bf16 copies are dropped and their FP8 copies made
        from the optimizer's fp32 masters (moe.layers.gemm_fp8.WeightCache), so the FP8 pair
        replaces the bf16 weight instead of adding to it. Not where ZeRO-1 shards the expert
        weights' optimizer over more than one rank (an owner broadcasts the bf16 parameter itself
        to its group); ZeRO-1 over one rank shards nothing. Returns how many expert weights were
        released."""
        from moe.layers.experts import GroupedExperts

        if broadcasts_expert_weights or not self.master_weights or self.expert_gemm is None:
            return 0
        released = 0
        for module in model.modules():
            cache = getattr(getattr(module, "gemm", None), "cache", None)
            if not isinstance(module, GroupedExperts) or not hasattr(cache, "read_from"):
                continue
            for param in (module.gate_up, module.down):
                if param.dtype != torch.bfloat16 or type(param) is not nn.Parameter or not param.requires_grad:
                    continue  # (a DTensor or an fp32 weight keeps its values)
                cache.read_from(param, opt.release_weight(param))
                released += 1
        return released

    @contextlib.contextmanager
    def autocast(self, device: torch.device) -> Iterator[None]:
        if self.autocast_dtype is None:
            yield
            return
        with torch.autocast(device.type, dtype=self.autocast_dtype):
            yield


RECIPES = {
    "fp32": PrecisionRecipe("fp32", torch.float32, None),
    "bf16": PrecisionRecipe("bf16", torch.bfloat16, torch.bfloat16),
    "amp_bf16": PrecisionRecipe("amp_bf16", torch.float32, torch.bfloat16),
    "fp8_rowwise": PrecisionRecipe("fp8_rowwise", torch.bfloat16, torch.bfloat16),
    "mxfp8": PrecisionRecipe("mxfp8", torch.bfloat16, torch.bfloat16),
}
# The compute capability each FP8 recipe's kernels need (moe.hardware: one table of such facts).
MIN_CAPABILITY = {name: f.min_capability for name, f in HARDWARE_RECIPES.items() if f.min_capability}


def _expert_gemm_factory(name: str, emulate: bool, min_dim: int | None) -> Callable[[], object]:
    from moe.layers.gemm_fp8 import Fp8GroupedGemm, Fp8Rule, MxFp8GroupedGemm

    if name == "mxfp8":
        return MxFp8GroupedGemm
    rule = Fp8Rule() if min_dim is None else Fp8Rule(min_dim)
    return lambda: Fp8GroupedGemm(rule, emulate=emulate)


def check_fp8_device(name: str, device: torch.device, emulate: bool = False) -> None:
    """Refuse an FP8 recipe where its kernels cannot run, before any kernel is launched
    (reads the device's properties only)."""
    need = MIN_CAPABILITY.get(name)
    if need is None or emulate:
        return
    if device.type != "cuda":
        raise ConfigError(
            f"precision.recipe: {name} needs a CUDA GPU with compute capability >= {need[0]}.{need[1]}, "
            f"but the device is {device.type} (use bf16, or precision.emulate=true for a slow emulation)"
        )
    problem = capability_problem(name, tuple(torch.cuda.get_device_capability(device)), torch.cuda.get_device_name(device))
    if problem:
        raise ConfigError(problem)


def resolve_recipe(
    name: str,
    device: torch.device,
    *,
    emulate: bool = False,
    fp8_min_dim: int | None = None,
    fp8_dense: bool = False,
    fp8_dense_min_dim: int | None = None,
) -> PrecisionRecipe:
    """``auto`` is bf16 on CUDA and fp32 on CPU. FP8 recipes are checked against the device.
    ``fp8_dense`` (fp8_rowwise only): the dense projections in FP8 too, by the same rule with
    ``fp8_dense_min_dim`` (default 4096)."""
    if name == "auto":
        name = "bf16" if device.type == "cuda" else "fp32"
    try:
        recipe = RECIPES[name]
    except KeyError:
        raise ConfigError(f"precision.recipe: unknown recipe {name!r}; known: auto, {', '.join(RECIPES)}") from None
    if name in MIN_CAPABILITY:
        check_fp8_device(name, device, emulate)
        recipe = dataclasses.replace(recipe, expert_gemm=_expert_gemm_factory(name, emulate, fp8_min_dim))
    if fp8_dense:
        if name != "fp8_rowwise":
            raise ConfigError(f"precision.fp8_dense: FP8 dense projections come with recipe fp8_rowwise, not {name}")
        recipe = dataclasses.replace(recipe, dense_fp8=_dense_fp8_factory(emulate, fp8_dense_min_dim))
    return recipe


def recipe_for(precision, device: torch.device) -> PrecisionRecipe:
    """:func:`resolve_recipe` from a ``precision`` config section (moe.config.PrecisionConfig)."""
    p = precision
    return resolve_recipe(
        p.recipe, device, emulate=p.emulate, fp8_min_dim=p.fp8_min_dim, fp8_dense=p.fp8_dense, fp8_dense_min_dim=p.fp8_dense_min_dim
    )


def _dense_fp8_factory(emulate: bool, min_dim: int | None) -> Callable[[nn.Module], object]:
    from moe.nn.fp8_linear import to_fp8
    from moe.nn.fp8_policy import DENSE_MIN_DIM, Fp8Rule

    rule = Fp8Rule(DENSE_MIN_DIM if min_dim is None else min_dim)
    return lambda module: to_fp8(module, rule, emulate)
