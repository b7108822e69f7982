"""Know the memory before you submit: parameter counts, per-GPU memory, FLOPs and step time.

Exact where it can be: the model is built on the meta device and the real layout code (expert
slicing, pipeline pruning, ZeRO-1 ownership) is applied to it for every rank, so weight,
master, gradient and AdamW bytes are those a real run allocates. Calibrated where it cannot:
activation bytes per token per layer come from an analytic count of what autograd keeps for
each recompute mode, scaled by factors measured on a GPU (``plan_calibration.json``, written
by ``bench/memory.py`` with the device and torch version it came from).

Peak of one rank = weights + fp32 masters + AdamW moments (each owned parameter's, ZeRO-1)
+ fp32 gradients (present while activations are when micro-batches accumulate or pipeline)
+ activations of the micro-batches in flight + the head's logits + one block recomputed in
backward + expert-parallel all-to-all buffers + a CUDA workspace allowance.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import torch

from moe.config import ConfigError, ExperimentConfig
from moe.config.model import ModelConfig
from moe.hardware import GPUS as HARDWARE_GPUS
from moe.hardware import RECIPES as RECIPE_FACTS
from moe.hardware import capability_problem, recipe_on
from moe.train.accounting import flops_per_token

GIB = 2**30
CALIBRATION = Path(__file__).with_name("plan_calibration.json")


# The GPUs a plan is for (capacity, peak, capability): one table, moe.hardware.
GPUS = HARDWARE_GPUS

# CUDA context, cuBLAS and NCCL workspaces: not in torch's allocator statistics, but on the GPU.
WORKSPACE_GIB = 2.0


class PlanError(ConfigError):
    """Bad input to the plan (unknown GPU, impossible layout)."""


# ------------------------------------------------------------------ exact: parameters and state


@dataclasses.dataclass(frozen=True)
class RankState:
    """Bytes a rank holds between steps (and its gradients), from the built model's shapes."""

    rank: int
    stage: int
    params: int
    weights: int  # the model's parameters in their storage dtype
    masters: int  # fp32 master copies (bf16 recipe; owned parameters only under ZeRO-1)
    grads: int  # fp32 gradients (every parameter of the rank; ZeRO-1 reduces to the owner after backward)
    optimizer: int  # AdamW exp_avg + exp_avg_sq (owned parameters)
    layers: int  # transformer blocks on this rank
    transient_grad: int  # the largest parameter's low-precision gradient before its fp32 accumulation
    first: bool
    last: bool


def _param_dtype(cfg: ExperimentConfig) -> tuple[torch.dtype, bool]:
    """How the recipe stores weights on a GPU, from the device-free facts (no CUDA call: a CPU
    machine plans GPU jobs)."""
    facts = RECIPE_FACTS[recipe_on(cfg.precision.recipe, gpu=True)]
    return getattr(torch, facts.param_dtype), facts.master_weights


def _meta_model(cfg: ModelConfig):
    from moe.model import Transformer

    with torch.device("meta"):
        return Transformer(cfg)


def _mesh(pp: int, dp: int, ep: int, rank: int):
    from moe.parallel.mesh import Mesh, layout_groups

    mesh = Mesh(pp=pp, dp=dp, ep=ep, rank=rank)
    for kind, groups in layout_groups(pp, dp, ep).items():
        for ranks in groups:
            if rank in ranks:
                setattr(mesh, f"{kind}_ranks", ranks)
    return mesh


