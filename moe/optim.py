"""AdamW over fp32 master weights, with device-side skipping of non-finite steps.

When the model's parameters are bf16, each gets an fp32 master copy; gradients are
accumulated into the master's fp32 ``.grad`` by a post-accumulate hook (so gradient
accumulation over micro-batches happens in fp32), and after the step the masters are copied
back into the bf16 parameters. With fp32 parameters the master *is* the parameter.
The expert weights meet the optimizer through one declared call, :meth:`MasterWeightAdamW.bind_expert`
(made by the precision recipe, moe.precision.PrecisionRecipe.attach_optimizer, which hands the
sink it returns to the expert GEMM): ``expert_grad_accum="bf16"`` keeps their gradient in bf16
until the step's last micro-batch (``last_micro_batch``) or the gradient sync
(``fold_deferred``), whichever comes first; ``expert_wgrad="gemm"`` gives each a gradient sink
that its weight-gradient GEMM adds into, and ``"paired"`` one that holds a micro-batch's rows
for the next micro-batch's GEMM (one GEMM, one accumulator pass, per two micro-batches).

The state is keyed by parameter name, so checkpoints do not depend on the parallel layout.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import torch
from torch import nn

from moe.config import ConfigError, OptimizerConfig, ScheduleConfig
from moe.kernels import adamw
from moe.kernels.grad_add import accumulate_fp32
from moe.spans import span
from moe.switches import choice

# The expert gradients' sums of squares from their last wgrad GEMM's epilogue (the gradient norm
# without a pass over them); MOE_EXPERT_GRAD_SQUARES=foreach keeps the norm's own pass.
EPILOGUE_SQUARES = choice("MOE_EXPERT_GRAD_SQUARES") == "epilogue"


@dataclasses.dataclass
class MasterParam:
    name: str
    param: nn.Parameter  # the model's parameter (any dtype)
    # fp32 weights AdamW steps (the parameter itself when it is fp32); None when another
    # data-parallel rank owns this parameter (ZeRO-1)
    master: torch.Tensor | None
    # the tensor whose .grad holds this parameter's fp32 gradient
    grad_holder: torch.Tensor
    # a stacked expert weight (bind_expert); deferred: its bf16 gradient waits for the step's
    # last micro-batch (expert_grad_accum bf16)
    expert: bool = False
    deferred: bool = False

    @property
    def owned(self) -> bool:
        return self.master is not None

    @property
    def grad(self) -> torch.Tensor | None:
        return self.grad_holder.grad


def _no_decay(name: str, param: torch.Tensor, decay_embeddings: bool) -> bool:
    if param.ndim < 2:
        return True  # norm weights, biases
    return not decay_embeddings and (name.endswith("embed.weight"))


class MasterWeightAdamW:
    """``owns(name, param)`` says whether this rank keeps the fp32 master and the AdamW
    moments of a parameter (ZeRO-1); by default every rank owns everything."""

    def __init__(
        self,
        model: nn.Module,
        cfg: OptimizerConfig,
        master_weights: bool,
        owns: Callable[[str, nn.Parameter], bool] | None = None,
    ) -> None:
        self.params: list[MasterParam] = []
        self.cfg = cfg
        # parameters whose bf16 gradient waits for the last micro-batch (expert_grad_accum bf16)
        self.deferred: list[MasterParam] = []
        self.sinks: list[_Sink] = []
        # parameters whose own low-precision values were dropped (release_weight): never written
        self.released: set[int] = set()
        self._fold_now = False
        self._use_triton: bool | None = None  # decided at the first step (_triton_steps)
        self._lr_on_device: dict[int, torch.Tensor] = {}  # id(group) -> its lr (keep_lr_on_device)
        if cfg.expert_grad_accum == "bf16" and not master_weights:
            raise ConfigError("optim.expert_grad_accum: bf16 needs bf16 weights with fp32 masters (precision.recipe bf16 or an fp8 recipe)")
        seen: set[int] = set()
        for name, param in model.named_parameters():
            if not param.requires_grad or id(param) in seen:
                continue  # tied weights appear once, under their first name
            seen.add(id(param))
            owned = owns is None or owns(name, param)
            low_precision = master_weights and param.dtype != torch.float32
            if not low_precision:
                master, holder = (param if owned else None), param
            elif owned:
                master = holder = param.detach().float().clone().requires_grad_(True)
            else:  # only an fp32 gradient accumulator; a stride-0 leaf costs no memory
                master = None
                holder = torch.zeros(1, dtype=torch.float32, device=param.device).expand(param.shape).requires_grad_(True)
            entry = MasterParam(name, param, master, holder)
            if holder is not param:
                param.register_post_accumulate_grad_hook(self._accumulate_hook(entry))
            self.params.append(entry)
        owned_params = [p for p in self.params if p.owned]
        decay = [p.master for p in owned_params if not _no_decay(p.name, p.master, cfg.decay_embeddings)]
        no_decay = [p.master for p in owned_params if _no_decay(p.name, p.master, cfg.decay_embeddings)]
        groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        groups = [g for g in groups if g["params"]]
        if not groups:  # this rank owns nothing: keep a placeholder so the schedule still works
            device = self.params[0].param.device if self.params else torch.device("cpu")
            groups = [{"params": [torch.zeros(0, device=device, requires_grad=True)], "weight_decay": 0.0}]
        devices = {g["params"][0].device.type for g in groups}
        if not devices <= {"cpu", "cuda"}:
            raise ValueError(f"the fused AdamW runs on cpu and cuda only, not {sorted(devices)}")
        # fused: one kernel for all tensors, and it honours found_inf (device-side skip).
        self.inner = torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=True)

    @property
    def masters(self) -> list[torch.Tensor]:
        return [p.master for p in self.params if p.owned]

    def grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.params if p.grad is not None]

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad_holder.grad = None
            p.param.grad = None
        for sink in self.sinks:
            sink.pending = None  # rows held from a step that did not finish
            sink.squares = None
        self._fold_now = False

    def grad_squares(self) -> dict[int, torch.Tensor]:
        """id(gradient) -> partial sums whose total is its sum of squares, for the expert
        gradients whose last GEMM reported them this step (MOE_EXPERT_GRAD_SQUARES=epilogue):
        what a norm over this process's gradients may use instead of reading them."""
        return {id(s.entry.grad): s.squares for s in self.sinks if s.squares is not None and s.entry.grad is not None}

    def last_micro_batch(self) -> None:
        """The next backward is the step's last: deferred bf16 gradients go to their fp32
        holders as each is produced (so an overlapped gradient reduction finds them there)."""
        self._fold_now = True

    @torch.no_grad()
    def fold_deferred(self) -> None:
        """Every deferred bf16 gradient still waiting goes to its fp32 holder (before the
        gradient sync; a no-op when the last backward already folded them)."""
        for sink in self.sinks:
            sink.flush()  # rows held for a pair that did not come (before any fold)
        for p in self.deferred:
            if p.param.grad is not None:
                _fold(p)
        self._fold_now = False

    def bind_expert(self, param: nn.Parameter) -> _Sink | None:
        """Declare ``param`` a stacked expert weight (once, before training): with
        ``expert_grad_accum: bf16`` its gradient waits in bf16 for the step's last micro-batch;
        returns the gradient sink its weight-gradient GEMM adds into (``expert_wgrad: gemm``,
        a parameter with a separate fp32 gradient holder), else None (autograd and this
        optimizer's hook take the gradient). A parameter the optimizer does not step: None."""
        entry = next((p for p in self.params if p.param is param), None)
        if entry is None or entry.grad_holder is param:
            return None
        if entry.expert:
            raise ValueError(f"bind_expert: {entry.name} is bound already")
        entry.expert = True
        if self.cfg.expert_grad_accum == "bf16":
            entry.deferred = True
            self.deferred.append(entry)
        if self.cfg.expert_wgrad == "separate":
            return None
        sink = _Sink(self, entry, paired=self.cfg.expert_wgrad == "paired")
        self.sinks.append(sink)
        return sink

    def _accumulate_hook(self, p: MasterParam) -> Callable[[torch.Tensor], None]:
        """Each micro-batch's low-precision gradient into the fp32 holder, or, for a deferred
        expert weight, at the step's last micro-batch only (before it autograd adds the next
        micro-batch's gradient in bf16)."""
        add = _accumulate_into(p.grad_holder)

        def hook(param: torch.Tensor) -> None:
            if not p.deferred:
                add(param)
            elif self._fold_now:
                _fold(p)

        return hook

    @torch.no_grad()
    def step(self, found_inf: torch.Tensor | None = None, grad_scale: torch.Tensor | None = None) -> None:
        """One AdamW step of the owned masters; where ``found_inf`` (a device scalar) is 1 the
        update is skipped on the device, with no host sync. ``grad_scale`` (a device scalar,
        e.g. the clipping coefficient) multiplies every gradient inside the fused kernel, which
        saves a pass over all gradients (4 ms per step for 1.9B fp32 gradients on an H200)."""
        if self._triton_steps():
            with span("optimizer"):  # no torch optimizer range around these launches
                self._step_triton(found_inf, grad_scale)
            self._mark_written()
            return
        if found_inf is not None:
            self.inner.found_inf = found_inf.float()  # read by the fused kernel
        if grad_scale is not None:
            self.inner.grad_scale = 1.0 / grad_scale.float()  # the kernel divides by it
        try:
            self.inner.step()
        finally:
            self.inner.found_inf = self.inner.grad_scale = None
        copies = [(p.param, p.master) for p in self._mirrored()]
        if copies:
            torch._foreach_copy_([a for a, _ in copies], [b for _, b in copies])
        self._mark_written()

    def keep_lr_on_device(self) -> None:
        """From now on the Triton step reads each group's learning rate from a device scalar that
        :meth:`write_lr` refreshes from the group before every step: what a captured step (a CUDA
        graph, which would replay the captured float forever) needs to follow the schedule."""
        if not self._triton_steps():
            raise ConfigError(
                "train.cuda_graph: the optimizer step must run moe.kernels.adamw "
                "(optim.step_kernel=triton on a GPU, fp32 masters in a form the kernel takes)"
            )
        device = self.inner.param_groups[0]["params"][0].device
        self._lr_on_device = {id(g): torch.zeros((), dtype=torch.float32, device=device) for g in self.inner.param_groups}
        self.write_lr()

    def write_lr(self) -> None:
        """The groups' current learning rates into their device scalars (stream-ordered, no sync)."""
        for group in self.inner.param_groups:
            if id(group) in self._lr_on_device:
                self._lr_on_device[id(group)].fill_(float(group["lr"]))

    def note_updated(self) -> None:
        """The masters were written by a replayed step: what :meth:`step` does on the host after
        its kernels (version counters), done for a step whose kernels a CUDA graph launched."""
        self._mark_written()

    def _triton_steps(self) -> bool:
        """Whether the step runs moe.kernels.adamw (``optim.step_kernel: triton``, every owned
        master and its bf16 copy in a form the kernel takes, plain float hyperparameters)."""
        if self._use_triton is None:
            mirrors = {id(p.master): p.param for p in self._mirrored()}
            groups = self.inner.param_groups
            self._use_triton = (
                self.cfg.step_kernel == "triton"
                and any(g["params"] and g["params"][0].numel() for g in groups)
                and all(not isinstance(g["lr"], torch.Tensor) for g in groups)
                and all(adamw.supports(m, m, mirrors.get(id(m))) for g in groups for m in g["params"])
            )
        return self._use_triton

    def _step_triton(self, found_inf: torch.Tensor | None, grad_scale: torch.Tensor | None) -> None:
        """torch's fused AdamW's update and step counting (advance every stepped tensor's
        count, step, take the count back where ``found_inf``), one kernel per tensor that also
        writes the bf16 copy."""
        mirrors = {id(p.master): p.param for p in self._mirrored()}
        found = found_inf.float() if found_inf is not None else None
        grad_div = 1.0 / grad_scale.float() if grad_scale is not None else None
        work = [(g, m) for g in self.inner.param_groups for m in g["params"] if m.grad is not None]
        if not work:
            return
        self.ensure_state()
        steps = [self.inner.state[m]["step"] for _, m in work]
        torch._foreach_add_(steps, 1)
        for group, m in work:
            state = self.inner.state[m]
            adamw.adamw_step(
                m,
                m.grad,
                state["exp_avg"],
                state["exp_avg_sq"],
                state["step"],
                lr=self._lr_on_device.get(id(group), group["lr"]),
                betas=group["betas"],
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                mirror=mirrors.get(id(m)),
                found_inf=found,
                grad_div=grad_div,
            )
        if found is not None:
            torch._foreach_sub_(steps, [found] * len(steps))

    def ensure_state(self) -> None:
        """Create zeroed AdamW state for every owned master (so a checkpoint can load into it)."""
        for p in self.params:
            if not p.owned:
                continue
            state = self.inner.state[p.master]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.master.device)
                state["exp_avg"] = torch.zeros_like(p.master, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p.master, memory_format=torch.preserve_format)

    def named_state(self) -> dict[str, dict[str, torch.Tensor]]:
        self.ensure_state()
        return {p.name: self.inner.state[p.master] for p in self.params if p.owned}

    def named_masters(self) -> dict[str, torch.Tensor]:
        return {p.name: p.master for p in self.params if p.owned}

    @torch.no_grad()
    def sync_params_from_masters(self) -> None:
        for p in self._mirrored():
            p.param.copy_(p.master)
        self._mark_written()

    def _mark_written(self) -> None:
        """Bump the version counters of what a step wrote outside autograd's sight: the fused
        Triton AdamW kernel (and a replayed CUDA graph, or a checkpoint load) writes the masters
        and their bf16 copies without bumping them. Caches keyed on a weight's version (the FP8
        weight copies: released experts read their masters, FP8 dense projections their bf16
        weights) must never outlive the values they were made from; one bump per written tensor
        per step, whichever kernel wrote it (torch's own copies bumped them once already)."""
        for p in self.params:
            if id(p.param) in self.released:
                torch.autograd.graph.increment_version(p.master)
            elif p.owned and p.param is not p.master:
                torch.autograd.graph.increment_version(p.param)

    def _mirrored(self) -> list[MasterParam]:
        """The parameters that hold a low-precision copy of their master."""
        return [p for p in self.params if p.owned and p.param is not p.master and id(p.param) not in self.released]

    def release_weight(self, param: nn.Parameter) -> torch.Tensor:
        """Drop ``param``'s own values and return its fp32 master, which from now on is the only
        copy of them (the step no longer writes the parameter; whoever reads its values reads
        the master, e.g. an FP8 weight cache). The parameter keeps its shape and dtype (it still
        receives gradients) but holds one element. Refused for a parameter this rank does not
        own, or one without a separate master."""
        entry = next((p for p in self.params if p.param is param), None)
        if entry is None or not entry.owned or entry.master is param:
            raise ValueError("release_weight: the parameter has no fp32 master on this rank")
        param.data = torch.zeros((), dtype=param.dtype, device=param.device).expand(param.shape)
        self.released.add(id(param))
        return entry.master


