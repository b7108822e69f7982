"""``train.profile_step``: one step under torch.profiler (moe.train.step_profile)."""

from __future__ import annotations

from typing import Any

from moe.train.callbacks.callback import Callback
from moe.train.step_profile import StepProfiler


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
