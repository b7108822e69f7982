"""The token-gerrymandering alarm: the balance loss looks fine while the real load drifts.

The paper's finding: the load-balancing loss improved while the busiest experts took ever
more of the tokens, so a run that watches only the balance loss drifts into stragglers.
Per MoE layer, over the last ``window`` log points, this compares the trend of the balance
loss (``lb_loss/layer_L``) with the trend of the measured max/mean tokens per expert
(``expert_load_max_over_mean/layer_L``) and fires when the loss falls or stays near 1 while
max/mean rises consistently, or when max/mean crosses a ceiling. It works on the host floats
of a log point only (no device access).
"""

from __future__ import annotations

import collections
import dataclasses
import math

from moe.config.load_alarm import LoadAlarmConfig

LB_KEY = "lb_loss/layer_{}"
LOAD_KEY = "expert_load_max_over_mean/layer_{}"
TAG = "moe.load_alarm"


@dataclasses.dataclass
class Trend:
    first: float  # fitted value at the window's first step
    last: float  # fitted value at the window's last step
    corr: float  # Pearson correlation with the step (0 when either is constant)

    @property
    def change(self) -> float:
        return self.last - self.first


def fit_trend(steps: list[int], values: list[float]) -> Trend:
    """Least-squares line through (step, value)."""
    n = len(steps)
    mx, my = sum(steps) / n, sum(values) / n
    sxx = sum((x - mx) ** 2 for x in steps)
    syy = sum((y - my) ** 2 for y in values)
    sxy = sum((x - mx) * (y - my) for x, y in zip(steps, values, strict=True))
    slope = sxy / sxx if sxx > 0 else 0.0
    corr = sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else 0.0
    return Trend(my + slope * (steps[0] - mx), my + slope * (steps[-1] - mx), corr)


@dataclasses.dataclass
class AlarmEvent:
    layer: str
    step: int
    reason: str  # "trend" or "ceiling"
    first_step: int
    lb: Trend
    load: Trend
    load_now: float

    def message(self) -> str:
        span = f"steps {self.first_step}-{self.step}"
        lb = f"balance loss {self.lb.first:.3f} -> {self.lb.last:.3f} ({self.lb.change:+.3f})"
        load = f"max/mean tokens per expert {self.load.first:.2f} -> {self.load.last:.2f} ({self.load.change:+.2f}, r={self.load.corr:.2f})"
        head = f"token gerrymandering alarm: layer {self.layer} at step {self.step}"
        if self.reason == "ceiling":
            return f"{head}: max/mean tokens per expert {self.load_now:.2f} is over the ceiling; {lb}, {load} over {span}"
        return f"{head}: {lb} while {load} over {span}"


class LoadAlarm:
    """Feed it every log point's metrics; it returns the layers that enter the alarm state."""

    def __init__(self, cfg: LoadAlarmConfig) -> None:
        self.cfg = cfg
        self.history: dict[str, collections.deque] = {}
        self.active: dict[str, AlarmEvent] = {}
        self.fired: dict[str, AlarmEvent] = {}  # each layer's first alarm
        self.streak: dict[str, int] = {}  # consecutive log points the trend condition held
        self.over: dict[str, int] = {}  # consecutive log points over the ceiling
        self.quiet: dict[str, int] = {}  # consecutive log points out of the alarm state

    def update(self, step: int, metrics: dict[str, float]) -> list[AlarmEvent]:
        new = []
        for layer in sorted(self._layers(metrics), key=lambda s: int(s) if s.isdigit() else s):
            hist = self.history.setdefault(layer, collections.deque(maxlen=self.cfg.window))
            hist.append((step, metrics[LB_KEY.format(layer)], metrics[LOAD_KEY.format(layer)]))
            event = self._check(layer, hist)
            if event is None:
                self.active.pop(layer, None)
                self.quiet[layer] = self.quiet.get(layer, 0) + 1
                continue
            # a layer that left the alarm state warns again only after a window of quiet log
            # points: a load hovering at the ceiling is one event, not one per crossing
            if layer not in self.active and (layer not in self.fired or self.quiet.get(layer, 0) >= self.cfg.window):
                new.append(event)
                self.fired.setdefault(layer, event)
            self.quiet[layer] = 0
            self.active[layer] = event
        return new

    def metrics(self) -> dict[str, float]:
        """0/1 per layer (in the alarm state now) and the number of such layers."""
        out = {f"load_alarm/layer_{layer}": float(layer in self.active) for layer in self.history}
        out["load_alarm"] = float(len(self.active))
        return out

    @staticmethod
    def _layers(metrics: dict[str, float]) -> list[str]:
        prefix = LOAD_KEY.format("")
        return [k[len(prefix) :] for k in metrics if k.startswith(prefix) and LB_KEY.format(k[len(prefix) :]) in metrics]

    def _check(self, layer: str, hist: collections.deque) -> AlarmEvent | None:
        cfg = self.cfg
        steps = [s for s, _, _ in hist]
        lbs = [v for _, v, _ in hist]
        loads = [v for _, _, v in hist]
        lb, load = fit_trend(steps, lbs), fit_trend(steps, loads)
        self.over[layer] = self.over.get(layer, 0) + 1 if loads[-1] > cfg.ceiling else 0
        if self.over[layer] >= cfg.confirm:  # sustained, not one noisy interval
            return AlarmEvent(layer, steps[-1], "ceiling", steps[0], lb, load, loads[-1])
        if len(hist) < cfg.window:
            return None
        lb_hides = lb.change < 0 or max(lbs) <= 1 + cfg.lb_near_one
        load_rises = load.change >= cfg.min_rise and load.corr >= cfg.min_corr
        self.streak[layer] = self.streak.get(layer, 0) + 1 if lb_hides and load_rises else 0
        if self.streak[layer] >= cfg.confirm:
            return AlarmEvent(layer, steps[-1], "trend", steps[0], lb, load, loads[-1])
        return None
