"""Optimizer, schedule, data, training-loop, checkpoint, layout and precision configs."""

from __future__ import annotations

import dataclasses
from typing import Literal

from moe.config.base import Config, require
from moe.config.in_loop_eval import InLoopEvalConfig
from moe.config.load_alarm import LoadAlarmConfig
from moe.config.router_health import RouterHealthConfig


def _k(p: str, name: str) -> str:
    return f"{p}.{name}" if p else name


@dataclasses.dataclass
class OptimizerConfig(Config):
    """AdamW. Norm weights, biases and embeddings get no weight decay."""

    lr: float = 3e-4
    betas: list[float] = dataclasses.field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    decay_embeddings: bool = False
    # Where the expert weights' gradient accumulates over micro-batches when the weights are
    # bf16 with fp32 masters. fp32: every micro-batch's gradient is added into the fp32 master
    # gradient (12 bytes of traffic per expert parameter per micro-batch). bf16: it accumulates
    # in the parameter's own bf16 gradient, as Olmo-core 3's experts do, and reaches the fp32
    # master once per step (8 bytes): this traffic grows with the number of experts at a fixed
    # number of tokens (issue 29). Dense weights always accumulate in fp32.
    expert_grad_accum: Literal["fp32", "bf16"] = "fp32"
    # How that accumulation is done on CUDA. gemm: inside the expert weight-gradient GEMM, whose
    # epilogue adds into the accumulator (moe/kernels/grouped_wgrad.py; 1.2-1.3x the separate
    # path's time for the weight gradient at OLMoE width and at 128 experts on an H200, and the
    # fp32 sum no longer rounds each micro-batch's gradient to bf16 first: bench/NOTES.md).
    # separate: torch's grouped GEMM writes the gradient and a second pass adds it (the
    # reference, and the path everywhere the kernel does not run: CPU, fp32 weights).
    # paired: as gemm, with one GEMM per two micro-batches (the first's rows wait for the
    # second's backward), so the accumulator is read and written half as often: 12 instead of
    # 28 bytes per expert parameter per step at accum 4, for one micro-batch's expert rows held
    # (both weights' operands, every MoE layer: moe plan counts them). bench/NOTES.md has both.
    expert_wgrad: Literal["gemm", "separate", "paired"] = "gemm"
    # The step's kernel on CUDA. triton: one pass per tensor steps the fp32 master and writes
    # its bf16 copy (30 bytes per parameter; moe/kernels/adamw.py). torch: torch's fused AdamW,
    # then a copy into the bf16 parameters (38 bytes), and the path wherever Triton does not run.
    step_kernel: Literal["triton", "torch"] = "triton"

    def _check(self, p: str) -> None:
        require(self.lr > 0, _k(p, "lr"), f"must be > 0, got {self.lr}")
        require(len(self.betas) == 2, _k(p, "betas"), f"must have two values, got {self.betas}")
        require(all(0 <= b < 1 for b in self.betas), _k(p, "betas"), f"must lie in [0, 1), got {self.betas}")
        require(self.eps > 0, _k(p, "eps"), "must be > 0")
        require(self.weight_decay >= 0, _k(p, "weight_decay"), "must be >= 0")
        require(self.expert_grad_accum in ("fp32", "bf16"), _k(p, "expert_grad_accum"), f"must be fp32 or bf16, got {self.expert_grad_accum!r}")
        require(
            self.expert_wgrad in ("gemm", "separate", "paired"), _k(p, "expert_wgrad"), f"must be gemm, separate or paired, got {self.expert_wgrad!r}"
        )
        require(self.step_kernel in ("triton", "torch"), _k(p, "step_kernel"), f"must be triton or torch, got {self.step_kernel!r}")


# Numbers no run means (2**63 steps trained "without end" at a constant lr): refused with the limit.
MAX_STEPS = 10**9
MAX_BATCH = 2**24


@dataclasses.dataclass
class ScheduleConfig(Config):
    """Linear warmup, then cosine or linear decay to ``min_lr_ratio * lr`` at the last step."""

    warmup_steps: int = 10
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr_ratio: float = 0.1

    def _check(self, p: str) -> None:
        require(self.warmup_steps >= 0, _k(p, "warmup_steps"), "must be >= 0")
        require(self.warmup_steps <= MAX_STEPS, _k(p, "warmup_steps"), f"{self.warmup_steps} is beyond any real run (at most {MAX_STEPS})")
        require(0 <= self.min_lr_ratio <= 1, _k(p, "min_lr_ratio"), "must lie in [0, 1]")


