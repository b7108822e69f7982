"""Thresholds of the token-gerrymandering alarm (``train.load_alarm``)."""

from __future__ import annotations

import dataclasses

from moe.config.base import Config, require


@dataclasses.dataclass
class LoadAlarmConfig(Config):
    """Per MoE layer, over the last ``window`` log points: the balance loss falls (or stays
    within ``lb_near_one`` of 1) while the measured max/mean tokens per expert rises by at
    least ``min_rise`` along a consistent trend (correlation with the step >= ``min_corr``)
    at ``confirm`` consecutive log points; or max/mean exceeds ``ceiling`` at ``confirm``
    consecutive log points. A layer warns once per episode (again only after ``window`` quiet
    log points). The defaults stay quiet on the default params.yaml run
    (whose interval max/mean wanders 1.1-1.9 without a trend) and fire on a sustained drift."""

    enabled: bool = True
    # Log points in the trend fit (the trend covers window * train.log_every steps).
    window: int = 10
    # Fitted rise of max/mean over the window (1.0 = the busiest expert carries the average).
    min_rise: float = 0.3
    # Pearson correlation of max/mean with the step over the window: a trend, not noise.
    min_corr: float = 0.8
    # Consecutive log points the trend must hold before the alarm fires (a drift persists,
    # a chance run of noisy intervals does not).
    confirm: int = 3
    # The balance loss counts as "near 1" (hiding the imbalance) while it stays below 1 + this.
    lb_near_one: float = 0.05
    # Fire when the busiest expert carries more than this many times the average (at
    # ``confirm`` log points in a row).
    ceiling: float = 2.5
    # Watch the log points of the learning-rate warm-up too (schedule.warmup_steps): the load
    # moves fast there on every healthy run, so by default the alarm starts after it.
    during_warmup: bool = False

    def _check(self, p: str) -> None:
        k = lambda name: f"{p}.{name}" if p else name  # noqa: E731
        require(self.window >= 3, k("window"), f"must be >= 3 log points, got {self.window}")
        require(self.confirm >= 1, k("confirm"), f"must be >= 1, got {self.confirm}")
        require(self.min_rise > 0, k("min_rise"), f"must be > 0, got {self.min_rise}")
        require(0 <= self.min_corr <= 1, k("min_corr"), f"must lie in [0, 1], got {self.min_corr}")
        require(self.lb_near_one >= 0, k("lb_near_one"), f"must be >= 0, got {self.lb_near_one}")
        require(self.ceiling > 1, k("ceiling"), f"must be > 1 (max/mean is >= 1), got {self.ceiling}")
