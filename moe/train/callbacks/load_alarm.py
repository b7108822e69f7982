"""``train.load_alarm``: the token-gerrymandering alarm (moe.train.load_alarm) at every log point."""

from __future__ import annotations

import logging
from typing import Any

from moe.train.callbacks.callback import Callback
from moe.train.load_alarm import TAG as LOAD_ALARM_TAG
from moe.train.load_alarm import LoadAlarm

log = logging.getLogger("moe.train")


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
