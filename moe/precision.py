"""Precision recipes (a seam: FP8 / MXFP8 recipes plug in here).

A recipe says how weights are stored, whether the optimizer keeps fp32 master copies, which
autocast context wraps forward and backward, and which expert GEMM the MoE layers are built with
(``PrecisionRecipe.expert_gemm``, given to the model at build: moe.model.Transformer). Its facts
come from one table, moe.hardware.RECIPES. The optimizer and the expert weights meet once, in
:meth:`PrecisionRecipe.attach_optimizer`. Router logits and the loss are computed in fp32 by the
model and trainer whatever the recipe.

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

from moe.config import ConfigError, ExperimentConfig
from moe.hardware import RECIPES as RECIPE_FACTS
from moe.hardware import capability_problem


@dataclasses.dataclass(frozen=True)
class PrecisionRecipe:
    name: str
    param_dtype: torch.dtype
    autocast_dtype: torch.dtype | None
    # Builds each MoE layer's expert GEMM (moe.model.Transformer's expert_gemm; None: the
    # model's default, torch's grouped GEMM). resolve_recipe sets it for every recipe.
    expert_gemm: Callable[[], object] | None = None
    # Turns a dense projection (nn.Linear) into its FP8 version in place (None: bf16).
    dense_fp8: Callable[[nn.Module], object] | None = None
    # Whether its kernels are fixed-order (train.deterministic refuses a recipe that is not).
    deterministic = True

    @property
    def master_weights(self) -> bool:
        """The optimizer steps fp32 copies when the model's own weights are lower precision."""
        return self.param_dtype != torch.float32

    @property
    def fp8(self) -> bool:
        """Whether its expert GEMMs run in FP8 or MXFP8 (moe.hardware.RecipeFacts.fp8)."""
        return RECIPE_FACTS[self.name].fp8

    def prepare(self, model: nn.Module) -> nn.Module:
        """Cast the model's floating-point parameters (buffers such as RoPE tables stay fp32).
        The expert GEMMs were chosen when the model was built (``Transformer(cfg,
        expert_gemm=recipe.expert_gemm)``): a model built with another recipe's is refused."""
        self._check_expert_gemms(model)
        for param in model.parameters():
            if param.is_floating_point() and param.dtype != self.param_dtype:
                param.data = param.data.to(self.param_dtype)
        if self.dense_fp8 is not None:
            from moe.nn.fp8_linear import dense_linears

            for _, module in dense_linears(model):
                self.dense_fp8(module)
        return model

    def _check_expert_gemms(self, model: nn.Module) -> None:
        from moe.layers.experts import GroupedExperts

        want = type(self.expert_gemm()) if self.expert_gemm is not None else None
        for name, module in model.named_modules():
            if want is not None and isinstance(module, GroupedExperts) and type(module.gemm) is not want:
                raise ValueError(
                    f"{name}.gemm is {type(module.gemm).__name__}, but precision.recipe {self.name} builds {want.__name__}: "
                    "build the model with Transformer(cfg, expert_gemm=recipe.expert_gemm)"
                )

    def attach_optimizer(self, model: nn.Module, opt, *, broadcasts_expert_weights: bool, expert_rows: int | None = None) -> int:
        """Where the expert weights and the optimizer meet, once: every expert weight is declared
        to the optimizer (``opt.bind_expert``: bf16 gradient accumulation, and the gradient sink
        its weight-gradient GEMM adds into) and bound to its expert GEMM (ExpertGemm.bind) with
        that sink and, where the GEMM ``reads_masters`` (FP8), the fp32 master: the weight's
        bf16 values are dropped (``opt.release_weight``) and its FP8 copies made from the master
        (moe.layers.gemm_fp8.WeightCache), so the FP8 pair replaces the bf16 weight instead of
        adding to it. No release where ZeRO-1 shards the expert weights' optimizer over more than
        one rank (an owner broadcasts the bf16 parameter itself to its group); ZeRO-1 over one
        rank shards nothing. ``expert_rows`` (the rows a micro-batch sends to the experts,
        tokens x top-k; the trainer's and the planner's): a layer whose FP8 rule runs none of
        its expert GEMMs in FP8 at that many rows runs the bf16 GEMM instead
        (:meth:`keep_bf16_where_fp8_does_not_run`). Returns how many expert weights were released."""
        from moe.layers.experts import GroupedExperts

        self._check_expert_gemms(model)
        if expert_rows is not None:
            self.keep_bf16_where_fp8_does_not_run(model, expert_rows)
        release = not broadcasts_expert_weights and self.master_weights
        released = 0
        for module in model.modules():
            if not isinstance(module, GroupedExperts):
                continue
            for param in (module.gate_up, module.down):
                master = None
                # (a DTensor or an fp32 weight keeps its values)
                if release and module.gemm.reads_masters and param.dtype == torch.bfloat16 and type(param) is nn.Parameter and param.requires_grad:
                    master = opt.release_weight(param)
                    released += 1
                module.gemm.bind(param, sink=opt.bind_expert(param), master=master)
        return released

    @staticmethod
    def keep_bf16_where_fp8_does_not_run(model: nn.Module, expert_rows: int) -> int:
        """Give each MoE layer whose FP8 rule keeps every expert GEMM in bf16 at ``expert_rows``
        rows per micro-batch the bf16 recipe's expert GEMM (torch's grouped GEMM on bf16 weights).
        Its FP8 GEMM would run the same bf16 GEMMs on copies made from the masters, off the bf16
        path's fusions: at d = h = 1024, 2,048 rows per expert (which the rule keeps bf16), the
        fp8_rowwise step was 3.1% slower than bf16 on an H100 (bench/NOTES.md, 2026-12-07).
        Returns how many layers changed."""
        from moe.layers.experts import GroupedExperts
        from moe.layers.gemm import GroupedMM
        from moe.layers.gemm_fp8 import Fp8GroupedGemm

        changed = 0
        for module in model.modules():
            gemm = getattr(module, "gemm", None)
            if not isinstance(module, GroupedExperts) or not isinstance(gemm, Fp8GroupedGemm):
                continue
            up = gemm.rule.plan(expert_rows, *module.gate_up.shape)
            down = gemm.rule.plan_down(expert_rows, *module.down.shape)
            if not (up.any or down.any):
                module.gemm = GroupedMM()
                changed += 1
        return changed

    @contextlib.contextmanager
    def autocast(self, device: torch.device) -> Iterator[None]:
        if self.autocast_dtype is None:
            yield
            return
        with torch.autocast(device.type, dtype=self.autocast_dtype):
            yield


