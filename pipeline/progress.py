"""Progress as lines a log can hold (`make repro`, CI, a Slurm log), where no bar is drawn: the
first unit's line at once, then at most one every ``every`` seconds, each with its rate and the
time left. The stage's own result line says when it is done."""

from __future__ import annotations

import time
from collections.abc import Callable

EVERY_S = 10.0  # a long command shows progress within this (issue 51)


class Every:
    """True at the first call, then once ``every`` seconds have passed since the last True."""

    def __init__(self, every: float = EVERY_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.every, self.clock, self.last = every, clock, None

    def __call__(self) -> bool:
        now = self.clock()
        if self.last is not None and now - self.last < self.every:
            return False
        self.last = now
        return True


def seconds(s: float) -> str:
    """``42 s``, ``3 min 5 s``, ``2 h 10 min``: a duration as a reader takes it in."""
    s = max(0, round(s))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"


class ProgressLines:
    """``update(done, total)``: the line ``<what>: 12 of 162 <unit> (3.1/s, about 48 s left)``,
    when ``due``; none for the last unit (the result line follows). The rate counts from the
    first unit: what came before it (a tokenizer trained, a model loaded) is no unit's time."""

    def __init__(self, what: str, unit: str, say: Callable[[str], None], due: Callable[[], bool] | None = None, clock=time.monotonic) -> None:
        self.what, self.unit, self.say, self.clock = what, unit, say, clock
        self.due = due or Every(clock=clock)
        self.first: tuple[int, float] | None = None

    def __call__(self, done: int, total: int | None) -> None:
        now = self.clock()
        if self.first is None:
            self.first = (done, now)
        if (total is not None and done >= total) or not self.due():
            return
        of = f" of {total}" if total else ""
        units, took = done - self.first[0], now - self.first[1]
        if units <= 0 or took <= 0:
            self.say(f"{self.what}: {done}{of} {self.unit}")
            return
        rate = units / took
        left = f", about {seconds((total - done) / rate)} left" if total else ""
        self.say(f"{self.what}: {done}{of} {self.unit} ({rate:.3g}/s{left})")
