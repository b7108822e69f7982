"""Know the memory before you submit: per-GPU memory, FLOPs and step time of a config on N GPUs.

Exact where it can be: every rank's weight, master, gradient and AdamW bytes (moe.plan.ranks).
Calibrated where it cannot: activation bytes per token per layer (moe.plan.activations).

Peak of one rank = weights + fp32 masters + AdamW moments (each owned parameter's, ZeRO-1)
+ fp32 gradients (present while activations are when micro-batches accumulate or pipeline)
+ activations of the micro-batches in flight + the head's logits + one block recomputed in
backward + expert-parallel all-to-all buffers (+ the expert rows a paired weight gradient holds
over a micro-batch, optim.expert_wgrad=paired) + a CUDA workspace allowance. An FP8 recipe adds
its own lines (moe.plan.fp8): the bf16 expert weights it releases, its weight copies, the bf16
expert rows its GEMMs do not save and what its down projection's backward holds at once.

A config that does not fit gets the single knobs that lower its peak and the smallest GPU count
(of SCALE_OUT_GPUS) on which a data-parallel flavour fits.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from moe.config import ConfigError, ExperimentConfig, ResolvedLayout
from moe.config.model import ModelConfig
from moe.config.training import ParallelConfig
from moe.errors import PlanError
from moe.hardware import GIB, GPUS, capability_problem, recipe_on
from moe.plan.accounting import flops_per_token, param_counts
from moe.plan.activations import analytic_head_bytes, analytic_layer_bytes, fused_head_bytes, load_calibration
from moe.plan.fp8 import ExpertFp8, RankFp8, backward_bytes, saved_delta
from moe.plan.ranks import RankState, layout_mesh, rank_states

# CUDA context, cuBLAS and NCCL workspaces: not in torch's allocator statistics, but on the GPU.
WORKSPACE_GIB = 2.0
# The peak is the allocator's: a captured step's private pool holds more, and by no size rule
# found yet (one H100, bench/NOTES.md "The plan against today's runs").
GRAPH_POOL_NOTE = (
    "not counted: train.cuda_graph's private memory pool held 1.0-9.3 GiB beyond the allocator's peak on an H100 "
    "(docs/parallelism.md); keep that much of the margin"
)
# GPU counts of one host tried when a config does not fit on the GPUs asked for.
SCALE_OUT_GPUS = (2, 4, 8)


@dataclasses.dataclass
class Plan:
    gpu: str
    gpus: int
    layout: dict[str, Any]
    params_total: int
    params_active: int
    memory_gib: dict[str, float]  # the worst rank's lines
    peak_gib: float
    capacity_gib: float
    flops_per_token: float
    tokens_per_step: int
    mfu: float
    step_time_s: float
    calibration: str
    worst_rank: int
    knobs: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    # where it does not fit: the data-parallel flavours that fit on the smallest GPU count that
    # has one, lowest peak first ([]: none up to the largest count; None: not searched)
    scale_out: list[dict[str, Any]] | None = None
    # what the peak does not count for this config, measured (printed under the memory table)
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.peak_gib <= self.capacity_gib

    @property
    def margin_gib(self) -> float:
        return self.capacity_gib - self.peak_gib

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.update(fits=self.fits, margin_gib=self.margin_gib)
        return out

    def verdict(self) -> str:
        if self.fits:
            return f"fits: peak {self.peak_gib:.1f} GiB of {self.capacity_gib:.1f} GiB ({self.margin_gib:.1f} GiB to spare)"
        text = f"does not fit: peak {self.peak_gib:.1f} GiB of {self.capacity_gib:.1f} GiB ({-self.margin_gib:.1f} GiB over)"
        if self.knobs:
            best = self.knobs[0]
            text += f"; the knob that helps most: {best['set']} (-{best['saves_gib']:.1f} GiB, " + ("then fits)" if best["fits"] else "still over)")
        if self.scale_out:
            text += f"; {scale_out_text(self.scale_out[0])}"
        elif self.scale_out is not None:
            text += f"; no data-parallel flavour fits on {min(SCALE_OUT_GPUS)} to {max(SCALE_OUT_GPUS)} GPUs at these batch sizes either"
        return text


def scale_out_text(option: dict[str, Any]) -> str:
    """One scale-out option as the verdict and the report print it."""
    how = " ".join(option["set"]) or "plain data parallelism"
    return f"on {option['gpus']} GPUs it fits with {how} (peak {option['peak_gib']:.1f} GiB)"


def _in_flight(cfg: ExperimentConfig, stage: int, pp: int, n_micro: int) -> int:
    """Micro-batches whose activations a stage holds at once (1F1B: pp - stage; GPipe: all)."""
    if pp == 1:
        return 1
    if cfg.parallel.pp_schedule == "gpipe":
        return n_micro
    return max(1, min(n_micro, pp - stage))


def rank_memory(cfg: ExperimentConfig, state: RankState, resolved: ResolvedLayout, calibration: dict[str, Any]) -> dict[str, float]:
    """Bytes of one rank at its peak, line by line (GiB): the larger of the start of backward
    (every micro-batch in flight, the head's logits or a recomputed block, or an FP8 expert
    backward) and the end of backward (every gradient, one block)."""
    m = cfg.model
    mode = cfg.train.recompute
    tokens = cfg.train.micro_batch_size * cfg.data.seq_len
    layers = _stage_layer_indices(cfg, resolved, state.stage)
    blocks = _Blocks(m, calibration.get("layer_factor", {}), state.fp8.experts if state.fp8 else None)
    in_flight = _in_flight(cfg, state.stage, resolved.pp, resolved.grad_accum)
    # one block's full activations (the largest): rebuilt in its backward, or the last one alive
    largest = max(layers, key=lambda i: blocks.bf16(i, "none") + blocks.fp8(i), default=None)
    one_block, one_block_fp8 = (tokens * blocks.bf16(largest, "none"), tokens * blocks.fp8(largest)) if largest is not None else (0.0, 0.0)
    recompute = one_block + one_block_fp8 if mode != "none" and layers else 0.0
    head = tokens * _head_bytes(cfg, calibration) if state.last else 0.0
    backward = blocks.fp8_backward(tokens, layers)
    accumulating = resolved.grad_accum > 1 or resolved.pp > 1
    fp8 = state.fp8 or RankFp8(released=0, copies=0, experts=None)
    lines = {
        "weights": state.weights,
        "FP8: bf16 expert weights released": -fp8.released,
        "FP8 weight copies": fp8.copies,
        "fp32 masters": state.masters,
        "AdamW moments": state.optimizer,
        "fp32 gradients": state.grads if accumulating else 0.0,
        "activations": tokens * in_flight * sum(blocks.bf16(i, mode) for i in layers),
        "FP8: bf16 expert rows not saved": tokens * in_flight * sum(blocks.fp8(i) for i in layers) if mode == "none" else 0.0,
        # the head's logits and the first block recomputed in backward are not live together
        "head or recomputed block": max(head, recompute),
        # the FP8 down projection's backward, beyond the line above (its block's activations are in)
        "FP8 expert backward": max(0.0, recompute + backward - max(head, recompute)) if backward else 0.0,
        "EP buffers": _ep_buffers(m, resolved, tokens, layers),
        "expert rows held for the paired weight gradient": _paired_rows(cfg, resolved, tokens, layers, fp8.experts),
        "FSDP gathered blocks and gradient": _fsdp_gathered(m, resolved),
        "CUDA workspace allowance": WORKSPACE_GIB * GIB,
    }
    # End of backward: every gradient, the last block's activations (saved or recomputed) and
    # the low-precision gradient of the largest parameter before it is added to its fp32 one.
    end = {
        **lines,
        "fp32 gradients": state.grads,
        "activations": one_block,
        "FP8: bf16 expert rows not saved": one_block_fp8,
        "head or recomputed block": state.transient_grad,
        "FP8 expert backward": max(0.0, backward - state.transient_grad),
        "EP buffers": 0.0,
        "expert rows held for the paired weight gradient": 0.0,
    }
    if sum(end.values()) > sum(lines.values()):
        lines = end
    return {k: v / GIB for k, v in lines.items()}


def _head_bytes(cfg: ExperimentConfig, calibration: dict[str, Any]) -> float:
    """Bytes per token around the loss: the fused kernel's where it runs (bf16 logits on a GPU,
    train.fused_loss), else torch's loss as calibrated."""
    fused = cfg.train.fused_loss and not cfg.train.loss_chunk_tokens and cfg.precision.recipe != "fp32"
    if fused:
        return fused_head_bytes(cfg.model)
    return analytic_head_bytes(cfg.model) * calibration.get("head_factor", 1.0)


