"""The layout seam: how a model, its gradients and its optimizer are spread over processes.

A layout is applied from the outside to an unmodified, fully initialised model (every rank
builds the same model from the same seed) and then drives each training step:

    model = layout.parallelize(model)
    opt = layout.optimizer(model, optim_cfg, master_weights)
    loss = layout.forward_backward(model, micro_batches, autocast)   # this step's loss(es)
    norm, scale = layout.sync_gradients(opt, clip)                   # reduce, global norm, clip factor
    opt.step(found_inf, scale); layout.after_step(opt)                # (ZeRO-1 weights may still be in flight:
    layout.settle()                                                  #  the next forward waits for them, or this)

``ParallelLayout`` covers pipeline (pp), data (dp) and expert (ep) parallelism with resident
experts and optional ZeRO-1; ``FsdpLayout`` is the FSDP2 baseline the paper compares against.
Under ``train.layout_invariant`` both sum gradients, losses and the norm exactly
(moe.parallel.exact_sync), so any data-parallel size gives the same bits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from moe.config import ConfigError, ExperimentConfig, OptimizerConfig, ResolvedLayout
from moe.model import Transformer, run_stack
from moe.nn.loss import lm_loss
from moe.optim import MasterWeightAdamW
from moe.parallel.env import DistEnv
from moe.parallel.exact_sync import (
    FixedPointGradSync,
    FsdpFixedPoint,
    fixed_order_mean,
    layout_invariant_norm,
    micro_batches_per_step,
    norm_terms,
)
from moe.parallel.expert_parallel import apply_expert_parallel
from moe.parallel.fixed_point import FixedPointScales
from moe.parallel.grad_sync import GradSync, OverlappedGradSync, clip_coefficient, global_grad_norm
from moe.parallel.mesh import Mesh, build_mesh
from moe.parallel.pipeline import PipelineRunner, prune_for_stages

Autocast = Callable[[], AbstractContextManager]
# Called with a micro-batch's global index (its place among the step's micro-batches over all
# data-parallel ranks) before its forward: the random streams and telemetry of train.layout_invariant.
BeforeMicro = Callable[[int], None]


@dataclasses.dataclass(frozen=True)
class MicroBatchPlaces:
    """Where a rank's micro-batches sit among the step's (train.layout_invariant): every
    micro-batch's loss is divided by the step's ``total`` on every layout and kept at its place."""

    first: int  # global index of this rank's first micro-batch
    total: int  # micro-batches in the step over all data-parallel ranks
    before: BeforeMicro | None = None
    after: Callable[[], None] | None = None  # after each backward (the fixed-point calibration)


class Layout(Protocol):
    resolved: ResolvedLayout
    mesh: Mesh
    dp_rank: int
    dp_size: int
    # the gradients' fixed-point exponents (train.layout_invariant; checkpointed), else None
    scales: FixedPointScales | None

    def parallelize(self, model: Transformer) -> Transformer: ...

    @property
    def broadcasts_expert_weights(self) -> bool:
        """Whether an optimizer owner sends the bf16 expert weights to other ranks after each step
        (ZeRO-1 over an expert data-parallel group of more than one rank)."""
        ...

    def optimizer(self, model: nn.Module, cfg: OptimizerConfig, master_weights: bool) -> MasterWeightAdamW: ...

    def forward_backward(
        self, model: Transformer, micro: list[torch.Tensor], autocast: Autocast, before_micro: BeforeMicro | None = None
    ) -> torch.Tensor:
        """This step's mean loss (train.layout_invariant: the [micro-batches] losses, this rank's at
        their places); ``before_micro``: see BeforeMicro (layout_invariant only)."""
        ...

    def sync_gradients(self, opt: MasterWeightAdamW, clip: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Reduce the gradients; (global norm, factor the optimizer step applies to every
        gradient, or None where the gradients are already clipped)."""
        ...

    def after_step(self, opt: MasterWeightAdamW) -> None: ...

    def settle(self) -> None:
        """Every weight update has landed (before anything but the next forward reads them)."""
        ...

    def mean_loss(self, local: torch.Tensor) -> torch.Tensor: ...