class _Sink:
    """The gradient sink of an expert weight (:meth:`MasterWeightAdamW.bind_expert`; the
    declared interface: moe.layers.gemm.GradientSink): its GEMM adds the
    micro-batch's gradient straight into the fp32 holder, or, with bf16 expert accumulation, into
    the parameter's bf16 gradient until the step's last micro-batch. The GEMM then returns no
    gradient for the weight, and the parameter's post-accumulate hooks still run (a gradient sync
    counts the parameter as ready; the optimizer's own hooks find no bf16 gradient to add): by
    autograd where it runs them for a None gradient, else here."""

    def __init__(self, opt: MasterWeightAdamW, entry: MasterParam, paired: bool = False) -> None:
        self.opt, self.entry, self.paired = opt, entry, paired
        # optim.expert_wgrad=paired: (write_rows, rows) of a micro-batch waiting for the next one
        self.pending: tuple[Callable, tuple] | None = None
        # the step's gradient's sum of squares as partial sums (MOE_EXPERT_GRAD_SQUARES=epilogue):
        # from the GEMM that wrote it last, at the step's last micro-batch; None where not known
        self.squares: torch.Tensor | None = None

    def accumulate_rows(self, rows: tuple, write_rows: Callable[..., torch.Tensor | None]) -> None:
        """A micro-batch's weight-gradient operands (``rows``, e.g. (grad, x, offsets)): their
        GEMM adds into the gradient now (``write_rows(rows, None, buffer, add, squares)``), or,
        paired, the first of two waits and the second's GEMM takes both (``write_rows(rows,
        earlier, buffer, add, squares)``). Not held at the step's last micro-batch
        (``last_micro_batch``), whose GEMM also returns the gradient's sum of squares where
        MOE_EXPERT_GRAD_SQUARES=epilogue; one left waiting is written by ``fold_deferred``."""
        if self.paired and self.pending is None and not self.opt._fold_now:
            self.pending = (write_rows, rows)
            self._run_hooks()
            return
        earlier = self.pending[1] if self.pending is not None else None
        self.pending = None
        last = self.opt._fold_now and EPILOGUE_SQUARES
        squares = self._write(lambda buf, add: write_rows(rows, earlier, buf, add, last))
        self.squares = squares if last else None
        self._run_hooks()

    def flush(self) -> None:
        """The rows still waiting for a pair, written alone (hooks not run again)."""
        if self.pending is not None:
            write_rows, rows = self.pending
            self.pending = None
            self._write(lambda buf, add: write_rows(rows, None, buf, add, False))
            self.squares = None

    def accumulate(self, write: Callable[[torch.Tensor, bool], object]) -> None:
        self._write(write)
        self.squares = None  # a GEMM that does not report its sums
        self._run_hooks()

    def _write(self, write: Callable[[torch.Tensor, bool], object]):
        """``write(buffer, add)`` into the fp32 holder (or, deferred and before the last
        micro-batch, the bf16 gradient); what it returned."""
        p = self.entry
        if p.deferred and not self.opt._fold_now:
            into, dtype = p.param, p.param.dtype
        else:
            if p.deferred and p.param.grad is not None:
                _fold(p)  # the bf16 sum of the earlier micro-batches first
            into, dtype = p.grad_holder, torch.float32
        if into.grad is None:
            buf = torch.empty(p.param.shape, dtype=dtype, device=p.param.device)
            result = write(buf, False)
            into.grad = buf
            return result
        return write(into.grad, True)

    def _run_hooks(self) -> None:
        p = self.entry
        if not _autograd_runs_hooks_without_grad():
            for hook in tuple((getattr(p.param, "_post_accumulate_grad_hooks", None) or {}).values()):
                hook(p.param)