@dataclasses.dataclass(frozen=True)
class _Blocks:
    """Activation bytes per token of a model's blocks: the calibrated bf16 count and what an FP8
    expert MLP changes (moe.plan.fp8; exact sizes, so not scaled by the bf16 calibration)."""

    model: ModelConfig
    factors: dict[str, float]
    experts: ExpertFp8 | None

    def bf16(self, i: int, mode: str) -> float:
        return analytic_layer_bytes(self.model, mode, self.model.is_moe_layer(i)) * self.factors.get(mode, 1.0)

    def fp8(self, i: int) -> float:
        """Saved bytes per token FP8 adds to block ``i`` without recompute (negative: it saves
        less). The selective modes keep the GEMM outputs, which FP8 leaves as they are."""
        if self.experts is None or not self.model.is_moe_layer(i):
            return 0.0
        return saved_delta(self.model, self.experts)

    def fp8_backward(self, tokens: int, layers: list[int]) -> float:
        """Bytes one FP8 down-projection backward holds beyond its block's saved activations."""
        if self.experts is None or not any(self.model.is_moe_layer(i) for i in layers):
            return 0.0
        per_token, fixed = backward_bytes(self.model, self.experts)
        return tokens * per_token + fixed


def _paired_rows(cfg: ExperimentConfig, resolved: ResolvedLayout, tokens: int, layers: list[int], experts: ExpertFp8 | None) -> float:
    """optim.expert_wgrad=paired: while a step's last micro-batch runs, the one before it has
    left each expert weight's gradient operands in its sink (gate_up: its output's gradient
    [R, 2h] and its input rows [R, d]; down: [R, d] and [R, h]; R = tokens x top_k, bf16), every
    MoE layer. None with one micro-batch, nor for a weight whose gradient the FP8 accumulating
    GEMM takes (``sink_wgrad``; an FP8 wgrad the sink routes to the bf16 kernel holds bf16 rows
    like bf16's: OLMoE width, fp8_rowwise, 6 layers, H100: +10.50 GiB measured, gemm to paired)."""
    if cfg.optim.expert_wgrad != "paired" or resolved.grad_accum < 2:
        return 0.0
    m = cfg.model
    d, h = m.d_model, m.moe.expert_hidden
    per_row = (0 if experts and experts.up.sink_wgrad else 2 * h + d) + (0 if experts and experts.down.sink_wgrad else d + h)
    return tokens * m.moe.top_k * 2 * per_row * sum(1 for i in layers if m.is_moe_layer(i))


