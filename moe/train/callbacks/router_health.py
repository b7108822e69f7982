"""``train.router_health``: router collapse (moe.train.router_health) at every log point."""

from __future__ import annotations

import logging
from typing import Any

from moe.train.callbacks.callback import Callback
from moe.train.router_health import TAG as ROUTER_HEALTH_TAG
from moe.train.router_health import RouterHealth

log = logging.getLogger("moe.train")


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
