"""Memory figures are GiB (bytes / 2**30) and their names say so (``*_gib``). Records written
before issue 49 (bench/results, bench/paper/*/results, a run's metrics.jsonl) hold the same GiB
figures under ``*_gb`` names: every reader takes a figure through ``gib`` and keeps reading them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# A GiB figure's name -> the names older records gave the same figure (newest first).
LEGACY_GIB_NAMES: dict[str, tuple[str, ...]] = {
    "peak_mem_gib": ("peak_mem_gb",),
    "mem_at_rest_gib": ("mem_at_rest_gb",),
    "peak_rss_gib": ("peak_rss_gb",),
    "above_rest_gib": ("above_rest_gb", "activation_gb"),  # activation_gb: paper results of commit 65b8cc2
    "predicted_peak_gib": ("predicted_peak_gb",),
    "peak_gib": ("peak_gb",),
    "baseline_peak_gib": ("baseline_peak_gb",),
    "symmetric_gib": ("symmetric_gb",),
    "memory_gib": ("memory_gb",),
}
# An older name -> the figure's name now.
GIB_NAME = {old: new for new, olds in LEGACY_GIB_NAMES.items() for old in olds}


def gib(record: Mapping[str, Any], name: str) -> Any:
    """The GiB figure ``name`` of a record, under its name now or an older one; None if absent."""
    for key in (name, *LEGACY_GIB_NAMES.get(name, ())):
        if key in record:
            return record[key]
    return None