def _ep_buffers(m: ModelConfig, resolved: ResolvedLayout, tokens: int, layers: list[int]) -> float:
    """Expert-parallel all-to-all buffers: the send copy, the received rows and the rows in expert order."""
    if resolved.ep > 1 and any(m.is_moe_layer(i) for i in layers):
        return 3.0 * tokens * m.moe.top_k * m.d_model * 2
    return 0.0


def _fsdp_gathered(m: ModelConfig, resolved: ResolvedLayout) -> float:
    """FSDP2 (fp32 shards, no mixed-precision policy) unshards a block and prefetches the next,
    and a block's backward writes its whole fp32 gradient before the reduce-scatter frees it:
    three fp32 copies of the largest block (2x H200, paper width: predicted 88.3 GiB without the
    gradient term against 104.7 measured; bench/paper/h200x2)."""
    if resolved.data_parallel == "fsdp" and resolved.world_size > 1:
        return 3 * 4 * max(1, _largest_block_params(m))
    return 0.0


def _stage_layer_indices(cfg: ExperimentConfig, resolved: ResolvedLayout, stage: int) -> list[int]:
    from moe.parallel.pipeline import stage_indices, stage_layers

    pp, virtual = resolved.pp, resolved.virtual_stages
    if pp == 1:
        return list(range(cfg.model.n_layers))
    mesh = layout_mesh(pp, 1, 1, stage)
    return [int(k) for s in stage_indices(mesh, virtual) for k in stage_layers(cfg.model.n_layers, pp * virtual, s)]


