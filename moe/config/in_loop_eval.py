"""The in-loop evaluation's own config (``train.eval_*``; the callback
moe.train.callbacks.in_loop_eval takes it whole)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from moe.config.base import Config, require

KEY_PREFIX = "eval_"  # its keys stand flat in the train section: train.eval_every, train.eval_tasks, ...


@dataclasses.dataclass
class InLoopEvalConfig(Config):
    """Every ``every`` steps (0: never): the validation loss over ``val_batches`` micro-batches
    and the ``tasks`` (names of pipeline/eval's tasks or suites), each on a seeded random sample
    of ``limit`` documents (null: all of them) stratified by its source/subject, the same as
    evaluate.limit's for equal seeds and limits. ``truncation``: a context longer than
    model.max_seq_len is "cut" from the left (counted, warned about) or its document "drop"ped.
    ``batch_tokens``: padded tokens per scoring batch."""

    every: int = 0
    tasks: list[str] = dataclasses.field(default_factory=list)
    limit: int | None = 100
    seed: int = 0
    truncation: Literal["cut", "drop"] = "cut"
    val_batches: int = 8
    batch_tokens: int = 16384

    @classmethod
    def of(cls, section: object) -> InLoopEvalConfig:
        """The config from a section that holds its keys flat (TrainConfig's ``eval_*``)."""
        return cls(**{f.name: getattr(section, KEY_PREFIX + f.name) for f in dataclasses.fields(cls)})

    def _check(self, p: str) -> None:
        k = lambda name: f"{p}.{KEY_PREFIX}{name}" if p else KEY_PREFIX + name  # noqa: E731
        require(self.every >= 0, k("every"), f"must be >= 0 (0: no in-loop evaluation), got {self.every}")
        if self.limit is not None:
            require(self.limit >= 1, k("limit"), f"must be >= 1 (or null: every document), got {self.limit}")
        require(0 <= self.seed < 2**63, k("seed"), f"must be >= 0 (and < 2**63), got {self.seed}")
        require(self.truncation in ("cut", "drop"), k("truncation"), f"must be cut or drop, got {self.truncation!r}")
        require(self.val_batches >= 0, k("val_batches"), "must be >= 0")
        require(self.batch_tokens >= 1, k("batch_tokens"), "must be >= 1")
