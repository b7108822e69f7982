"""The base of the trainer's side jobs: every hook a callback may take, each doing nothing
unless a subclass says otherwise (the callbacks themselves: one module each beside this one)."""

from __future__ import annotations

from typing import Any


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
