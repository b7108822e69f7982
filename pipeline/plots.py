"""Training and validation figures as PNG files: `dvc plots show` renders them with no
network (DVC's data plots load vega from a CDN, which most clusters cannot reach), and MLflow
keeps them as artifacts. The numbers behind them stay in plots/*.csv."""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any

from pipeline.outputs import csv_header, write_output_file

TRAIN_DIR = Path("plots/train")
EVAL_DIR = Path("plots/eval")
CHECKPOINT_CURVE_DIR = Path("plots/checkpoints")  # `moe evaluate --checkpoint`: not a DVC output
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
        mx, my = _series(rows, "mfu")
        # MFU needs a GPU's peak: on the CPU there is none to divide by, and the title says so
        ax.set(xlabel="step", ylabel="tokens/s/device", title="throughput and MFU" if mx else "throughput (no MFU: no GPU peak on this device)")
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


EVAL_CURVE_CSV = Path("plots/eval_curve.csv")
EVAL_CURVE_COLUMNS = ["step", "task", "metric", "value"]


def eval_curve_rows(rows: list[dict[str, Any]]) -> list[tuple[int, str, str, float]]:
    """(step, task, metric, value) of the in-loop evaluation (``eval/<task>/<metric>``, and
    ``eval/val_loss`` as the task ``val``) logged in metrics.jsonl."""
    out = []
    for r in rows:
        for k, v in r.items():
            if not k.startswith("eval/") or not isinstance(v, (int, float)) or k in ("eval/seconds", "eval/time_fraction"):
                continue
            parts = k.split("/")  # eval/<task>/<metric>[/stderr]
            task, metric = ("val", "loss") if parts[1] == "val_loss" else (parts[1], "/".join(parts[2:]))
            out.append((int(r["step"]), task, metric, float(v)))
    return sorted(out)


def eval_curve(rows: list[dict[str, Any]], out: Path = TRAIN_DIR, csv_path: Path = EVAL_CURVE_CSV) -> Path | None:
    """The in-loop evaluation over training: validation loss, each task's primary metric and bpb."""
    points = eval_curve_rows(rows)
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(EVAL_CURVE_COLUMNS)
    w.writerows(points)
    # written even without points (a DVC output must exist): the header alone
    write_output_file(csv_path, buf.getvalue(), str(csv_path), csv_header(EVAL_CURVE_COLUMNS))
    if not points:
        return None
    from pipeline.eval.tasks import TASKS

    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    series: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for step, task, metric, value in points:
        series.setdefault((task, metric), []).append((step, value))
    for (task, metric), pts in sorted(series.items()):
        primary = TASKS[task].metric if task in TASKS else None
        if task == "val":
            ax, label = axes[0], "validation"
        elif metric == primary and metric in ("acc", "len_norm"):
            ax, label = axes[1], f"{task} ({metric})"
        elif metric == "bpb":
            ax, label = axes[2], task
        else:
            continue
        line = ax.plot([s for s, _ in pts], [v for _, v in pts], marker="o", markersize=3, label=label)[0]
        err = dict(series.get((task, f"{metric}/stderr"), []))
        if err and all(s in err for s, _ in pts):  # a band of one standard error
            xs, ys = [s for s, _ in pts], [v for _, v in pts]
            low, high = [y - err[x] for x, y in zip(xs, ys, strict=True)], [y + err[x] for x, y in zip(xs, ys, strict=True)]
            ax.fill_between(xs, low, high, color=line.get_color(), alpha=0.15)
    titles = ("validation loss", "primary accuracy per task (a tiny model stays near chance)", "bits per byte of the gold answer")
    for ax, title in zip(axes, titles, strict=True):
        ax.set(xlabel="step", title=title)
        ax.grid(alpha=0.3)
    for ax in axes[1:]:
        ax.legend(fontsize=6, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.15))
    path = _save(fig, out / "eval_curve.png")
    plt.close(fig)
    return path


def downstream_figure(downstream: dict[str, dict[str, Any]], out: Path = EVAL_DIR) -> Path | None:
    """Per task: the primary metric next to chance (ours; transformers' as a mark), and bpb."""
    if not downstream:
        return None
    plt = _pyplot()
    names = list(downstream)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 0.9 + 0.32 * len(names)))
    ys = range(len(names))
    ranked = [downstream[n] if downstream[n]["primary"] in ("acc", "len_norm") else None for n in names]
    ax1.barh(
        list(ys),
        [r[f"{r['primary']}_v2"] if r else 0 for r in ranked],
        xerr=[r.get(f"{r['primary']}_v2/stderr", 0.0) if r else 0 for r in ranked],  # one standard error
        color="tab:blue",
        label="ours",
    )
    ax1.scatter([r["chance"] if r else float("nan") for r in ranked], list(ys), color="black", marker="|", s=120, label="chance")
    ax1.scatter(
        [r["hf"].get(r["primary"], float("nan")) if r else float("nan") for r in ranked],
        list(ys),
        color="tab:orange",
        marker="x",
        label="transformers",
    )
    ax1.set_yticks(list(ys), [f"{n} ({downstream[n]['primary']})" for n in names], fontsize=7)
    ax1.set(xlabel="accuracy", title="downstream accuracy (a tiny model scores at chance)")
    ax1.legend(fontsize=7)
    ax2.barh(list(ys), [downstream[n]["bpb_v2"] for n in names], xerr=[downstream[n].get("bpb_v2/stderr", 0.0) for n in names], color="tab:green")
    ax2.set_yticks(list(ys), names, fontsize=7)
    ax2.set(xlabel="bits per byte of the gold continuation (lower is better)", title="downstream bpb")
    for ax in (ax1, ax2):
        ax.invert_yaxis()
        ax.grid(alpha=0.3, axis="x")
    path = _save(fig, out / "downstream.png")
    plt.close(fig)
    return path


def checkpoint_curve_figure(points: list[dict[str, Any]], out: Path = CHECKPOINT_CURVE_DIR) -> Path | None:
    """`moe evaluate --checkpoint ...`: validation loss and each task's bpb by checkpoint step
    (outside the evaluate stage's DVC outputs, so `dvc status` stays clean)."""
    if not points:
        return None
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4), layout="constrained")
    steps = [p["step"] for p in points]
    ax1.plot(steps, [p["val_loss"] for p in points], marker="o")
    ax1.set(xlabel="step", ylabel="loss", title="validation loss by checkpoint")
    if points[0].get("converted_from"):  # one checkpoint converted from a Hugging Face model
        fig.suptitle(f"converted from {points[0]['converted_from']} (not a training step)", fontsize=9)
        for ax in (ax1, ax2):
            ax.set_xticks([])
    tasks = list(points[0]["tasks"])
    colours = plt.get_cmap("tab20")  # 20 distinct colours, and markers as well past that
    for i, task in enumerate(tasks):
        ax2.plot(steps, [p["tasks"][task]["bpb"] for p in points], marker="osD^v<>"[i // 20 % 7], color=colours(i % 20), label=task)
    ax2.set(xlabel="step", ylabel="bpb", title="downstream bpb by checkpoint")
    ax2.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)  # beside the curves, not over them
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    path = _save(fig, out / "checkpoints.png")
    plt.close(fig)
    return path
