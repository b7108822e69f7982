"""Know the memory before you submit: per-GPU memory, FLOPs and step time of a config on N GPUs.

Exact where it can be: every rank's weight, master, gradient and AdamW bytes (moe.plan.ranks).
Calibrated where it cannot: activation bytes per token per layer (moe.plan.activations).

Peak of one rank = weights + fp32 masters + AdamW moments (each owned parameter's, ZeRO-1)
+ fp32 gradients (present while activations are when micro-batches accumulate or pipeline)
+ activations of the micro-batches in flight + the head's logits + one block recomputed in
backward + expert-parallel all-to-all buffers + a CUDA workspace allowance.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from moe.config import ConfigError, ExperimentConfig, ResolvedLayout
from moe.config.model import ModelConfig
from moe.errors import PlanError
from moe.hardware import GIB, GPUS, capability_problem, recipe_on
from moe.plan.accounting import flops_per_token, param_counts
from moe.plan.activations import analytic_head_bytes, analytic_layer_bytes, load_calibration
from moe.plan.ranks import RankState, layout_mesh, rank_states

# CUDA context, cuBLAS and NCCL workspaces: not in torch's allocator statistics, but on the GPU.
WORKSPACE_GIB = 2.0


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
        return text


def _in_flight(cfg: ExperimentConfig, stage: int, pp: int, n_micro: int) -> int:
    """Micro-batches whose activations a stage holds at once (1F1B: pp - stage; GPipe: all)."""
    if pp == 1:
        return 1
    if cfg.parallel.pp_schedule == "gpipe":
        return n_micro
    return max(1, min(n_micro, pp - stage))


def rank_memory(cfg: ExperimentConfig, state: RankState, resolved: ResolvedLayout, calibration: dict[str, Any]) -> dict[str, float]:
    """Bytes of one rank at its peak, line by line."""
    m = cfg.model
    mode = cfg.train.recompute
    tokens = cfg.train.micro_batch_size * cfg.data.seq_len
    factors = calibration.get("layer_factor", {})
    fsdp = resolved.data_parallel == "fsdp"
    layer_indices = _stage_layer_indices(cfg, resolved, state.stage)
    per_layer = [analytic_layer_bytes(m, mode, m.is_moe_layer(i)) * factors.get(mode, 1.0) for i in layer_indices]
    in_flight = _in_flight(cfg, state.stage, resolved.pp, resolved.grad_accum)
    acts = tokens * sum(per_layer) * in_flight
    recompute = 0.0
    if mode != "none" and layer_indices:  # one block's full activations rebuilt during its backward
        recompute = tokens * max(analytic_layer_bytes(m, "none", m.is_moe_layer(i)) * factors.get("none", 1.0) for i in layer_indices)
    head = tokens * analytic_head_bytes(m) * calibration.get("head_factor", 1.0) if state.last else 0.0
    ep_buffers = 0.0
    if resolved.ep > 1 and any(m.is_moe_layer(i) for i in layer_indices):
        ep_buffers = 3.0 * tokens * m.moe.top_k * m.d_model * 2  # send copy, receive, expert-ordered rows
    accumulating = resolved.grad_accum > 1 or resolved.pp > 1
    gathered = 0.0
    if fsdp and resolved.world_size > 1:
        # FSDP2 (fp32 shards, no mixed-precision policy) unshards a block and prefetches the
        # next, and a block's backward writes its whole fp32 gradient before the reduce-scatter
        # frees it: three fp32 copies of the largest block (2x H200, paper width: predicted
        # 88.3 GiB without the gradient term against 104.7 measured; bench/paper/h200x2).
        gathered = 3 * 4 * max(1, _largest_block_params(m))
    one_block = tokens * max((analytic_layer_bytes(m, "none", m.is_moe_layer(i)) * factors.get("none", 1.0) for i in layer_indices), default=0.0)
    lines = {
        "weights": state.weights,
        "fp32 masters": state.masters,
        "AdamW moments": state.optimizer,
        "fp32 gradients": state.grads if accumulating else 0.0,
        "activations": acts,
        # the head's logits and the first block recomputed in backward are not live together
        "head or recomputed block": max(head, recompute),
        "EP buffers": ep_buffers,
        "FSDP gathered blocks and gradient": gathered,
        "CUDA workspace allowance": WORKSPACE_GIB * GIB,
    }
    # End of backward: every gradient, the last block's activations (saved or recomputed) and
    # the low-precision gradient of the largest parameter before it is added to its fp32 one.
    end = {**lines, "fp32 gradients": state.grads, "activations": one_block, "head or recomputed block": state.transient_grad, "EP buffers": 0.0}
    if sum(end.values()) > sum(lines.values()):
        lines = end
    return {k: v / GIB for k, v in lines.items()}


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
    if knobs and not plan.fits:
        plan.knobs = _knobs(cfg, gpu, gpus, mfu, plan.peak_gib, calibration)
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
    out = []
    for override in candidates:
        try:
            alt = type(cfg).load(cfg.to_dict(), [override])
            p = make_plan(alt, gpu, gpus, mfu, knobs=False, calibration=calibration)
        except ConfigError:
            continue
        if p.peak_gib < peak:
            out.append({"set": override, "peak_gib": p.peak_gib, "saves_gib": peak - p.peak_gib, "fits": p.fits})
    return sorted(out, key=lambda k: -k["saves_gib"])