def _largest_block_params(m: ModelConfig) -> int:
    d, kv = m.d_model, m.kv_heads * m.head_dim
    attn = 2 * d * d + 2 * d * kv
    mlp = max(
        m.moe.num_experts * 3 * d * m.moe.expert_hidden + m.moe.num_experts * d + 3 * d * m.moe.shared_hidden_total, 3 * d * (m.dense_hidden or 0)
    )
    return attn + mlp


def make_plan(cfg: ExperimentConfig, gpu: str, gpus: int, mfu: float = 0.4, knobs: bool = True, calibration: dict[str, Any] | None = None) -> Plan:
    """The plan of ``cfg`` on ``gpus`` GPUs of kind ``gpu`` (h100, h200, b200, b300)."""
    if gpu not in GPUS:
        raise PlanError(f"--gpu: unknown GPU {gpu!r}; known: {', '.join(GPUS)}")
    if gpus < 1:
        raise PlanError(f"--gpus: must be >= 1, got {gpus}")
    if not 0 < mfu <= 1:
        raise PlanError(f"--mfu: must lie in (0, 1], got {mfu}")
    spec = GPUS[gpu]
    problem = capability_problem(recipe_on(cfg.precision.recipe, gpu=True), spec.capability, spec.name)
    if problem:
        raise PlanError(f"{problem} (--gpu {gpu})")
    calibration = calibration if calibration is not None else load_calibration()
    resolved = cfg.resolve(gpus)  # once: the ranks and their memory take it
    states = rank_states(cfg, resolved)
    per_rank = [(s, rank_memory(cfg, s, resolved, calibration)) for s in states]
    worst, lines = max(per_rank, key=lambda sr: (sum(sr[1].values()), -sr[0].rank))
    counts = param_counts(cfg.model)
    fpt = flops_per_token(cfg.model, cfg.data.seq_len)
    tokens = cfg.train.global_batch_size * cfg.data.seq_len
    plan = Plan(
        gpu=gpu,
        gpus=gpus,
        layout={
            "pp": resolved.pp,
            "dp": resolved.dp,
            "ep": resolved.ep,
            "grad_accum": resolved.grad_accum,
            "zero1": cfg.parallel.shard_optimizer,
            "data_parallel": resolved.data_parallel,
            "recompute": cfg.train.recompute,
            "micro_batch_size": cfg.train.micro_batch_size,
            "seq_len": cfg.data.seq_len,
        },
        params_total=counts.total,
        params_active=counts.active,
        memory_gib=lines,
        peak_gib=sum(lines.values()),
        capacity_gib=spec.memory_gib,
        flops_per_token=fpt,
        tokens_per_step=tokens,
        mfu=mfu,
        step_time_s=tokens * fpt / (gpus * spec.peak_bf16_tflops * 1e12 * mfu),
        calibration=calibration.get("source", "analytic"),
        worst_rank=worst.rank,
    )
    if cfg.train.cuda_graph:
        plan.notes.append(GRAPH_POOL_NOTE)
    if knobs and not plan.fits:
        plan.knobs = _knobs(cfg, gpu, gpus, mfu, plan.peak_gib, calibration)
        plan.scale_out = _scale_out(cfg, gpu, gpus, mfu, calibration)
    return plan