@dataclasses.dataclass
class DataConfig(Config):
    """Token files in the OLMo-core layout (see moe.data.tokens)."""

    # Token files, directories of them, or globs; each needs its JSON sidecar.
    paths: list[str] = dataclasses.field(default_factory=list)
    seq_len: int = 128
    # Seed of the global shuffle of sequences (a new permutation every epoch).
    seed: int = 0
    # sha256 of the tokenizer file the data must have been made with (null: don't check).
    tokenizer_hash: str | None = None
    # Recompute each file's sha256 against its sidecar when opening it.
    verify_checksums: bool = True

    def _check(self, p: str) -> None:
        require(self.seq_len >= 1, _k(p, "seq_len"), f"must be >= 1, got {self.seq_len}")
        require(0 <= self.seed < 2**63, _k(p, "seed"), f"must be >= 0 (and < 2**63), got {self.seed}")


@dataclasses.dataclass
class TrainConfig(Config):
    """The training loop."""

    # Sequences per optimizer step over all data-parallel ranks.
    global_batch_size: int = 8
    # Sequences per forward/backward on one rank; the rest is gradient accumulation.
    micro_batch_size: int = 8
    max_steps: int = 100
    seed: int = 0
    # Clip the global gradient norm to this value (null: no clipping).
    grad_clip: float | None = 1.0
    log_every: int = 10
    # On a non-finite loss or gradient: skip the update (on the device) or stop the run.
    nonfinite: Literal["skip", "stop"] = "stop"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # Dense bf16 TFLOP/s of one device for MFU; null: look it up from the device name.
    peak_tflops: float | None = None
    # The token-gerrymandering alarm over the logged expert load (moe.train.load_alarm).
    load_alarm: LoadAlarmConfig = dataclasses.field(default_factory=LoadAlarmConfig)
    # Router collapse (balance loss near its maximum, router z-loss growing): one line naming
    # the likely cause and the knob (moe.train.router_health).
    router_health: RouterHealthConfig = dataclasses.field(default_factory=RouterHealthConfig)
    # Activation recompute per block (moe.parallel.recompute): none | matmuls | selective | full.
    recompute: Literal["none", "matmuls", "selective", "full"] = "none"
    # Bitwise-identical reruns on CUDA at some cost in step time (moe.train.determinism).
    deterministic: bool = False
    # The same bits at any data-parallel size (DDP, ZeRO-1, FSDP) and across resumes on another
    # world size: gradients summed as int64 fixed point, losses and the norm in a fixed order,
    # random streams seeded per global micro-batch (moe.parallel.exact_sync). Implies
    # deterministic. Not with expert or pipeline parallelism.
    layout_invariant: bool = False
    # Tokens per chunk of the fused lm_head + cross-entropy (moe.nn.chunked_ce), which never
    # materialises the whole batch's logits; 0: the unfused head and loss.
    loss_chunk_tokens: int = 0
    # The unchunked loss from bf16 logits on the GPU in one Triton kernel that writes the
    # gradient over the logits (moe.kernels.cross_entropy): 2 instead of 14 bytes per logit at
    # the peak, and faster; false: torch's fp32 log-softmax. CPU runs always take torch's.
    fused_loss: bool = True
    # Olmo-core's output-logit z-loss: this weight times mean(logsumexp(logits)^2) joins the
    # gradient (1e-5 in its OLMoE-1B-7B script; the logged loss stays the cross-entropy).
    logit_z_loss_weight: float = 0.0
    # In-loop evaluation (moe.config.in_loop_eval.InLoopEvalConfig: what each key means; the
    # callback moe.train.callbacks.in_loop_eval takes them as that config, TrainConfig.in_loop_eval).
    eval_every: int = 0
    eval_tasks: list[str] = dataclasses.field(default_factory=list)
    eval_limit: int | None = 100
    eval_seed: int = 0
    eval_truncation: Literal["cut", "drop"] = "cut"
    eval_val_batches: int = 8
    eval_batch_tokens: int = 16384
    # Run this step (counted from 1) under torch.profiler and log where its time went as
    # profile/<category>_ms (moe.train.step_profile); the step stays out of the throughput.
    # 0: no profile.
    profile_step: int = 0
    # Capture the whole optimizer step as one CUDA graph after two eager steps and replay it
    # (moe.train.cuda_graph): the GPU no longer waits for Python's kernel launches. One GPU,
    # bf16, no recompute, optim.step_kernel=triton; bench/NOTES.md has what it gains.
    cuda_graph: bool = False

    @property
    def deterministic_kernels(self) -> bool:
        """Whether the deterministic mode is on: asked for, or implied by layout_invariant."""
        return self.deterministic or self.layout_invariant

    @property
    def in_loop_eval(self) -> InLoopEvalConfig:
        """The ``eval_*`` keys as the in-loop evaluation's own config."""
        return InLoopEvalConfig.of(self)

    def _check(self, p: str) -> None:
        for name in ("global_batch_size", "micro_batch_size", "max_steps", "log_every"):  # first: eval_every is checked against max_steps
            require(getattr(self, name) >= 1, _k(p, name), f"must be >= 1, got {getattr(self, name)}")
        for name, limit in (("max_steps", MAX_STEPS), ("global_batch_size", MAX_BATCH), ("micro_batch_size", MAX_BATCH)):
            require(getattr(self, name) <= limit, _k(p, name), f"{getattr(self, name)} is beyond any real run (at most {limit})")
        require(self.loss_chunk_tokens >= 0, _k(p, "loss_chunk_tokens"), f"must be >= 0 (0: off), got {self.loss_chunk_tokens}")
        self.in_loop_eval._check(p)
        require(
            self.eval_every <= self.max_steps,
            _k(p, "eval_every"),
            f"{self.eval_every} is larger than train.max_steps={self.max_steps}: it would never run",
        )
        require(self.logit_z_loss_weight >= 0, _k(p, "logit_z_loss_weight"), f"must be >= 0, got {self.logit_z_loss_weight}")
        require(
            0 <= self.profile_step <= self.max_steps,
            _k(p, "profile_step"),
            f"must lie in [0, train.max_steps={self.max_steps}] (0: no profile), got {self.profile_step}",
        )
        require(0 <= self.seed < 2**63, _k(p, "seed"), f"must be >= 0 (and < 2**63), got {self.seed}")
        if self.grad_clip is not None:
            require(self.grad_clip > 0, _k(p, "grad_clip"), "must be > 0 (or null to disable)")
        if self.peak_tflops is not None:
            require(self.peak_tflops > 0, _k(p, "peak_tflops"), "must be > 0")