@functools.cache
def _autograd_runs_hooks_without_grad() -> bool:
    """Whether autograd runs a leaf's post-accumulate hooks when its gradient comes back None
    (torch 2.13 does): then the sink must not run them a second time. Asked once, on three floats."""

    class NoWeightGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return grad * 2, None

    w = torch.zeros(1, requires_grad=True)
    calls = []
    w.register_post_accumulate_grad_hook(calls.append)
    with torch.enable_grad():
        NoWeightGrad.apply(torch.ones(1, requires_grad=True), w).sum().backward()
    return bool(calls)


def _fold(p: MasterParam) -> None:
    """A deferred bf16 gradient (the sum of this step's micro-batches) into the fp32 holder."""
    if p.param.grad is None:  # nothing waiting (the GEMM accumulated into the holder itself)
        return
    with span("grad_accumulation"):
        p.grad_holder.grad = accumulate_fp32(p.grad_holder.grad, p.param.grad)
    p.param.grad = None


def _accumulate_into(master: torch.Tensor) -> Callable[[torch.Tensor], None]:
    """Each micro-batch's bf16 gradient into the fp32 master gradient. After the first, the
    add converts bf16 -> fp32 inside the kernel (the same values as adding ``grad.float()``,
    bitwise): no fp32 temporary the size of every expert weight, which cost a write and a read
    of 4 bytes per parameter per micro-batch (issue 29: that traffic grows with the number of
    experts at a fixed number of tokens)."""

    def hook(param: torch.Tensor) -> None:
        if param.grad is None:  # the GEMM accumulated into the master gradient itself
            return
        with span("grad_accumulation"):
            master.grad = accumulate_fp32(master.grad, param.grad)
        param.grad = None

    return hook


def lr_lambda(schedule: ScheduleConfig, max_steps: int) -> Callable[[int], float]:
    """Multiplier of the base lr after ``step`` optimizer steps: linear warmup, then decay."""
    warmup, floor = schedule.warmup_steps, schedule.min_lr_ratio

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if schedule.decay == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, max_steps - warmup - 1))
        if schedule.decay == "linear":
            return 1.0 - (1.0 - floor) * progress
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def build_scheduler(opt: MasterWeightAdamW, schedule: ScheduleConfig, max_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(opt.inner, lr_lambda(schedule, max_steps))
