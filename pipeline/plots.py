"""Training and validation figures as PNG files: `dvc plots show` renders them with no
network (DVC's data plots load vega from a CDN, which most clusters cannot reach), and MLflow
keeps them as artifacts. The numbers behind them stay in plots/*.csv."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from pipeline.outputs import write_output_file

TRAIN_DIR = Path("plots/train")
EVAL_DIR = Path("plots/eval")
LAYER_KEY = "expert_load_max_over_mean/layer_"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], float(r[key])) for r in rows if isinstance(r.get(key), (int, float))]
    return [s for s, _ in pts], [v for _, v in pts]


SOFTWARE = "moe-pipeline"  # written into every PNG's Software text chunk: how a rerun knows the file is ours


def png_bytes(fig, **kwargs) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": SOFTWARE}, **kwargs)
    return buf.getvalue()


def is_our_png(path: Path) -> bool:
    head = path.read_bytes()[:4096]
    return head.startswith(b"\x89PNG") and b"tEXtSoftware\x00" + SOFTWARE.encode() in head


def save_png(fig, path: Path, **kwargs) -> Path:
    """Write a figure as an output PNG (replacing only our own earlier one; never through a symlink)."""
    return write_output_file(path, png_bytes(fig, **kwargs), str(path), is_our_png)


def _save(fig, path: Path) -> Path:
    return save_png(fig, path, dpi=100, bbox_inches="tight")


def expert_load_matrix(rows: list[dict[str, Any]]) -> tuple[list[int], list[int], list[list[float]]]:
    """(steps, layers, max/mean expert load [layer][step]) from the logged metric rows."""
    layers = sorted({int(k[len(LAYER_KEY) :]) for r in rows for k in r if k.startswith(LAYER_KEY)})
    steps = [r["step"] for r in rows if any(f"{LAYER_KEY}{i}" in r for i in layers)]
    by_step = {r["step"]: r for r in rows}
    return steps, layers, [[float(by_step[s].get(f"{LAYER_KEY}{i}", float("nan"))) for s in steps] for i in layers]


def train_figures(rows: list[dict[str, Any]], out: Path = TRAIN_DIR) -> list[Path]:
    """loss, learning rate, throughput and MFU, and the per-layer expert-load heatmap."""
    plt = _pyplot()
    written = []
    for name, key, title in (("loss", "loss", "training loss"), ("lr", "lr", "learning rate")):
        x, y = _series(rows, key)
        if x:
            fig, ax = plt.subplots(figsize=(6, 3.5))
            ax.plot(x, y)
            ax.set(xlabel="step", ylabel=key, title=title)
            ax.grid(alpha=0.3)
            written.append(_save(fig, out / f"{name}.png"))
            plt.close(fig)
    x, y = _series(rows, "tokens_per_s_per_device")
    if x:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(x, y, label="tokens/s/device")
        ax.set(xlabel="step", ylabel="tokens/s/device", title="throughput and MFU")
        mx, my = _series(rows, "mfu")
        if mx:
            ax2 = ax.twinx()
            ax2.plot(mx, [100 * v for v in my], color="tab:orange", label="MFU")
            ax2.set_ylabel("MFU (%)")
        ax.grid(alpha=0.3)
        written.append(_save(fig, out / "throughput_mfu.png"))
        plt.close(fig)
    steps, layers, m = expert_load_matrix(rows)
    if steps:
        fig, ax = plt.subplots(figsize=(6, 1.2 + 0.35 * len(layers)))
        im = ax.imshow(m, aspect="auto", interpolation="nearest", cmap="viridis", extent=(steps[0] - 0.5, steps[-1] + 0.5, len(layers) - 0.5, -0.5))
        ax.set(xlabel="step", ylabel="layer", title="expert load: busiest expert / mean, per layer (1 = balanced)")
        ax.set_yticks(range(len(layers)), [str(i) for i in layers])
        fig.colorbar(im, ax=ax)
        written.append(_save(fig, out / "expert_load.png"))
        plt.close(fig)
    return written


def validation_figure(rows: list[dict[str, Any]], val_loss: float, hf_val_loss: float, out: Path = EVAL_DIR) -> Path:
    """The training loss curve with the final checkpoint's validation loss (ours and transformers')."""
    plt = _pyplot()
    x, y = _series(rows, "loss")
    fig, ax = plt.subplots(figsize=(6, 3.5))
    if x:
        ax.plot(x, y, label="training loss")
    end = x[-1] if x else 0
    ax.scatter([end], [val_loss], color="tab:red", zorder=3, label=f"validation loss {val_loss:.4f}")
    ax.scatter([end], [hf_val_loss], color="black", marker="x", zorder=4, label=f"transformers {hf_val_loss:.4f}")
    ax.set(xlabel="step", ylabel="loss", title="validation loss of the final checkpoint")
    ax.legend()
    ax.grid(alpha=0.3)
    path = _save(fig, out / "val_loss.png")
    plt.close(fig)
    return path