# Every recipe, from the one table of recipe facts (moe.hardware.RECIPES).
RECIPES = {
    name: PrecisionRecipe(name, getattr(torch, f.param_dtype), getattr(torch, f.autocast_dtype) if f.autocast_dtype else None)
    for name, f in RECIPE_FACTS.items()
}


def expert_rows(cfg: ExperimentConfig) -> int:
    """The rows a training micro-batch sends to the experts (tokens x top-k), which the FP8 rule
    decides by (:meth:`PrecisionRecipe.keep_bf16_where_fp8_does_not_run`)."""
    return cfg.train.micro_batch_size * cfg.data.seq_len * cfg.model.moe.top_k


def _expert_gemm_factory(name: str, emulate: bool, rule_fields: dict[str, int]) -> Callable[[], object]:
    """What builds each MoE layer's expert GEMM under recipe ``name`` (RecipeFacts.expert_gemm);
    ``rule_fields``: the FP8 rule's fields the config sets (the rest keep Fp8Rule's defaults)."""
    kind = RECIPE_FACTS[name].expert_gemm
    if kind == "grouped_mm":
        from moe.layers.gemm import GroupedMM

        return GroupedMM
    from moe.layers.gemm_fp8 import Fp8GroupedGemm, Fp8Rule, MxFp8GroupedGemm

    if kind == "mxfp8":
        return MxFp8GroupedGemm
    rule = Fp8Rule(**rule_fields)
    return lambda: Fp8GroupedGemm(rule, emulate=emulate)


def check_fp8_device(name: str, device: torch.device, emulate: bool = False) -> None:
    """Refuse an FP8 recipe where its kernels cannot run, before any kernel is launched
    (reads the device's properties only)."""
    need = RECIPE_FACTS[name].min_capability if name in RECIPE_FACTS else None
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
    fp8_sink_wgrad_min_dim: int | None = None,
    fp8_dense: bool = False,
    fp8_dense_min_dim: int | None = None,
) -> PrecisionRecipe:
    """``auto`` is bf16 on CUDA and fp32 on CPU. FP8 recipes are checked against the device.
    ``fp8_min_dim``, ``fp8_sink_wgrad_min_dim``: the expert GEMMs' Fp8Rule fields (None: its
    defaults). ``fp8_dense`` (fp8_rowwise only): the dense projections in FP8 too, by the same
    rule with ``fp8_dense_min_dim`` (default 4096)."""
    if name == "auto":
        name = "bf16" if device.type == "cuda" else "fp32"
    try:
        recipe = RECIPES[name]
    except KeyError:
        raise ConfigError(f"precision.recipe: unknown recipe {name!r}; known: auto, {', '.join(RECIPES)}") from None
    if RECIPE_FACTS[name].fp8:
        check_fp8_device(name, device, emulate)
    rule_fields = {k: v for k, v in (("min_dim", fp8_min_dim), ("sink_wgrad_min_dim", fp8_sink_wgrad_min_dim)) if v is not None}
    recipe = dataclasses.replace(recipe, expert_gemm=_expert_gemm_factory(name, emulate, rule_fields))
    if fp8_dense:
        if name != "fp8_rowwise":
            raise ConfigError(f"precision.fp8_dense: FP8 dense projections come with recipe fp8_rowwise, not {name}")
        recipe = dataclasses.replace(recipe, dense_fp8=_dense_fp8_factory(emulate, fp8_dense_min_dim))
    return recipe


def recipe_for(precision, device: torch.device) -> PrecisionRecipe:
    """:func:`resolve_recipe` from a ``precision`` config section (moe.config.PrecisionConfig)."""
    p = precision
    return resolve_recipe(
        p.recipe,
        device,
        emulate=p.emulate,
        fp8_min_dim=p.fp8_min_dim,
        fp8_sink_wgrad_min_dim=p.fp8_sink_wgrad_min_dim,
        fp8_dense=p.fp8_dense,
        fp8_dense_min_dim=p.fp8_dense_min_dim,
    )


def _dense_fp8_factory(emulate: bool, min_dim: int | None) -> Callable[[nn.Module], object]:
    from moe.nn.fp8_linear import to_fp8
    from moe.nn.fp8_policy import DENSE_MIN_DIM, Fp8Rule

    rule = Fp8Rule(DENSE_MIN_DIM if min_dim is None else min_dim)
    return lambda module: to_fp8(module, rule, emulate)
