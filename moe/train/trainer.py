"""The training loop.

One optimizer step: every micro-batch's forward and backward (gradients accumulate in fp32),
the layout's gradient reduction, clipping, a fused AdamW step that skips itself on the device
when the loss or gradient norm is not finite, the schedule, and aux-loss-free bias updates.
Nothing in a step waits for the device; losses and telemetry are brought to the host only at
log points.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import resource
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from moe.config import ConfigError, ExperimentConfig, ModelConfig, ResolvedLayout
from moe.data import BatchLoader, TokenDataset
from moe.errors import NonFiniteLossError, TokenDataError
from moe.model import Transformer
from moe.optim import build_scheduler
from moe.parallel.env import DistEnv, init_distributed
from moe.parallel.exact_sync import micro_batches_per_step
from moe.parallel.layout import Layout, build_layout
from moe.parallel.recompute import apply_recompute
from moe.plan.accounting import flops_per_token, param_counts
from moe.precision import expert_rows, recipe_for
from moe.spans import span
from moe.train import determinism
from moe.train.callbacks import Callback, trainer_callbacks
from moe.train.checkpoint import CheckpointError, CheckpointManager, latest_checkpoint
from moe.train.cuda_graph import CapturedStep
from moe.train.preemption import StopRequest
from moe.train.rng import rng_state, seed_everything, seed_micro_batch, set_rng_state
from moe.train.sinks import MetricsSink
from moe.train.state import load_targets, save_entries
from moe.train.telemetry import MoETelemetry
from moe.train.throughput import peak_tflops, throughput

log = logging.getLogger("moe.train")


@dataclasses.dataclass
class TrainSummary:
    steps: int
    start_step: int
    final_loss: float | None
    losses: dict[int, float]
    last_metrics: dict[str, float]
    tokens_per_step: int
    params_total: int
    params_active: int
    checkpoint: str | None
    preempted: bool = False


class Trainer:
    def __init__(
        self,
        cfg: ExperimentConfig,
        *,
        env: DistEnv | None = None,
        sinks: Sequence[MetricsSink] = (),
        dataset: TokenDataset | None = None,
        callbacks: Sequence[Callback] = (),
        resolved: ResolvedLayout | None = None,
    ) -> None:
        """``resolved``: the run's layout, resolved once when its job was built (None: the layout
        resolves ``cfg`` against this world)."""
        self.cfg = cfg
        # First: the mode's environment must be in place before CUDA and NCCL start.
        self.determinism = determinism.configure(cfg.train.deterministic_kernels, cfg.train.layout_invariant)
        self.env = env or init_distributed(cfg.train.device)
        self.device = self.env.device
        self.layout: Layout = build_layout(cfg, self.env, resolved)
        self.sinks = list(sinks) if self.env.is_main else []
        self.recipe = recipe_for(cfg.precision, self.device)

        seed_everything(cfg.train.seed)
        with torch.device(self.device):
            # the full model, identical on every rank (same seed), with the recipe's expert GEMM
            model = Transformer(cfg.model, expert_gemm=self.recipe.expert_gemm)
        self.recipe.prepare(model)
        apply_recompute(model, cfg.train.recompute)  # per block, before the layout (FSDP2 wraps it)
        self.model = self.layout.parallelize(model)
        determinism.prepare_model(self.model, self.recipe, self.determinism)
        self.opt = self.layout.optimizer(self.model, cfg.optim, self.recipe.master_weights)
        self.recipe.attach_optimizer(
            self.model, self.opt, broadcasts_expert_weights=self.layout.broadcasts_expert_weights, expert_rows=expert_rows(cfg)
        )
        self.sched = build_scheduler(self.opt, cfg.schedule, cfg.train.max_steps)

        self.dataset = dataset or TokenDataset(
            cfg.data.paths,
            cfg.data.seq_len,
            tokenizer_hash=cfg.data.tokenizer_hash,
            verify_checksums=cfg.data.verify_checksums,
        )
        if self.dataset.vocab_size > cfg.model.vocab_size:
            raise TokenDataError(
                f"{self.dataset.files[0]}: the data's vocabulary ({self.dataset.vocab_size}) is larger than model.vocab_size={cfg.model.vocab_size}"
            )
        self.loader = BatchLoader(
            self.dataset,
            global_batch_size=cfg.train.global_batch_size,
            micro_batch_size=cfg.train.micro_batch_size,
            seed=cfg.data.seed,
            dp_rank=self.layout.dp_rank,
            dp_size=self.layout.dp_size,
        )
        self.ckpt = CheckpointManager(cfg.checkpoint.dir, cfg.checkpoint.keep_last, asynchronous=cfg.checkpoint.asynchronous)
        slots = micro_batches_per_step(cfg.train.global_batch_size, cfg.train.micro_batch_size) if cfg.train.layout_invariant else None
        self.telemetry = MoETelemetry(self.model, self.device, self.layout.mesh.dp_group, slots)
        self.callbacks: list[Callback] = trainer_callbacks(cfg, callbacks)
        self._extra: dict[str, float] = {}  # callback metrics of the current step (logged with it)
        self._callback_s = 0.0  # time callbacks took since the last log point (not training time)
        self._checkpoint_s = 0.0  # of which checkpointing held the loop (the metric checkpoint/blocked_s)

        counts = param_counts(cfg.model)
        self.params_total, self.params_active = counts.total, counts.active
        self.tokens_per_step = cfg.train.global_batch_size * cfg.data.seq_len
        self.flops_per_token = flops_per_token(cfg.model, cfg.data.seq_len)
        self.peak = peak_tflops(self.device, cfg.train.peak_tflops)

        self.step = 0
        self.start_step = 0
        self.losses: dict[int, float] = {}
        self._pending: list[tuple[int, torch.Tensor]] = []
        self._skipped = torch.zeros((), dtype=torch.int64, device=self.device)
        self._first_bad = torch.full((), -1, dtype=torch.int64, device=self.device)
        self._grad_norm = torch.zeros((), device=self.device)
        self._step_number = torch.zeros((), dtype=torch.int64, device=self.device)  # the running step's, for the device
        self._lr = cfg.optim.lr
        self.last_metrics: dict[str, float] = {}
        self.last_checkpoint: Path | None = None
        self.captured = self._captured_step() if cfg.train.cuda_graph else None
        self.tag(self.determinism.tags())

    def _captured_step(self) -> CapturedStep:
        """train.cuda_graph, where this run can take it (the config refused what it can tell)."""
        if self.device.type != "cuda":
            raise ConfigError(f"train.cuda_graph: needs a CUDA GPU; this run's device is {self.device.type}")
        if self.env.world_size != 1:
            raise ConfigError(f"train.cuda_graph: runs on one GPU; this run has {self.env.world_size} processes")
        self.opt.keep_lr_on_device()
        return CapturedStep(self._step_body, self.device)

    # ----------------------------------------------------------------- state

    def save_checkpoint(self) -> Path:
        """Checkpoint this step and wait until it is complete on disk."""
        path = self._start_checkpoint(background=False)
        self.ckpt.wait()
        return path

    def checkpoint(self) -> Path:
        """Checkpoint this step (unless a non-finite step must stop the run: train.nonfinite=stop),
        in the background where checkpoint.asynchronous; the loop's time waiting for it (staging,
        a previous save still writing) is kept out of the throughput and logged as its own metric."""
        self._check_finite()
        self._sync()  # the step's queued work stays in the step's time
        start = time.perf_counter()
        path = self._start_checkpoint(background=self.cfg.checkpoint.asynchronous)
        blocked = time.perf_counter() - start
        self._callback_s += blocked
        self._checkpoint_s += blocked
        return path

    def _start_checkpoint(self, background: bool) -> Path:
        self.layout.settle()  # ZeRO-1 weight broadcasts that overlap the next forward land first
        meta = {
            "config": self.cfg.to_dict(),
            "loader": self.loader.state_dict(),
            "scheduler": self.sched.state_dict(),
            "skipped_steps": int(self._skipped.item()),
            "params_total": self.params_total,
            "params_active": self.params_active,
            "determinism": self.determinism.to_meta(),
            # what precision.recipe (auto: bf16 on a GPU, fp32 on a CPU) and train.device resolved to: the model card's
            "resolved": {"precision": self.recipe.name, "device": self.device.type},
        }
        if self.layout.scales is not None:  # train.layout_invariant: the next step's exponents
            meta["grad_exponents"] = self.layout.scales.state_dict()
        save = self.ckpt.save_async if background else self.ckpt.save
        path = save(self.step, save_entries(self.model, self.opt), meta, rng_state(self.device))
        self.last_checkpoint = path
        return path

    def load_checkpoint(self, path: str | Path) -> None:
        from moe.train.checkpoint import read_meta

        self.layout.settle()  # no weight broadcast still in flight may land over what is loaded
        self.ckpt.wait()
        meta = read_meta(path)
        _check_same_model(meta.get("config", {}).get("model", {}), self.cfg.model, path)
        mismatch = determinism.resume_mismatch(meta.get("determinism"), self.determinism, path)
        if mismatch:
            log.warning(mismatch)
            self.tag({"determinism.resume_mismatch": mismatch})
        targets, copies = load_targets(self.model, self.opt)
        meta, rng = CheckpointManager.load(path, targets)
        self._finish_load(copies)
        self.sched.load_state_dict(meta["scheduler"])
        # LambdaLR restores its counter and the lr it last computed, under the saved schedule; the
        # next step's lr comes from this config's schedule (the same number when nothing changed;
        # the extended schedule's when train.max_steps grew, as the extension note announces).
        lrs = [base * fn(self.sched.last_epoch) for base, fn in zip(self.sched.base_lrs, self.sched.lr_lambdas, strict=True)]
        self.sched._last_lr = lrs
        for group, lr in zip(self.opt.inner.param_groups, lrs, strict=True):
            group["lr"] = lr
        self.loader.load_state_dict(meta["loader"])
        if self.layout.scales is not None:
            try:  # none (a checkpoint of another mode): the next step calibrates them afresh
                self.layout.scales.load_state_dict(meta.get("grad_exponents") or {})
            except ValueError as exc:
                raise CheckpointError(f"{path}: {exc}") from None
        self._skipped.fill_(int(meta.get("skipped_steps", 0)))
        self.step = self.start_step = int(meta["step"])
        if rng is not None:
            try:
                set_rng_state(rng, self.device)
            except ValueError as exc:
                raise CheckpointError(f"{path}: its rng-rank{self.env.rank:05d}.pt is {exc}") from None
        else:  # resumed on another world size: a fresh, deterministic stream per rank
            seed_everything(self.cfg.train.seed + 1_000_003 * self.step + self.env.rank)
        log.info("resumed from %s at step %d", path, self.step)

    def load_weights(self, path: str | Path) -> None:
        """Model weights only (fresh optimizer, schedule and data position)."""
        from moe.train.checkpoint import read_meta

        self.layout.settle()
        _check_same_model(read_meta(path).get("config", {}).get("model", {}), self.cfg.model, path)
        targets, copies = load_targets(self.model, self.opt, with_optim=False)
        CheckpointManager.load(path, targets)
        self._finish_load(copies)
        log.info("initialised weights from %s", path)

    @torch.no_grad()
    def _finish_load(self, copies) -> None:
        self.opt.sync_params_from_masters()
        for param, buf in copies:
            param.copy_(buf)

    def maybe_resume(self) -> None:
        self.ckpt.clean_stale()
        latest = latest_checkpoint(self.cfg.checkpoint.dir)
        if latest is None:
            if self.cfg.checkpoint.init_from:
                self.load_weights(self.cfg.checkpoint.init_from)
            return
        if self.cfg.checkpoint.resume == "never":
            raise CheckpointError(
                f"checkpoint.dir={self.cfg.checkpoint.dir} already holds {latest.name}; "
                "set checkpoint.resume=auto to continue it or choose another directory"
            )
        self.load_checkpoint(latest)

    # ------------------------------------------------------------------ loop
    def train_step(self) -> None:
        micro = self.loader.next_batch()
        self.model.train()
        self._step_number.fill_(self.step + 1)  # the step's host values, written to the device
        self.opt.write_lr()
        if self.captured is None:
            step_loss = self._step_body(micro)
        else:
            step_loss = self.captured.run(micro)
            self.opt.note_updated()
        self._lr = self.sched.get_last_lr()[0]
        self.sched.step()
        self._pending.append((self.step + 1, step_loss))

    def _step_body(self, micro: list[torch.Tensor]) -> torch.Tensor:
        """What the device does in a step (train.cuda_graph captures exactly this): forward and
        backward of every micro-batch, gradient sync and norm, the AdamW step, bias updates."""
        before = self._before_micro if self.cfg.train.layout_invariant else None
        local = self.layout.forward_backward(self.model, micro, lambda: self.recipe.autocast(self.device), before)
        step_loss = self.layout.mean_loss(local)
        with span("grad_sync"):
            norm, grad_scale = self.layout.sync_gradients(self.opt, self.cfg.train.grad_clip)
        bad = ~(torch.isfinite(norm) & torch.isfinite(step_loss))
        with span("optimizer"):
            self.opt.step(found_inf=bad, grad_scale=grad_scale)
            self.layout.after_step(self.opt)
            self.model.update_expert_biases()
            self.opt.zero_grad()
        self._skipped += bad.long()
        self._first_bad.copy_(torch.where((self._first_bad < 0) & bad, self._step_number, self._first_bad))
        self._grad_norm = norm.detach()
        return step_loss

    def _before_micro(self, index: int) -> None:
        """train.layout_invariant: a micro-batch's random numbers and telemetry slot come from
        its global place (step, index), not from the rank that runs it."""
        seed_micro_batch(self.cfg.train.seed, self.step, index)
        self.telemetry.slot = index

    def fit(self, stop_at: int | None = None, stop: StopRequest | None = None) -> TrainSummary:
        """Train to ``train.max_steps``; stop early after ``stop_at`` steps, or when ``stop``
        is requested (a signal), checkpointing there so that a restart resumes exactly."""
        self.maybe_resume()
        if self.cfg.checkpoint.save:
            self.ckpt.prepare(save_entries(self.model, self.opt))  # host buffers of asynchronous saves
        preempted = False
        if stop is not None:
            stop.agreed()  # creates the control group on every rank up front
        max_steps = self.cfg.train.max_steps
        end = min(max_steps, stop_at) if stop_at is not None else max_steps
        self._sync()
        t0, steps_since = time.perf_counter(), 0
        while self.step < end:
            untimed_since = self._before_step(self.step + 1)
            self.train_step()
            self.step += 1
            if untimed_since is None:
                steps_since += 1
            last = self.step == end
            self._after_step(untimed_since)
            if self.step % self.cfg.train.log_every == 0 or last or self._extra:
                self._sync()
                elapsed = time.perf_counter() - t0 - self._callback_s
                self._log(elapsed, steps_since)
                t0, steps_since, self._callback_s = time.perf_counter(), 0, 0.0
            if stop is not None and not last and stop.agreed():
                log.warning("stop requested (signal %s) at step %d: checkpointing", stop.signum, self.step)
                self._sync()
                if self._pending:
                    self._log(time.perf_counter() - t0, steps_since)
                self.checkpoint()
                preempted = True
                break
            for cb in self.callbacks:
                cb.on_step_end(self, self.step, last)
        if self.step == self.start_step and self.step >= max_steps:
            log.info("nothing to do: already at step %d of %d", self.step, max_steps)
        self.ckpt.wait()  # the last checkpoint is complete before the run reports it
        self.layout.settle()  # the weights a caller reads after fit are the last step's
        summary = TrainSummary(
            steps=self.step,
            start_step=self.start_step,
            final_loss=self.losses.get(self.step),
            losses=dict(self.losses),
            last_metrics=dict(self.last_metrics),
            tokens_per_step=self.tokens_per_step,
            params_total=self.params_total,
            params_active=self.params_active,
            checkpoint=str(self.last_checkpoint) if self.last_checkpoint else None,
            preempted=preempted,
        )
        for sink in self.sinks:
            sink.close(dataclasses.asdict(summary))
        if summary.final_loss is not None and not math.isfinite(summary.final_loss):
            # even under nonfinite=skip: a run that ends on a non-finite loss did not succeed
            raise NonFiniteLossError(
                f"final loss {summary.final_loss} at step {self.step} is not finite "
                f"({int(self._skipped.item())} steps skipped); the checkpoint holds the last finite update"
            )
        return summary

    def _before_step(self, step: int) -> float | None:
        """Callbacks before step ``step``. When one keeps the step out of the throughput (a
        profiled step), the steps queued before it finish first, inside their own interval's
        time, and the time it starts at is returned (None: a timed step)."""
        since = None
        if any(cb.untimed(step) for cb in self.callbacks):
            self._sync()
            since = time.perf_counter()
        for cb in self.callbacks:
            cb.before_step(self, step)
        return since

    def _after_step(self, untimed_since: float | None) -> None:
        """Side jobs after a step; the time of those that work (in-loop evaluation) is kept out
        of the throughput: the device finishes the step first, then the callback is timed. An
        untimed step's own time, since ``untimed_since``, is kept out with theirs."""
        due = [cb for cb in self.callbacks if cb.due(self.step)]
        if untimed_since is not None:
            start = untimed_since
        elif due:
            self._sync()
            start = time.perf_counter()
        else:
            return
        for cb in due:
            self._extra.update(cb.after_step(self, self.step) or {})
        self._sync()
        self._callback_s += time.perf_counter() - start

    # --------------------------------------------------------------- logging
    def tag(self, tags: dict[str, str]) -> None:
        """Run-level tags for the sinks that keep them (MLflow)."""
        for sink in self.sinks:
            if hasattr(sink, "set_tags"):
                sink.set_tags(tags)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _check_finite(self) -> None:
        first_bad = int(self._first_bad.item())
        if first_bad >= 0 and self.cfg.train.nonfinite == "stop":
            raise NonFiniteLossError(
                f"non-finite loss or gradient norm at step {first_bad}; the update was not applied "
                "(set train.nonfinite=skip to skip such steps and continue)"
            )

    def _log(self, elapsed: float, steps: int) -> None:
        steps_and_losses = [(s, v) for s, v in self._pending]
        values = torch.stack([v for _, v in steps_and_losses]).tolist()
        self._pending.clear()
        for (s, _), v in zip(steps_and_losses, values, strict=True):
            self.losses[s] = v
        self._check_finite()
        metrics: dict[str, float] = {
            "loss": values[-1],
            "loss_avg": sum(values) / len(values),
            "lr": self._lr,
            "grad_norm": float(self._grad_norm.item()),
            "skipped_steps": float(self._skipped.item()),
        }
        if steps:  # none when the only step since the last log was the profiled one
            tp = throughput(self.tokens_per_step * steps, elapsed, self.env.world_size, self.flops_per_token, self.peak)
            metrics.update(
                step_time_s=elapsed / steps,
                tokens_per_s=tp.tokens_per_s,
                tokens_per_s_per_device=tp.tokens_per_s_per_device,
                tflops_per_device=tp.tflops_per_device,
            )
            if tp.mfu is not None:
                metrics["mfu"] = tp.mfu
            # the time the remaining steps take at this interval's pace (the console shows it)
            metrics["eta_s"] = max(0, self.cfg.train.max_steps - steps_and_losses[-1][0]) * elapsed / steps
        if self.device.type == "cuda":
            metrics["peak_mem_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
            # Between steps: weights, masters, optimizer states (peak minus this ~ activations).
            metrics["mem_at_rest_gib"] = torch.cuda.memory_allocated(self.device) / 2**30
        else:
            metrics["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        if self._checkpoint_s or self.ckpt.last_write_s is not None:
            metrics["checkpoint/blocked_s"] = self._checkpoint_s
            self._checkpoint_s = 0.0
        if self.ckpt.last_write_s is not None:
            metrics["checkpoint/write_s"] = self.ckpt.last_write_s
            self.ckpt.last_write_s = None
        metrics.update(self.telemetry.reduce())
        metrics.update(self._extra)
        self._extra = {}
        last_step = steps_and_losses[-1][0]
        for cb in self.callbacks:
            cb.on_log(self, last_step, metrics)
        self.last_metrics = metrics
        for sink in self.sinks:
            for (s, _), v in zip(steps_and_losses[:-1], values[:-1], strict=True):
                sink.log(s, {"loss": v})
            sink.log(last_step, metrics)


def _check_same_model(saved: dict[str, Any], current: ModelConfig, path: Any) -> None:
    """The architecture only (shapes and what the forward computes), never bookkeeping or the
    training losses' weights: continuing a model with other loss weights is a training choice."""
    try:
        there = ModelConfig.from_dict(saved).validate().architecture()
    except ConfigError as exc:
        raise CheckpointError(f"{path}: its model config is not one this version reads ({exc})") from None
    here = current.architecture()
    diffs = [k for k in here if there.get(k) != here[k]]
    if diffs:
        k = diffs[0]
        raise CheckpointError(f"{path}: written for a different model (model.{k}={there.get(k)!r} there, {here[k]!r} here)")