def _micro_loss(
    model: nn.Module, batch: torch.Tensor, autocast: Autocast, chunk: int = 0, z_weight: float = 0.0, fused: bool = False
) -> torch.Tensor:
    with autocast():
        if chunk:  # the model up to its final norm, then the fused, chunked head + loss
            return lm_loss(run_stack(model, batch[:, :-1], head=False), batch[:, 1:], model.lm_head.weight, chunk, z_weight)
        # the logits are a temporary here: the fused loss may write its gradient over them
        return lm_loss(model(batch[:, :-1]), batch[:, 1:], z_weight=z_weight, fused=fused, overwrite_logits=True)


def accumulate(
    model: Transformer,
    micro: list[torch.Tensor],
    autocast: Autocast,
    device: torch.device,
    chunk: int = 0,
    before_last: Callable[[], None] | None = None,
    z_weight: float = 0.0,
    fused: bool = False,
    places: MicroBatchPlaces | None = None,
) -> torch.Tensor:
    """Forward and backward of every micro-batch (gradients accumulate); the mean loss.
    ``chunk``: tokens per chunk of the fused head + loss (0: unfused); ``before_last`` runs
    before the last micro-batch (e.g. to arm overlapped gradient reduction); ``z_weight``:
    the output-logit z-loss (in the gradient, not the returned loss); ``fused``: train.fused_loss.
    ``places`` (train.layout_invariant): each loss divided by the step's micro-batches over all
    ranks, returned at its global place in a [places.total] vector instead of averaged here."""
    n = len(micro)
    divisor = n if places is None else places.total
    model.set_aux_loss_scale(1.0 / divisor)
    total = torch.zeros((), device=device) if places is None else torch.zeros(places.total, device=device)
    for i, batch in enumerate(micro):
        if device.type == "cuda" and not batch.is_cuda:  # (already on the device: e.g. a CUDA graph's input)
            batch = batch.pin_memory()
        if before_last is not None and i == n - 1:
            before_last()
        if places is not None and places.before is not None:
            places.before(places.first + i)
        loss = _micro_loss(model, batch.to(device, non_blocking=True), autocast, chunk, z_weight, fused)
        (loss / divisor).backward()
        if places is None:
            total += loss.detach() / n
        else:
            total[places.first + i] = loss.detach()
            if places.after is not None:
                places.after()
    return total