def rank_states(cfg: ExperimentConfig, world: int, param_dtype: torch.dtype | None = None, master_weights: bool | None = None) -> list[RankState]:
    """Every rank's parameter and optimizer bytes (one meta model per pipeline stage)."""
    from moe.parallel.expert_parallel import apply_expert_parallel
    from moe.parallel.grad_sync import GradSync
    from moe.parallel.pipeline import prune_for_stages

    if param_dtype is None or master_weights is None:
        param_dtype, master_weights = _param_dtype(cfg)
    r = cfg.check_world(world)
    if cfg.parallel.data_parallel == "fsdp":
        if master_weights:  # as FsdpLayout.optimizer refuses it
            raise ConfigError("parallel.data_parallel=fsdp: use precision.recipe fp32 or amp_bf16 (FSDP keeps fp32 shards)")
        return _fsdp_states(cfg, world)
    virtual = cfg.parallel.pp_virtual_stages if cfg.parallel.pp_schedule == "interleaved_1f1b" and r.pp > 1 else 1
    elem = torch.empty((), dtype=param_dtype).element_size()
    out = []
    for stage in range(r.pp):
        mesh = _mesh(r.pp, r.dp, r.ep, stage * r.dp)
        model = apply_expert_parallel(_meta_model(cfg.model), mesh)
        if r.pp > 1:
            model, _ = prune_for_stages(model, mesh, virtual)
        sync = GradSync(model, mesh, cfg.parallel.shard_optimizer)
        seen, params = set(), []
        for name, p in model.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                params.append((name, p.numel(), sync.kind_of(name)))
        numel = sum(n for _, n, _ in params)
        for dp_rank in range(r.dp):
            if sync.zero:
                index = {"dense": dp_rank, "expert": dp_rank // r.ep}
                owned = sum(n for name, n, kind in params if sync.owner[name] == index[kind])
            else:
                owned = numel
            low = master_weights and param_dtype != torch.float32
            largest = max((n for _, n, _ in params), default=0)
            out.append(
                RankState(
                    rank=stage * r.dp + dp_rank,
                    stage=stage,
                    params=numel,
                    weights=numel * elem,
                    masters=owned * 4 if low else 0,
                    grads=numel * 4,
                    optimizer=owned * 8,
                    layers=len(model.layers),
                    transient_grad=largest * elem if low else 0,
                    first=model.embed is not None,
                    last=model.lm_head is not None,
                )
            )
    return out


def _fsdp_states(cfg: ExperimentConfig, world: int) -> list[RankState]:
    """FSDP2 shards every parameter's first dimension over all ranks (padded to a multiple)."""
    model = _meta_model(cfg.model)
    seen, shard = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            rows = math.ceil(p.shape[0] / world) if p.dim() else 1
            shard += rows * (p.numel() // max(1, p.shape[0] if p.dim() else 1))
    numel = shard
    return [
        RankState(
            rank=i,
            stage=0,
            params=numel,
            weights=numel * 4,
            masters=0,
            grads=numel * 4,
            optimizer=numel * 8,
            layers=cfg.model.n_layers,
            transient_grad=0,
            first=True,
            last=True,
        )
        for i in range(world)
    ]


def host_memory_gib(cfg: ExperimentConfig, processes: int) -> float:
    """A lower bound of what training on CPUs holds: every process a replica of the fp32 weights,
    their gradients and AdamW moments (16 bytes a parameter), and each layer's RoPE tables.
    Activations come on top; the point is to refuse what cannot fit before allocating it."""
    total, _ = total_params(cfg.model)
    rope = cfg.model.n_layers * 2 * cfg.model.max_seq_len * cfg.model.head_dim * 4
    return processes * (16 * total + rope) / GIB


def available_host_gib() -> float | None:
    """MemAvailable of this machine (Linux), else None."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 / GIB
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_host_memory(cfg: ExperimentConfig, processes: int) -> None:
    """Refuse a CPU run whose weights and optimizer state alone exceed the memory available."""
    need, have = host_memory_gib(cfg, processes), available_host_gib()
    if have is not None and need > have:
        raise PlanError(
            f"model: training it on the CPU needs at least {need:.1f} GiB ({processes} process(es) x fp32 weights, "
            f"gradients and AdamW moments of {total_params(cfg.model)[0] / 1e6:.1f}M parameters), but {have:.1f} GiB "
            "is available here: use a smaller model (model.preset=tiny, fewer layers) or a GPU (`moe plan --gpu h100`)"
        )


def total_params(cfg: ModelConfig) -> tuple[int, int]:
    """(total, active) parameters of the meta-built model (active: top_k of the routed experts)."""
    from moe.layers.experts import GroupedExperts

    model = _meta_model(cfg)
    seen, total, inactive = set(), 0, 0
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            total += p.numel()
            if isinstance(module, GroupedExperts):
                inactive += p.numel() * (module.num_experts - cfg.moe.top_k) // module.num_experts
    return total, total - inactive


# ------------------------------------------------------------- calibrated: activations


def _norm(dim: int, act: int = 2) -> int:
    """The fused RMSNorm (moe.kernels.rmsnorm, on CUDA) keeps only its bf16 input and one fp32
    rstd per row (the eager norm kept an fp32 copy of the input and its bf16 output: 6 * dim + 4)."""
    return act * dim + 4


def analytic_layer_bytes(m: ModelConfig, mode: str, moe_layer: bool, act: int = 2) -> float:
    """Bytes per token autograd keeps for one block (bf16 activations; counted from the ops'
    saved tensors, see moe.parallel.recompute for what each mode keeps)."""
    d, kv, h = m.d_model, m.kv_heads * m.head_dim, m.n_heads
    moe = m.moe
    k, hid, e = moe.top_k, moe.expert_hidden, moe.num_experts
    hs = moe.shared_hidden_total
    hd = m.dense_hidden or 0
    if mode == "full":
        return act * d
    if mode == "none":
        attn = _norm(d, act) + (_norm(d, act) + _norm(kv, act) if m.qk_norm else 0) + act * (d + kv) + act * kv + act * d + 4 * h + act * d
        if moe_layer:
            mlp = _norm(d, act) + 8 * e + 8 * k + 24 * k + act * k * d + 2 * act * k * hid + act * k * hid + act * k * d + 4 * k + 4 * act * hs
        else:
            mlp = _norm(d, act) + 4 * act * hd
        return attn + mlp
    attention = act * d + 4 * h  # the attention kernel's output and log-sum-exp
    experts = 4 * e + (2 * act * k * hid + act * k * d if moe_layer else 0)  # router logits, gate_up, down
    if mode == "selective":
        return act * d + attention + experts
    if mode == "matmuls":
        dense = act * (d + 2 * kv) + act * d  # q, k, v and o projections
        mlp_dense = (2 * act * hs + act * d) if moe_layer and hs else (2 * act * hd + act * d if not moe_layer else 0)
        return act * d + attention + dense + experts + mlp_dense
    raise PlanError(f"train.recompute: unknown mode {mode!r}")


def analytic_head_bytes(m: ModelConfig) -> float:
    """Bytes per token around the loss at the start of backward: fp32 log-softmax output, its
    gradient and the fp32 logits' gradient, plus the bf16 logits' gradient and the final norm."""
    return 14 * m.vocab_size + _norm(m.d_model)


def load_calibration(path: Path = CALIBRATION) -> dict[str, Any]:
    if not path.is_file():
        return {"source": "analytic (no measured table)", "layer_factor": {}, "head_factor": 1.0}
    return json.loads(path.read_text())


# ----------------------------------------------------------------------------- the plan


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


def rank_memory(cfg: ExperimentConfig, state: RankState, resolved, calibration: dict[str, Any]) -> dict[str, float]:
    """Bytes of one rank at its peak, line by line."""
    m = cfg.model
    mode = cfg.train.recompute
    tokens = cfg.train.micro_batch_size * cfg.data.seq_len
    factors = calibration.get("layer_factor", {})
    fsdp = cfg.parallel.data_parallel == "fsdp"
    layer_indices = _stage_layer_indices(cfg, resolved.pp, state.stage)
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


def _stage_layer_indices(cfg: ExperimentConfig, pp: int, stage: int) -> list[int]:
    from moe.parallel.pipeline import stage_indices, stage_layers

    if pp == 1:
        return list(range(cfg.model.n_layers))
    virtual = cfg.parallel.pp_virtual_stages if cfg.parallel.pp_schedule == "interleaved_1f1b" else 1
    mesh = _mesh(pp, 1, 1, stage)
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
    resolved = cfg.check_world(gpus)
    states = rank_states(cfg, gpus)
    per_rank = [(s, rank_memory(cfg, s, resolved, calibration)) for s in states]
    worst, lines = max(per_rank, key=lambda sr: (sum(sr[1].values()), -sr[0].rank))
    total, active = total_params(cfg.model)
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
            "data_parallel": cfg.parallel.data_parallel,
            "recompute": cfg.train.recompute,
            "micro_batch_size": cfg.train.micro_batch_size,
            "seq_len": cfg.data.seq_len,
        },
        params_total=total,
        params_active=active,
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


def count(n: int) -> str:
    """A parameter count a reader can see at any scale: 1.884 B, 12.35 M, 98.3 K."""
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.4g} {unit}"
    return str(n)


def format_plan(plan: Plan) -> str:
    lay = plan.layout
    lines = [
        f"plan: {plan.gpus} x {GPUS[plan.gpu].name}; pp={lay['pp']} dp={lay['dp']} ep={lay['ep']} "
        f"zero1={str(lay['zero1']).lower()} {lay['data_parallel']}; micro-batch {lay['micro_batch_size']} x {lay['seq_len']} tokens, "
        f"{lay['grad_accum']} per step; recompute={lay['recompute']}",
        f"parameters: {count(plan.params_total)} total, {count(plan.params_active)} active",
        f"memory of rank {plan.worst_rank} (GiB; activations from {plan.calibration}):",
    ]
    width = max(len(k) for k in plan.memory_gib)
    for k, v in plan.memory_gib.items():
        lines.append(f"  {k.ljust(width)}  {v:8.2f}")
    lines.append(f"  {'peak'.ljust(width)}  {plan.peak_gib:8.2f}   of {plan.capacity_gib:.1f}")
    lines.append(
        f"FLOPs/token {plan.flops_per_token / 1e9:.4g} G; {plan.tokens_per_step} tokens/step; "
        f"predicted step {plan.step_time_s:.3g} s at {plan.mfu:.0%} MFU "
        f"({GPUS[plan.gpu].peak_bf16_tflops:.0f} TFLOP/s dense bf16 per GPU)"
    )
    lines.append(f"verdict: {plan.verdict()}")
    for k in plan.knobs[1:4]:
        lines.append(f"  also: {k['set']} (-{k['saves_gib']:.1f} GiB{', fits' if k['fits'] else ''})")
    return "\n".join(lines)
