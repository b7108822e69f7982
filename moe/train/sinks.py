"""Where metrics go. The library ships JSON-lines and console sinks; the pipeline adds MLflow."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger("moe.train")


class MetricsSink(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self, summary: dict[str, Any]) -> None: ...


class JsonlSink:
    """One JSON object per log point, appended and flushed (survives a killed run)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        clean = {k: (v if isinstance(v, (int, float)) and math.isfinite(v) else str(v)) for k, v in metrics.items()}
        self._f.write(json.dumps({"step": step, **clean}) + "\n")
        self._f.flush()

    def close(self, summary: dict[str, Any]) -> None:
        self._f.close()


class ConsoleSink:
    KEYS = ("loss", "lr", "grad_norm", "tokens_per_s_per_device", "tflops_per_device", "mfu")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if "lr" not in metrics:
            return  # a loss-only entry between log points
        parts = [f"step {step}"]
        for k in self.KEYS:
            if k in metrics:
                v = metrics[k]
                parts.append(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}")
        log.info("  ".join(parts))

    def close(self, summary: dict[str, Any]) -> None:
        return None