_STRONGER = {"none": "selective", "matmuls": "selective", "selective": "full"}


def _knobs(cfg: ExperimentConfig, gpu: str, gpus: int, mfu: float, peak: float, calibration) -> list[dict[str, Any]]:
    """Single changes that lower the peak, best first."""
    tr, par = cfg.train, cfg.parallel
    candidates = []
    if tr.micro_batch_size > 1:
        candidates.append(f"train.micro_batch_size={tr.micro_batch_size // 2}")
    if tr.recompute in _STRONGER:
        candidates.append(f"train.recompute={_STRONGER[tr.recompute]}")
    candidates.append(f"parallel.ep={par.ep * 2}")
    candidates.append(f"parallel.pp={par.pp * 2}")
    if not par.shard_optimizer and par.data_parallel == "ddp":
        candidates.append("parallel.shard_optimizer=true")
    if cfg.optim.expert_wgrad == "paired":
        candidates.append("optim.expert_wgrad=gemm")  # no expert rows held between micro-batches
    out = []
    for override in candidates:
        p = _plan_with(cfg, [override], gpu, gpus, mfu, calibration)
        if p is not None and p.peak_gib < peak:
            out.append({"set": override, "peak_gib": p.peak_gib, "saves_gib": peak - p.peak_gib, "fits": p.fits})
    return sorted(out, key=lambda k: -k["saves_gib"])


def _plan_with(cfg: ExperimentConfig, overrides: list[str], gpu: str, gpus: int, mfu: float, calibration: dict[str, Any]) -> Plan | None:
    """The plan of ``cfg`` changed by ``overrides`` (no knobs), or None where the config system
    or the layout refuses the change on ``gpus`` GPUs."""
    try:
        alt = type(cfg).load(cfg.to_dict(), overrides)
        return make_plan(alt, gpu, gpus, mfu, knobs=False, calibration=calibration)
    except ConfigError:  # PlanError too
        return None


def _flavours(cfg: ExperimentConfig, world: int) -> list[list[str]]:
    """Data-parallel flavours to try on ``world`` GPUs, least change first: more replicas, ZeRO-1,
    experts over every data-parallel rank (with and without ZeRO-1), FSDP. The config's own
    checks refuse what cannot run (FSDP keeps fp32 shards: not with bf16 master weights)."""
    ep = max(1, world // cfg.parallel.pp)
    settings = [
        {"dp": -1},  # the data-parallel size follows the world
        {"dp": -1, "shard_optimizer": True},
        {"dp": -1, "ep": ep},
        {"dp": -1, "ep": ep, "shard_optimizer": True},
        {"dp": -1, "data_parallel": "fsdp", "ep": 1, "pp": 1, "shard_optimizer": False},
    ]
    flavours = [tuple(_changed(cfg.parallel, s)) for s in settings]
    return [list(f) for f in dict.fromkeys(flavours)]


def _changed(parallel: ParallelConfig, settings: dict[str, Any]) -> list[str]:
    """``parallel.key=value`` overrides for the settings that differ from ``parallel``'s."""
    return [f"parallel.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in settings.items() if getattr(parallel, k) != v]


def _scale_out(cfg: ExperimentConfig, gpu: str, gpus: int, mfu: float, calibration: dict[str, Any]) -> list[dict[str, Any]]:
    """The flavours that fit on the smallest count of SCALE_OUT_GPUS above ``gpus`` that has
    one, lowest peak first; the global and micro-batch sizes stay (a count they do not divide
    is skipped)."""
    for world in (n for n in SCALE_OUT_GPUS if n > gpus):
        fits = []
        for flavour in _flavours(cfg, world):
            p = _plan_with(cfg, flavour, gpu, world, mfu, calibration)
            if p is not None and p.fits:
                fits.append({"gpus": world, "set": flavour, "peak_gib": p.peak_gib, "layout": p.layout})
        if fits:
            return sorted(fits, key=lambda f: f["peak_gib"])
    return []
