"""Router collapse: the balance loss near its maximum, or the router z-loss growing without
bound, reported once in one line with the likely cause and the knob.

The balance loss E/k * sum_i f_i P_i is 1 when balanced and E/k when every token goes to
the same k experts; the router z-loss mean(logsumexp(router logits)^2) starts near
ln(E)^2 and grows when the router's logits run away. Both are what a learning rate too
high for the model does to an OLMoE-width router (issue 28: the tiny recipe's lr 3e-3 on
olmoe-1b-7b took the balance loss to 6.6-8.0 of 8 and the z-loss to 128-195). Host floats of
a log point only, like the load alarm.
"""

from __future__ import annotations

import dataclasses

from moe.config.router_health import RouterHealthConfig

LB_KEY = "lb_loss/layer_{}"
Z_KEY = "z_loss/layer_{}"
TAG = "moe.router_health"


@dataclasses.dataclass
class Collapse:
    step: int
    balance: list[tuple[str, float]]  # (layer, balance loss) over the threshold
    runaway: list[tuple[str, float, float]]  # (layer, z-loss now, its first value)
    lb_max: float

    def message(self, lr: float, warmup_steps: int) -> str:
        parts = []
        if self.balance:
            layers = ", ".join(f"{name} {lb:.2f}" for name, lb in self.balance)
            parts.append(f"balance loss of layer {layers} (max {self.lb_max:g}: every token on the same few experts)")
        if self.runaway:
            layers = ", ".join(f"{name} {z:.1f} (x{z / first:.1f})" for name, z, first in self.runaway)
            parts.append(f"router z-loss of layer {layers}, still rising")
        return (
            f"router collapse at step {self.step}: {'; '.join(parts)}. Likely cause: a learning rate too high for "
            f"this model (optim.lr={lr:g}, schedule.warmup_steps={warmup_steps}); lower optim.lr or use the model's "
            f"recipe (recipe=olmoe-1b-7b uses 4e-4 over 2000 warm-up steps)"
        )


class RouterHealth:
    """Feed it every log point's metrics; it returns a Collapse the first time one is seen."""

    def __init__(self, cfg: RouterHealthConfig, num_experts: int, top_k: int) -> None:
        self.cfg = cfg
        self.lb_max = num_experts / top_k
        self.threshold = 1.0 + cfg.lb_fraction * (self.lb_max - 1.0)
        self.first_z: dict[str, float] = {}
        self.last_z: dict[str, float] = {}
        self.rising: dict[str, int] = {}
        self.reported: Collapse | None = None
        self.state = 0.0  # 1 while some layer is collapsed

    def update(self, step: int, metrics: dict[str, float], after_warmup: bool) -> Collapse | None:
        balance, runaway = [], []
        for name in self._layers(metrics):
            lb = metrics[LB_KEY.format(name)]
            if self.lb_max > 1 and lb >= self.threshold:
                balance.append((name, lb))
            z = metrics.get(Z_KEY.format(name))
            if z is None:
                continue
            self.first_z.setdefault(name, z)
            prev = self.last_z.get(name)
            self.rising[name] = self.rising.get(name, 0) + 1 if prev is not None and z > prev else 0
            self.last_z[name] = z
            grown = z >= self.cfg.z_growth * max(self.first_z[name], 1e-12)
            if after_warmup and grown and self.rising[name] >= self.cfg.z_rising:
                runaway.append((name, z, self.first_z[name]))
        self.state = float(bool(balance or runaway))
        if not self.state or self.reported is not None:
            return None
        self.reported = Collapse(step, balance, runaway, self.lb_max)
        return self.reported

    @staticmethod
    def _layers(metrics: dict[str, float]) -> list[str]:
        prefix = LB_KEY.format("")
        names = [k[len(prefix) :] for k in metrics if k.startswith(prefix)]
        return sorted(names, key=lambda s: int(s) if s.isdigit() else s)
