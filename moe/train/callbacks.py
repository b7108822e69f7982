"""The trainer's side jobs, behind one seam (as OLMo-core's train/callbacks/), so the loop stays
short: a callback may watch a step as it runs (the step profile), add metrics after a step
(in-loop evaluation: the step becomes a log point), read or extend every log point's metrics
(the load alarm) and act once a step is complete (the checkpoint cadence)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from moe.config import ExperimentConfig
from moe.train.load_alarm import TAG as LOAD_ALARM_TAG
from moe.train.load_alarm import LoadAlarm
from moe.train.router_health import TAG as ROUTER_HEALTH_TAG
from moe.train.router_health import RouterHealth
from moe.train.step_profile import StepProfiler

log = logging.getLogger("moe.train")


class Callback:
    """A side job of the trainer; every hook does nothing unless a subclass says otherwise.
    ``step`` counts from 1: the step about to run (untimed, before_step), else the one just run."""

    def untimed(self, step: int) -> bool:
        """Whether step ``step`` itself stays out of the throughput (it runs under a profiler):
        the trainer finishes the steps queued before it, then counts the time from before_step
        to the end of after_step as the callbacks', not training time."""
        return False

    def before_step(self, trainer: Any, step: int) -> None:
        """Just before step ``step`` runs."""
        return None

    def due(self, step: int) -> bool:
        """Whether after_step does work at ``step`` (the trainer then keeps its time out of the
        step's throughput: the device is synchronised before and the callback timed)."""
        return False

    def after_step(self, trainer: Any, step: int) -> dict[str, float] | None:
        """Metrics of this step to log now (None: nothing; most steps)."""
        return None

    def on_log(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        """Every log point's metrics, before the sinks see them (may add to them)."""
        return None

    def on_step_end(self, trainer: Any, step: int, last: bool) -> None:
        """The step is complete: logged where it is a log point, and not the one a stop request
        ended the run at (that one the trainer checkpoints itself). ``last``: the run's last step."""
        return None


class StepProfileCallback(Callback):
    """``train.profile_step``: that step under torch.profiler; where its time went joins the
    step's metrics (``profile/*``, moe.train.step_profile) and its time, slowed by the profiler,
    stays out of the throughput. First among the callbacks: it brackets the step alone."""

    def __init__(self, step: int) -> None:
        self.step = step
        self._profiler: StepProfiler | None = None

    def untimed(self, step: int) -> bool:
        return step == self.step

    def before_step(self, trainer: Any, step: int) -> None:
        if step == self.step:
            self._profiler = StepProfiler(trainer.device).start()

    def due(self, step: int) -> bool:
        return step == self.step and self._profiler is not None

    def after_step(self, trainer: Any, step: int) -> dict[str, float] | None:
        profiler, self._profiler = self._profiler, None
        return profiler.stop() if profiler is not None else None


class CheckpointCallback(Callback):
    """The checkpoint cadence: a checkpoint after every ``checkpoint.every`` steps (0: none on the
    way) and after the run's last step; the saving is the trainer's."""

    def __init__(self, every: int) -> None:
        self.every = every

    def on_step_end(self, trainer: Any, step: int, last: bool) -> None:
        if last or (self.every and step % self.every == 0):
            trainer.checkpoint()


class LoadAlarmCallback(Callback):
    """The token-gerrymandering alarm: a warning line and an MLflow tag per layer entering it."""

    def __init__(self, alarm: LoadAlarm) -> None:
        self.alarm = alarm

    def on_log(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        if step <= trainer.cfg.schedule.warmup_steps and not self.alarm.cfg.during_warmup:
            metrics.update(self.alarm.metrics())  # the learning-rate warm-up: not watched
            return
        for event in self.alarm.update(step, metrics):
            if trainer.env.is_main:
                log.warning("%s", event.message())
            trainer.tag({LOAD_ALARM_TAG: "fired", f"{LOAD_ALARM_TAG}.layer_{event.layer}": event.message()})
        metrics.update(self.alarm.metrics())


class RouterHealthCallback(Callback):
    """Router collapse: one warning line with the likely cause and the knob, the MLflow tag
    ``moe.router_health`` (``collapse`` with the line as ``moe.router_health.message``), and the
    metric ``router_collapse`` (1 while some layer is collapsed)."""

    def __init__(self, health: RouterHealth) -> None:
        self.health = health

    def on_log(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        warmup = trainer.cfg.schedule.warmup_steps
        event = self.health.update(step, metrics, after_warmup=step > warmup)
        if event is not None:
            line = event.message(trainer.cfg.optim.lr, warmup)
            if trainer.env.is_main:
                log.warning("%s", line)
            trainer.tag({ROUTER_HEALTH_TAG: "collapse", f"{ROUTER_HEALTH_TAG}.message": line})
        metrics["router_collapse"] = self.health.state


def trainer_callbacks(cfg: ExperimentConfig, callbacks: Sequence[Callback] = ()) -> list[Callback]:
    """The trainer's callbacks in the order their hooks run: the step profile first (it brackets
    the step alone, so no other callback's work is profiled), the caller's, the monitors the
    config turns on, and the checkpoint cadence last (a step is saved once the others saw it)."""
    out: list[Callback] = [StepProfileCallback(cfg.train.profile_step)] if cfg.train.profile_step else []
    out += callbacks
    if cfg.train.load_alarm.enabled:
        out.append(LoadAlarmCallback(LoadAlarm(cfg.train.load_alarm)))
    if cfg.train.router_health.enabled:
        moe = cfg.model.moe
        out.append(RouterHealthCallback(RouterHealth(cfg.train.router_health, moe.num_experts, moe.top_k)))
    if cfg.checkpoint.save:
        out.append(CheckpointCallback(cfg.checkpoint.every))
    return out
