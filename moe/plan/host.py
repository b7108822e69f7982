"""Before a local CPU run: refuse one whose weights and optimizer state alone exceed this
machine's memory, before anything is allocated."""

from __future__ import annotations

from pathlib import Path

from moe.config import ExperimentConfig
from moe.errors import PlanError
from moe.hardware import GIB
from moe.plan.accounting import param_counts


def host_memory_gib(cfg: ExperimentConfig, processes: int) -> float:
    """A lower bound of what training on CPUs holds: every process a replica of the fp32 weights,
    their gradients and AdamW moments (16 bytes a parameter), and each layer's RoPE tables.
    Activations come on top; the point is to refuse what cannot fit before allocating it."""
    total = param_counts(cfg.model).total
    rope = cfg.model.n_layers * 2 * cfg.model.max_seq_len * cfg.model.head_dim * 4
    return processes * (16 * total + rope) / GIB


def available_host_gib() -> float | None:
    """MemAvailable of this machine (Linux), else None."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 / GIB
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_host_memory(cfg: ExperimentConfig, processes: int) -> None:
    """Refuse a CPU run whose weights and optimizer state alone exceed the memory available."""
    need, have = host_memory_gib(cfg, processes), available_host_gib()
    if have is not None and need > have:
        raise PlanError(
            f"model: training it on the CPU needs at least {need:.1f} GiB ({processes} process(es) x fp32 weights, "
            f"gradients and AdamW moments of {param_counts(cfg.model).total / 1e6:.1f}M parameters), but {have:.1f} GiB "
            "is available here: use a smaller model (model.preset=tiny, fewer layers) or a GPU (`moe plan --gpu h100`)"
        )
