"""Stop requests from signals (e.g. Slurm's USR2 before the time limit or a preemption).

The handler only sets a flag; the trainer looks at it between steps, all ranks agree over a
CPU (gloo) group so that none stops alone, then it saves a checkpoint and returns."""

from __future__ import annotations

import signal
from collections.abc import Iterable

import torch
import torch.distributed as dist


class StopRequest:
    def __init__(self) -> None:
        self.requested = False
        self.signum: int | None = None
        self._group: dist.ProcessGroup | None = None

    def install(self, signals: Iterable[int] = (signal.SIGUSR2,)) -> StopRequest:
        for s in signals:
            signal.signal(s, self._handler)
        return self

    def _handler(self, signum, frame) -> None:
        self.requested = True
        self.signum = signum

    def agreed(self) -> bool:
        """True on every rank when any rank was asked to stop (a tiny CPU collective). The
        collective carries the signal's number, so a rank that learns of the stop from another
        names the signal too (each rank's log says why it stopped)."""
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return self.requested
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        own = (self.signum or -1) if self.requested else 0  # -1: asked without a signal number
        flag = torch.tensor([own], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        agreed = int(flag.item())
        if agreed and self.signum is None and agreed > 0:
            self.signum = agreed
        return agreed != 0
