"""What an FP8 recipe changes in a rank's memory, read from the code that runs it.

The per-GEMM choice is the trainer's own: the recipe is resolved by ``moe.precision.recipe_for``,
the rank's meta model is built with its expert GEMM (holding its ``Fp8Rule``) and prepared
(``PrecisionRecipe.prepare``: the FP8 dense projections, holding theirs), the weights it releases are those
``PrecisionRecipe.attach_optimizer`` picks, and each GEMM's ``Fp8Gemms`` is asked of its module's rule
with the mean rows it will see (a micro-batch's tokens x top_k over the rank's experts).

- Weights (moe.nn.fp8_policy.WeightCache): where nothing broadcasts the bf16 expert weights
  (ZeRO-1 over one expert rank, or none), their bf16 values are released and their copies made
  from the fp32 masters: a rowwise e4m3 copy (fp32 scale per row) for an FP8 forward, a
  columnwise one for an FP8 dgrad, and a bf16 copy for whichever of the two stays bf16. The
  copies live between steps (one per weight version). FP8 dense projections keep their bf16
  weight and add their copies.
- Saved activations (moe.layers.gemm_fp8): the up projection reading token rows
  (``_Fp8GatheredLinear``) saves the tokens the router already saves, not their k bf16 copies in
  expert order; the down projection through an FP8 Function recomputes SwiGLU's output in
  backward instead of saving it. Both save int64 indices instead.
- Backward: the FP8 down projection's backward holds the recomputed SwiGLU output, its
  gradient and the gate/up gradient at once (bf16 frees them node by node), with the FP8 token
  gradients and, where wgrad is not FP8 into the gradient sink, the weighted rows in bf16. This,
  not the loss, was the FP8 step's peak by allocation site on one H200 for both FP8 runs of
  bench/results/train_memory (olmoe: 3.5 GiB of it; paper: 2.25 GiB; issue 49).

``mxfp8`` runs MX fake quantisation with bf16 weights and bf16 saved operands: planned as bf16.
The quantisation chunks made while a copy is refreshed (``WeightCache.CHUNK_ELEMENTS``, about
0.2 GiB, once per weight per step) are not counted.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from moe.config import ExperimentConfig
from moe.config.model import ModelConfig
from moe.hardware import recipe_on
from moe.nn.fp8_policy import Fp8Gemms
from moe.precision import PrecisionRecipe, expert_rows, recipe_for

if TYPE_CHECKING:
    from moe.layers.experts import GroupedExperts

INDEX = 8  # bytes of an int64 index
SCALE = 4  # bytes of an fp32 scale


@dataclasses.dataclass(frozen=True)
class ExpertFp8:
    """How one MoE layer's expert MLP runs on a rank under fp8_rowwise (moe.layers.gemm_fp8)."""

    up: Fp8Gemms  # gate_up's forward, dgrad and wgrad
    down: Fp8Gemms  # down's (Fp8Rule.plan_down: it follows the up projection)
    released: bool  # bf16 weights dropped: copies come from the fp32 masters
    token_rows: bool  # local dispatcher: the GEMMs read token rows through the permutation
    sink: bool  # the optimizer's gradient sink takes the weight gradients (sink_takes_expert_grads)
    down_params: int  # elements of the down weight on this rank

    @property
    def gathered_up(self) -> bool:
        """The up projection gathers FP8 token rows itself (_Fp8GatheredLinear)."""
        return self.token_rows and (self.up.fwd or self.up.wgrad)

    @property
    def combined_down(self) -> bool:
        """The down projection and the weighted combine share one backward (_Fp8SwiGLULinearCombine)."""
        return self.token_rows and (self.down.dgrad or self.down.wgrad)

    @property
    def fp8_down(self) -> bool:
        """The down projection runs through an FP8 Function (combined, or _Fp8SwiGLULinear: any
        FP8 GEMM, or a released weight read through the cache)."""
        return self.combined_down or self.down.any or self.released


