"""The trainer's side jobs, behind one seam (as OLMo-core's train/callbacks/), so the loop stays
short: a callback may watch a step as it runs (the step profile), add metrics after a step
(in-loop evaluation: the step becomes a log point), read or extend every log point's metrics
(the load alarm) and act once a step is complete (the checkpoint cadence). One module each;
this face lists them in the order their hooks run."""

from __future__ import annotations

from collections.abc import Sequence

from moe.config import ExperimentConfig
from moe.train.callbacks.callback import Callback
from moe.train.callbacks.checkpoint import CheckpointCallback
from moe.train.callbacks.load_alarm import LoadAlarmCallback
from moe.train.callbacks.router_health import RouterHealthCallback
from moe.train.callbacks.step_profile import StepProfileCallback
from moe.train.load_alarm import LoadAlarm
from moe.train.router_health import RouterHealth

__all__ = ["Callback", "CheckpointCallback", "LoadAlarmCallback", "RouterHealthCallback", "StepProfileCallback", "trainer_callbacks"]


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
