"""The checkpoint cadence (``checkpoint.every``); the saving itself is the trainer's."""

from __future__ import annotations

from typing import Any

from moe.train.callbacks.callback import Callback


class CheckpointCallback(Callback):
    """The checkpoint cadence: a checkpoint after every ``checkpoint.every`` steps (0: none on the
    way) and after the run's last step; the saving is the trainer's."""

    def __init__(self, every: int) -> None:
        self.every = every

    def on_step_end(self, trainer: Any, step: int, last: bool) -> None:
        if last or (self.every and step % self.every == 0):
            trainer.checkpoint()