@dataclasses.dataclass(frozen=True)
class RankFp8:
    """What an FP8 recipe changes on one rank, in bytes (and how its MoE layers run)."""

    released: int  # bf16 expert weights the optimizer drops
    copies: int  # WeightCache copies: FP8 rows/columns with scales, bf16 copies made from masters
    experts: ExpertFp8 | None  # every MoE layer of the rank runs alike; None: no FP8 expert GEMM


class _ReleaseLog:
    """Stands in for the optimizer in PrecisionRecipe.attach_optimizer, so the recipe itself
    says which weights it releases: records them and hands each back as its own master (same
    shape, nothing allocated on the meta device)."""

    def __init__(self) -> None:
        self.params: list[nn.Parameter] = []

    def release_weight(self, param: nn.Parameter) -> torch.Tensor:
        self.params.append(param)
        return param

    def bind_expert(self, param: nn.Parameter) -> None:
        return None  # no gradient sink: nothing here runs a backward


def planning_recipe(cfg: ExperimentConfig) -> PrecisionRecipe:
    """The recipe a GPU run of ``cfg`` uses, resolved without a GPU (``emulate`` skips only the
    device check; the planner checks the planned GPU's capability itself)."""
    precision = dataclasses.replace(cfg.precision, recipe=recipe_on(cfg.precision.recipe, gpu=True), emulate=True)
    return recipe_for(precision, torch.device("cpu"))


def rank_fp8(model: nn.Module, cfg: ExperimentConfig, broadcasts_expert_weights: bool) -> RankFp8 | None:
    """The FP8 terms of the rank whose meta model (expert slice, pipeline stage) is ``model``;
    None for a recipe without FP8 GEMMs. Prepares ``model`` in place as the trainer does."""
    from moe.layers.experts import GroupedExperts
    from moe.layers.gemm_fp8 import Fp8GroupedGemm

    recipe = planning_recipe(cfg)
    if not recipe.fp8 and recipe.dense_fp8 is None:
        return None
    recipe.prepare(model)
    log = _ReleaseLog()
    recipe.attach_optimizer(model, log, broadcasts_expert_weights=broadcasts_expert_weights, expert_rows=expert_rows(cfg))
    released = {id(p) for p in log.params}
    tokens = cfg.train.micro_batch_size * cfg.data.seq_len
    experts, copies = None, _dense_copies(model, tokens)
    sink = sink_takes_expert_grads(cfg)
    for layer in model.modules():
        module = getattr(layer, "experts", None)
        if not isinstance(module, GroupedExperts) or not isinstance(module.gemm, Fp8GroupedGemm):
            continue
        experts = _expert_fp8(layer, module, expert_rows(cfg), id(module.gate_up) in released, sink)
        copies += weight_copy_bytes(tuple(module.gate_up.shape), experts.up, experts.released)
        copies += weight_copy_bytes(tuple(module.down.shape), experts.down, experts.released)
    return RankFp8(released=sum(2 * p.numel() for p in log.params), copies=copies, experts=experts)


def sink_takes_expert_grads(cfg: ExperimentConfig) -> bool:
    """The optimizer's gradient sink adds an expert weight's gradient into its fp32 gradient
    inside the GEMM (optim.expert_wgrad gemm or paired, 16-byte-aligned rows): no bf16 gradient of
    that weight ever exists. The same test for both recipes: an FP8 wgrad the FP8 kernel does not
    take goes to the bf16 accumulating GEMM by the same alignment rule (moe.layers.gemm.sink_route).
    Paper width, one layer, H100: the 4 GiB bf16 gradient of the experts' gate_up weight was
    planned, 1.6 GiB over the measured peak (bench/NOTES.md)."""
    m = cfg.model
    return cfg.optim.expert_wgrad != "separate" and m.d_model % 8 == 0 and m.moe.expert_hidden % 8 == 0


