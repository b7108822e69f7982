"""One training process's lifecycle, shared by both entry points (``python -m moe.train`` and
the pipeline's worker): the determinism environment before anything starts CUDA or NCCL, the
trainer and its run, expected failures turned into an exit code and one message, and the
distributed teardown, collective only after a run every rank finished."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from moe.config import ExperimentConfig, ResolvedLayout
from moe.errors import exit_code_of
from moe.parallel.env import shutdown_distributed
from moe.train.determinism import set_environment
from moe.train.trainer import Trainer, TrainSummary

T = TypeVar("T")


def train(
    cfg: ExperimentConfig, sinks: Sequence = (), callbacks: Sequence = (), stop=None, resolved: ResolvedLayout | None = None
) -> tuple[Trainer, TrainSummary]:
    """Build the trainer (after the deterministic mode's environment, when the config asks for
    it) and run it; (the trainer, its summary). ``resolved``: the layout the job carries (None:
    resolved against this world when the trainer builds its layout)."""
    if cfg.train.deterministic_kernels:
        set_environment()
    trainer = Trainer(cfg, sinks=list(sinks), callbacks=list(callbacks), resolved=resolved)
    return trainer, trainer.fit(stop=stop)


def run_process(body: Callable[[], T]) -> tuple[int, T | None, str | None]:
    """Run a training process's ``body``: (0, its result, None); for an expected failure
    (moe.errors) (its exit code, None, its message); a bug propagates. Either way the process
    group is torn down, collectively only when ``body`` returned."""
    clean = False
    try:
        result = body()
        clean = True
        return 0, result, None
    except Exception as exc:
        code = exit_code_of(exc)
        if code is None:
            raise
        return code, None, str(exc)
    finally:
        shutdown_distributed(clean=clean)