def world_mean(local: torch.Tensor, divisor: int) -> torch.Tensor:
    """Sum over all ranks / divisor (the identity for one process)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return local
    total = local.clone()
    dist.all_reduce(total)
    return total / divisor


def resolved_for(cfg: ExperimentConfig, env: DistEnv, resolved: ResolvedLayout | None) -> ResolvedLayout:
    """``resolved`` (the run's layout, resolved once when its job was built) for this world, or
    the config resolved here when none was given (library use)."""
    if resolved is None:
        return cfg.resolve(env.world_size)
    if resolved.world_size != env.world_size:
        raise ConfigError(
            f"parallel: the job's layout was resolved for world size {resolved.world_size}, "
            f"but this run has world size {env.world_size} (rebuild the job for this world)"
        )
    return resolved


class ParallelLayout:
    def __init__(self, cfg: ExperimentConfig, env: DistEnv, resolved: ResolvedLayout | None = None) -> None:
        self.cfg, self.env = cfg, env
        self.resolved = resolved_for(cfg, env, resolved)
        r = self.resolved
        self.mesh = build_mesh(r.pp, r.dp, r.ep)
        self.dp_rank, self.dp_size = self.mesh.dp_rank, self.mesh.dp
        self.zero = cfg.parallel.shard_optimizer
        self.virtual = r.virtual_stages
        self.runner: PipelineRunner | None = None
        self.sync: GradSync | None = None
        self.opt: MasterWeightAdamW | None = None
        self.chunk = cfg.train.loss_chunk_tokens
        self.z_weight = cfg.train.logit_z_loss_weight
        self.fused_loss = cfg.train.fused_loss
        self.invariant = cfg.train.layout_invariant
        self.micro_batches = micro_batches_per_step(cfg.train.global_batch_size, cfg.train.micro_batch_size)
        self.scales: FixedPointScales | None = None
        self.norm_terms = 0

    def parallelize(self, model: Transformer) -> Transformer:
        par = self.cfg.parallel
        model = apply_expert_parallel(model, self.mesh, par.ep_backend, par.ep_capacity_factor)
        if self.resolved.pp > 1:
            model, views = prune_for_stages(model, self.mesh, self.virtual, head=not self.chunk)
            self.runner = PipelineRunner(
                views,
                self.mesh,
                self.cfg.parallel.pp_schedule,
                self.resolved.grad_accum,
                self.env.device,
                self.virtual,
                self.chunk,
                self.z_weight,
                self.fused_loss,
            )
        overlap = self.cfg.parallel.overlap_grad_reduce and self.runner is None
        reduce_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[self.cfg.parallel.grad_reduce_dtype]
        bucket_bytes = int(self.cfg.parallel.grad_bucket_mb * 2**20)
        if self.invariant:
            self.sync = FixedPointGradSync(model, self.mesh, self.zero, bucket_bytes, self.micro_batches)
        else:
            self.sync = (OverlappedGradSync if overlap else GradSync)(model, self.mesh, self.zero, reduce_dtype, bucket_bytes)
        return model

    @property
    def broadcasts_expert_weights(self) -> bool:
        return self.sync is not None and self.sync.broadcasts_expert_weights

    def optimizer(self, model: nn.Module, cfg: OptimizerConfig, master_weights: bool) -> MasterWeightAdamW:
        opt = MasterWeightAdamW(model, cfg, master_weights, owns=self.sync.owns)
        if isinstance(self.sync, OverlappedGradSync):
            self.sync.attach(opt, model)  # after the optimizer's own hooks: they fill the fp32 gradients
        if isinstance(self.sync, FixedPointGradSync):
            self.sync.attach(opt)  # after the optimizer's own hooks too
            self.scales, self.norm_terms = self.sync.scales, norm_terms(opt)
        self.opt = opt
        return opt

    def forward_backward(
        self, model: Transformer, micro: list[torch.Tensor], autocast: Autocast, before_micro: BeforeMicro | None = None
    ) -> torch.Tensor:
        device = self.env.device
        if self.runner is not None:
            model.set_aux_loss_scale(1.0 / len(micro))
            batch = torch.cat(micro).to(device, non_blocking=True)
            with autocast():
                return self.runner.step(batch, device)
        places = None
        if self.invariant:
            places = MicroBatchPlaces(self.dp_rank * len(micro), self.micro_batches, before_micro, self.sync.after_micro)
        return accumulate(model, micro, autocast, device, self.chunk, self._before_last, self.z_weight, self.fused_loss, places)

    def _before_last(self) -> None:
        if self.opt is not None:
            self.opt.last_micro_batch()
        if isinstance(self.sync, OverlappedGradSync):
            self.sync.arm()

    def sync_gradients(self, opt: MasterWeightAdamW, clip: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.invariant:
            self.sync.reduce(opt)
            norm = layout_invariant_norm(self.sync.counted(opt), self.norm_terms, self.sync.overflow, self.env.device)
            return norm, (clip_coefficient(norm, clip) if clip is not None else None)
        opt.fold_deferred()  # the pipeline schedule runs its micro-batches itself
        for p in opt.params:  # every rank must bring the same tensors to the collectives
            if p.grad is None:
                p.grad_holder.grad = torch.zeros(p.param.shape, dtype=torch.float32, device=p.param.device)
        self.sync.reduce(opt)
        # one process: each gradient as its GEMM left it, so the sums its epilogue reported hold
        known = opt.grad_squares() if self.env.world_size == 1 else None
        norm = global_grad_norm(self.sync.counted(opt), self.env.device, known)
        # clipping happens inside the fused AdamW step (no pass of its own over the gradients)
        return norm, (clip_coefficient(norm, clip) if clip is not None else None)

    def after_step(self, opt: MasterWeightAdamW) -> None:
        self.sync.broadcast_updates(opt)

    def settle(self) -> None:
        """Weight updates still in flight (ZeRO-1 broadcasts overlapping the next forward) land."""
        if isinstance(self.sync, OverlappedGradSync):
            self.sync.settle()

    def mean_loss(self, local: torch.Tensor) -> torch.Tensor:
        """The step's global mean loss on every rank (pipeline: only last stages hold one)."""
        if self.invariant:
            return fixed_order_mean(local, self.mesh.dp_group)
        return world_mean(local, self.mesh.dp)


class FsdpLayout:
    """FSDP2 (fully_shard per block) over all ranks: the baseline the paper replaces.

    Weights, gradients and optimizer state are sharded; every block's weights are gathered
    for each micro-batch's forward and backward."""

    def __init__(self, cfg: ExperimentConfig, env: DistEnv, resolved: ResolvedLayout | None = None) -> None:
        self.cfg, self.env = cfg, env
        self.resolved = resolved_for(cfg, env, resolved)  # resolve() holds FSDP's rules (pp=1, ep=1, no ZeRO-1, no chunked loss)
        self.mesh = build_mesh(1, self.resolved.dp, 1)
        self.dp_rank, self.dp_size = self.mesh.dp_rank, self.mesh.dp
        self.invariant = cfg.train.layout_invariant
        self.micro_batches = micro_batches_per_step(cfg.train.global_batch_size, cfg.train.micro_batch_size)
        self.scales: FixedPointScales | None = None
        self.sharded: list[nn.Module] = []  # the fully_shard-ed modules (world > 1)
        # train.layout_invariant: integer sums on one process, or in FSDP's reduce-scatter
        self.sync: FixedPointGradSync | None = None
        self.fixed: FsdpFixedPoint | None = None
        self.norm_terms = 0

    # FSDP2 shards the weights themselves (DTensors, which no recipe releases)
    broadcasts_expert_weights = False

    def parallelize(self, model: Transformer) -> Transformer:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        for _, layer in model.moe_layers():
            layer.router.balance_group = self.mesh.dp_group
        if self.env.world_size > 1:
            mesh = init_device_mesh(self.env.device.type, (self.env.world_size,))
            for block in model.layers.values():
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            self.sharded = [*model.layers.values(), model]
        elif self.invariant:
            self.sync = FixedPointGradSync(model, self.mesh, False, int(self.cfg.parallel.grad_bucket_mb * 2**20), self.micro_batches)
        return model

    def optimizer(self, model: nn.Module, cfg: OptimizerConfig, master_weights: bool) -> MasterWeightAdamW:
        self.resolved.check_master_weights(master_weights)
        opt = MasterWeightAdamW(model, cfg, master_weights=False)
        if self.invariant and self.sync is not None:
            self.sync.attach(opt)
            self.scales = self.sync.scales
        elif self.invariant:
            self.fixed = FsdpFixedPoint(self.sharded, opt, self.micro_batches, self.env.world_size)
            self.scales = self.fixed.scales
        self.norm_terms = norm_terms(opt)
        return opt

    def forward_backward(
        self, model: Transformer, micro: list[torch.Tensor], autocast: Autocast, before_micro: BeforeMicro | None = None
    ) -> torch.Tensor:
        places = None
        if self.invariant:
            after = self.sync.after_micro if self.sync is not None else self.fixed.after_micro
            places = MicroBatchPlaces(self.dp_rank * len(micro), self.micro_batches, before_micro, after)
        z_weight, fused = self.cfg.train.logit_z_loss_weight, self.cfg.train.fused_loss
        return accumulate(model, micro, autocast, self.env.device, z_weight=z_weight, fused=fused, places=places)

    def sync_gradients(self, opt: MasterWeightAdamW, clip: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.invariant:
            return self._sync_fixed_point(opt, clip)
        params = [p.grad_holder for p in opt.params if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip is not None else float("inf"), foreach=True)
        return (norm.full_tensor() if hasattr(norm, "full_tensor") else norm), None

    def _sync_fixed_point(self, opt: MasterWeightAdamW, clip: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Integer sums to fp32 shard gradients, the norm over rows; clipped inside the AdamW step."""
        if self.sync is not None:
            self.sync.reduce(opt)
            grads, overflow = self.sync.counted(opt), self.sync.overflow
        else:
            self.fixed.finish()
            grads, overflow = [p.grad.to_local() for p in opt.params if p.grad is not None], self.fixed.overflow
        norm = layout_invariant_norm(grads, self.norm_terms, overflow, self.env.device)
        return norm, (clip_coefficient(norm, clip) if clip is not None else None)

    def after_step(self, opt: MasterWeightAdamW) -> None:
        return None

    def settle(self) -> None:
        return None

    def mean_loss(self, local: torch.Tensor) -> torch.Tensor:
        if self.invariant:
            return fixed_order_mean(local, None)
        return world_mean(local, self.env.world_size)


def build_layout(cfg: ExperimentConfig, env: DistEnv, resolved: ResolvedLayout | None = None) -> Layout:
    """The config's layout; ``resolved``: the run's layout as its job carries it (None: resolved here)."""
    if cfg.parallel.data_parallel == "fsdp":
        return FsdpLayout(cfg, env, resolved)
    return ParallelLayout(cfg, env, resolved)