def _expert_fp8(layer: nn.Module, module: GroupedExperts, rows: int, released: bool, sink: bool) -> ExpertFp8:
    """The rule's plans for the expert weights of ``layer`` (a MoELayer), as
    Fp8GroupedGemm.expert_mlp and swiglu_linear ask for them: ``rows`` expert-ordered rows (the
    mean a rank receives under expert parallelism too) over the local experts."""
    from moe.layers.dispatch import LocalDispatcher

    rule = module.gemm.rule
    return ExpertFp8(
        up=rule.plan(rows, *module.gate_up.shape),
        down=rule.plan_down(rows, *module.down.shape),
        released=released,
        token_rows=module.reads_token_rows and type(layer.dispatcher) is LocalDispatcher,
        sink=sink,
        down_params=module.down.numel(),
    )


def _dense_copies(model: nn.Module, tokens: int) -> int:
    """FP8 copies of the dense projections (precision.fp8_dense): each Fp8Linear's plan as its
    forward builds it from its rule and the micro-batch's tokens; the bf16 weight stays."""
    from moe.nn.fp8_linear import Fp8Linear, dense_linears

    out = 0
    for _, module in dense_linears(model):
        if isinstance(module, Fp8Linear):
            n, k = module.weight.shape
            rule = module.rule
            plan = Fp8Gemms(fwd=rule.use(tokens, n, k), dgrad=rule.use(tokens, k, n), wgrad=rule.use(tokens, n, k))
            out += weight_copy_bytes((n, k), plan, released=False)
    return out


def weight_copy_bytes(shape: tuple[int, ...], plan: Fp8Gemms, released: bool) -> int:
    """WeightCache's copies of one weight [G, M, K] (or [M, K]): rowwise e4m3 with a scale per
    row for an FP8 forward, columnwise with a scale per column for an FP8 dgrad, and, for a
    released weight, a bf16 copy from its master for whichever of the two stays bf16."""
    *lead, m, k = shape
    groups = math.prod(lead)
    n = groups * m * k
    out = 0
    if plan.fwd:
        out += n + SCALE * groups * m
    if plan.dgrad:
        out += n + SCALE * groups * k
    if released and not (plan.fwd and plan.dgrad):
        out += 2 * n
    return out


def saved_delta(m: ModelConfig, e: ExpertFp8, act: int = 2) -> float:
    """Bytes per token by which one MoE layer's saved activations differ from the bf16 count
    (moe.plan.activations.analytic_layer_bytes keeps the k gathered rows and SwiGLU's output)."""
    k, d, hid = m.moe.top_k, m.d_model, m.moe.expert_hidden
    delta = 0.0
    if e.gathered_up:  # saves the token rows (shared with the router) and the row index
        delta += INDEX * k - act * k * d
    if e.fp8_down:  # SwiGLU's output is recomputed in backward
        delta -= act * k * hid
    if e.combined_down:  # saves the expert order too
        delta += INDEX * k
    return delta


def backward_bytes(m: ModelConfig, e: ExpertFp8, act: int = 2) -> tuple[float, int]:
    """(bytes per token, bytes) live in one MoE layer's FP8 down-projection backward when it
    computes SwiGLU's gradient, beyond the layer's saved activations: the recomputed SwiGLU
    output, its gradient and the gate/up gradient, plus what the path holds alongside."""
    if not e.fp8_down:
        return 0.0, 0
    k, d, hid = m.moe.top_k, m.d_model, m.moe.expert_hidden
    per_token = 4 * act * k * hid  # a and its gradient [N, H], the gate/up gradient [N, 2H]
    fixed = 0 if e.sink else act * e.down_params  # the bf16 weight gradient it returns
    if not e.combined_down:
        return per_token + act * k * d, fixed  # with the incoming gradient rows [N, D]
    per_token += INDEX * k + SCALE * k  # row index and routing weight of each expert-ordered row
    fp8_sink = e.sink and e.down.sink_wgrad
    if not (e.down.dgrad and e.down.wgrad) or (e.sink and not fp8_sink):
        per_token += act * k * d  # the weighted gradient rows in bf16 (combine_backward)
    if e.down.dgrad:
        per_token += k * d + SCALE * k  # the gathered FP8 token gradients and their scales
    if not e.sink and e.down.wgrad:
        per_token += k * d + k * hid  # wgrad's FP8 column operands, kept until it returns
    return per_token, fixed