@dataclasses.dataclass
class CheckpointConfig(Config):
    dir: str = "checkpoints"
    # Save every this many steps (0: only at the end); always saves at the last step.
    every: int = 0
    keep_last: int = 3
    # auto: resume from <dir>/latest when it exists; never: start fresh (refuses a non-empty dir).
    resume: Literal["auto", "never"] = "auto"
    # Start a fresh run from these model weights (a checkpoint, e.g. from `moe convert --from-hf`);
    # ignored when <dir> already holds a checkpoint to resume.
    init_from: str | None = None
    # false: write no checkpoint at all, not even the final one (benchmark runs of large
    # models, where a save would dwarf the steps measured); a preempted run then loses its steps.
    save: bool = True
    # true: a save copies the state to host memory and writes it in the background while
    # training goes on (the next save, a stop and the run's end wait for it); false: training
    # waits for the disk. Synchronous anyway where the host copies would not fit in memory.
    asynchronous: bool = True

    def _check(self, p: str) -> None:
        require(self.every >= 0, _k(p, "every"), "must be >= 0")
        require(self.keep_last >= 1, _k(p, "keep_last"), "must be >= 1")
        require(bool(self.dir), _k(p, "dir"), "must not be empty")


@dataclasses.dataclass
class ParallelConfig(Config):
    """The parallel layout. World size = pp * dp * ep... with EP folded into data parallelism:
    the data-parallel size is world / pp, and experts are sharded over ``ep`` of those ranks."""

    pp: int = 1
    ep: int = 1
    # Data-parallel size; -1 means world_size / pp.
    dp: int = -1
    # ddp: dense weights replicated, experts resident (the paper's design); fsdp: the baseline.
    data_parallel: Literal["ddp", "fsdp"] = "ddp"
    # Shard fp32 master weights and AdamW states over data-parallel ranks (ZeRO-1).
    shard_optimizer: bool = False
    # The micro-batches of one step (global batch / (dp * micro_batch_size)) go through the
    # pipeline together; interleaved_1f1b runs pp_virtual_stages stages on every rank.
    pp_schedule: Literal["1f1b", "interleaved_1f1b", "gpipe"] = "1f1b"
    pp_virtual_stages: int = 2
    # Expert-parallel token transport: nccl (all-to-all, one host sync per layer call) or
    # nvshmem (sync-free symmetric buffers; emulated over gloo on CPU).
    ep_backend: Literal["nccl", "nvshmem"] = "nccl"
    # nvshmem only: receive rows per rank = factor * tokens * top_k (null: worst case, ep * that).
    ep_capacity_factor: float | None = None
    # ddp: all-reduce gradient buckets from post-accumulate-grad hooks as they become ready in
    # the last micro-batch's backward (overlapping the backward), instead of after it. With
    # pp > 1 the reduction stays after the pipeline step; fsdp overlaps on its own.
    overlap_grad_reduce: bool = False
    # ddp: the dtype gradients travel in. fp32 reduces the fp32 accumulators as they are;
    # bf16 halves the traffic (each bucket is cast for the collective and the sum cast back
    # into fp32), as Megatron-Core does without grad_reduce_in_fp32.
    grad_reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    # ddp: gradients are reduced (and ZeRO-1 weights broadcast) in flat buckets of about this size.
    grad_bucket_mb: float = 25.0

    @property
    def interleaved(self) -> bool:
        """Whether the pipeline runs the interleaved 1F1B schedule (pp > 1)."""
        return self.pp > 1 and self.pp_schedule == "interleaved_1f1b"

    @property
    def virtual_stages(self) -> int:
        """Pipeline stages on every rank: pp_virtual_stages when interleaved, else 1."""
        return self.pp_virtual_stages if self.interleaved else 1

    def _check(self, p: str) -> None:
        require(self.pp >= 1, _k(p, "pp"), f"must be >= 1, got {self.pp}")
        require(self.ep >= 1, _k(p, "ep"), f"must be >= 1, got {self.ep}")
        require(self.dp == -1 or self.dp >= 1, _k(p, "dp"), f"must be >= 1 or -1 (auto), got {self.dp}")
        require(self.pp_virtual_stages >= 1, _k(p, "pp_virtual_stages"), "must be >= 1")
        require(self.grad_bucket_mb > 0, _k(p, "grad_bucket_mb"), f"must be > 0, got {self.grad_bucket_mb}")
        require(
            self.ep_capacity_factor is None or self.ep_capacity_factor > 0,
            _k(p, "ep_capacity_factor"),
            f"must be > 0 or null, got {self.ep_capacity_factor}",
        )
        require(self.ep_capacity_factor is None or self.ep_backend == "nvshmem", _k(p, "ep_capacity_factor"), "only applies to ep_backend=nvshmem")


