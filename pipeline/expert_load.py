"""The expert-load heatmap (layer x expert over logged steps): CSV for DVC, PNG for MLflow.

The data are the per-expert relative loads the trainer logs at every log point
(``expert_load/layer_L/expert_E``: tokens over the layer's mean, 1 = average), read back
from metrics.jsonl."""

from __future__ import annotations

import csv
import io
import re
from pathlib import Path
from typing import Any

from pipeline.outputs import csv_header, write_output_file

KEY = re.compile(r"^expert_load/layer_(\d+)/expert_(\d+)$")
COLUMNS = ["step", "layer", "expert", "row", "load"]


def load_table(rows: list[dict[str, Any]]) -> list[tuple[int, int, int, float]]:
    """(step, layer, expert, relative load) for every logged per-expert load."""
    out = []
    for r in rows:
        for k, v in r.items():
            m = KEY.match(k)
            if m and isinstance(v, (int, float)):
                out.append((int(r["step"]), int(m[1]), int(m[2]), float(v)))
    return sorted(out)


def write_csv(path: Path, table: list[tuple[int, int, int, float]]) -> None:
    """Long format, one row per (step, layer, expert); ``row`` labels the heatmap's y axis."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(COLUMNS)
    for step, layer, expert, load in table:
        w.writerow([step, layer, expert, f"L{layer:02d} E{expert:03d}", f"{load:.6g}"])
    write_output_file(path, buf.getvalue(), str(path), csv_header(COLUMNS))


def write_png(path: Path, table: list[tuple[int, int, int, float]], title: str = "Expert load (tokens / layer mean)") -> bool:
    """Render the heatmap; False (nothing written) when there is no data."""
    if not table:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import TwoSlopeNorm

    steps = sorted({s for s, _, _, _ in table})
    layers = sorted({la for _, la, _, _ in table})
    experts = max(e for _, _, e, _ in table) + 1
    col = {s: i for i, s in enumerate(steps)}
    row = {la: i for i, la in enumerate(layers)}
    grid = np.full((len(layers) * experts, len(steps)), np.nan)
    for s, la, e, v in table:
        grid[row[la] * experts + e, col[s]] = v
    vmax = max(2.0, float(np.nanmax(grid)))
    fig_h = min(40.0, 1.5 + 0.18 * grid.shape[0])
    fig, ax = plt.subplots(figsize=(max(6.0, 0.35 * len(steps) + 3), fig_h))
    im = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="RdBu_r", norm=TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=vmax))
    for i in range(1, len(layers)):
        ax.axhline(i * experts - 0.5, color="black", linewidth=1.0)
    ax.set_yticks([i * experts + (experts - 1) / 2 for i in range(len(layers))], [f"layer {la}" for la in layers])
    tick_every = max(1, len(steps) // 12)
    ax.set_xticks(range(0, len(steps), tick_every), [str(s) for s in steps[::tick_every]])
    ax.set_xlabel("step (each column: the tokens since the previous log point)")
    ax.set_ylabel(f"expert 0..{experts - 1} within each layer")
    ax.set_title(title)
    fig.colorbar(im, ax=ax, label="tokens / mean over the layer's experts")
    fig.tight_layout()
    from pipeline.plots import save_png

    save_png(fig, path, dpi=100)
    plt.close(fig)
    return True
