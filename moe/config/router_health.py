"""When a router counts as collapsed (``train.router_health``)."""

from __future__ import annotations

import dataclasses

from moe.config.base import Config, require


@dataclasses.dataclass
class RouterHealthConfig(Config):
    """Per MoE layer at a log point: the balance loss has covered ``lb_fraction`` of the way
    from 1 (balanced) to its maximum ``num_experts / top_k`` (every token on the same top_k
    experts), or, after the learning-rate warm-up, the router z-loss has grown ``z_growth``
    times its first logged value and risen at ``z_rising`` log points in a row."""

    enabled: bool = True
    lb_fraction: float = 0.5
    z_growth: float = 4.0
    z_rising: int = 3

    def _check(self, p: str) -> None:
        k = lambda name: f"{p}.{name}" if p else name  # noqa: E731
        require(0 < self.lb_fraction <= 1, k("lb_fraction"), f"must lie in (0, 1], got {self.lb_fraction}")
        require(self.z_growth > 1, k("z_growth"), f"must be > 1, got {self.z_growth}")
        require(self.z_rising >= 1, k("z_rising"), f"must be >= 1, got {self.z_rising}")