@dataclasses.dataclass
class PrecisionConfig(Config):
    """How numbers are stored and computed (a seam: FP8/MXFP8 recipes plug in here).

    fp32: everything fp32. bf16: weights stored and computed in bf16, fp32 master weights and
    fp32 gradient accumulation in the optimizer. amp_bf16: fp32 weights, bf16 autocast.
    auto: bf16 on CUDA, fp32 on CPU. Router logits and the loss are fp32 in every recipe.
    fp8_rowwise (sm90+) / mxfp8 (sm100+): bf16 with FP8 expert GEMMs (moe.layers.gemm_fp8).
    """

    recipe: Literal["auto", "fp32", "bf16", "amp_bf16", "fp8_rowwise", "mxfp8"] = "auto"
    # fp8_rowwise/mxfp8 with an emulated GEMM on any device (slow; tests and CPU checks).
    emulate: bool = False
    # fp8_rowwise: an expert GEMM runs in FP8 only if its output columns and contraction are both
    # >= this and its mean rows per expert >= 1,024 (both dimensions >= 4,096) or 2,048 (narrower);
    # thinner or shorter GEMMs stay bf16, where FP8 was measured slower (moe.nn.fp8_policy.Fp8Rule);
    # 0 = always.
    fp8_min_dim: int = 1024
    # fp8_rowwise with optim.expert_wgrad gemm: an FP8 expert GEMM's weight gradient goes into the
    # fp32 gradient inside the FP8 accumulating GEMM only if both its dimensions are >= this,
    # else inside the bf16 one (measured: +1.5% at 4,096, -3.4% at 2,048; Fp8Rule's docstring).
    fp8_sink_wgrad_min_dim: int = 4096
    # fp8_rowwise: the dense projections (attention, dense and shared-expert MLPs; never the LM
    # head or the router) in FP8 too (moe.nn.fp8_linear), by the same rule with fp8_dense_min_dim.
    # Measured at the paper's width (bench/NOTES.md): +2% over FP8 experts alone; at OLMoE width
    # (2048) FP8 attention lost, hence 4096.
    fp8_dense: bool = False
    fp8_dense_min_dim: int = 4096

    def _check(self, p: str) -> None:
        require(self.fp8_min_dim >= 0, _k(p, "fp8_min_dim"), f"must be >= 0, got {self.fp8_min_dim}")
        require(self.fp8_sink_wgrad_min_dim >= 0, _k(p, "fp8_sink_wgrad_min_dim"), f"must be >= 0, got {self.fp8_sink_wgrad_min_dim}")
        require(self.fp8_dense_min_dim >= 0, _k(p, "fp8_dense_min_dim"), f"must be >= 0, got {self.fp8_dense_min_dim}")
        require(
            not self.fp8_dense or self.recipe == "fp8_rowwise",
            _k(p, "fp8_dense"),
            f"FP8 dense projections come with recipe fp8_rowwise, not {self.recipe}",
        )
