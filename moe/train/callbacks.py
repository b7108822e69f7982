"""The trainer's side jobs, behind one seam (as OLMo-core's train/callbacks/), so the loop stays
short: a callback may add metrics after a step (in-loop evaluation: the step becomes a log
point) and read or extend every log point's metrics (the load alarm)."""

from __future__ import annotations

import logging
from typing import Any

from moe.train.load_alarm import TAG as LOAD_ALARM_TAG
from moe.train.load_alarm import LoadAlarm
from moe.train.router_health import TAG as ROUTER_HEALTH_TAG
from moe.train.router_health import RouterHealth

log = logging.getLogger("moe.train")


class Callback:
    """A side job of the trainer; every hook does nothing unless a subclass says otherwise."""

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
