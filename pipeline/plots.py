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


def task_styles(tasks: list[str]) -> dict[str, tuple[Any, str]]:
    """A (colour, marker) for each task, no two alike up to 140 tasks: tab20's 20 colours, then
    the next marker (the default cycle's 10 colours repeat from a suite's 11th task)."""
    import matplotlib

    colours = matplotlib.colormaps["tab20"]
    return {t: (colours(i % 20), "osD^v<>"[i // 20 % 7]) for i, t in enumerate(dict.fromkeys(tasks))}


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
    """The in-loop evaluation over training: validation loss, each task's primary accuracy and its
    bpb, a panel for each that was logged (the default BPB suite logs no accuracy: no empty panel)."""
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

    series: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for step, task, metric, value in points:
        series.setdefault((task, metric), []).append((step, value))
    panels: dict[str, list[tuple[str, str, str]]] = {}  # panel -> (task, metric, label): only panels with a series
    for task, metric in sorted(series):
        primary = TASKS[task].metric if task in TASKS else None
        if task == "val":
            panels.setdefault("val", []).append((task, metric, "validation"))
        elif metric == primary and metric in ("acc", "len_norm"):
            panels.setdefault("acc", []).append((task, metric, f"{task} ({metric})"))
        elif metric == "bpb":
            panels.setdefault("bpb", []).append((task, metric, task))
    titles = {
        "val": "validation loss",
        "acc": "each task's primary accuracy (acc or len_norm), ± 1 s.e.",
        "bpb": "bits per byte of the gold answer, ± 1 s.e.",
    }
    names = [p for p in titles if p in panels]
    if not names:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4.5), squeeze=False)
    styles = task_styles([t for t, _ in series if t != "val"])
    for ax, name in zip(axes[0], names, strict=True):
        for task, metric, label in panels[name]:
            pts = series[(task, metric)]
            colour, marker = styles.get(task, ("tab:blue", "o"))
            xs, ys = [s for s, _ in pts], [v for _, v in pts]
            ax.plot(xs, ys, marker=marker, markersize=3, color=colour, label=label)
            err = dict(series.get((task, f"{metric}/stderr"), []))
            if err and all(x in err for x in xs):  # a band of one standard error
                low, high = [y - err[x] for x, y in zip(xs, ys, strict=True)], [y + err[x] for x, y in zip(xs, ys, strict=True)]
                ax.fill_between(xs, low, high, color=colour, alpha=0.15)
        ax.set(xlabel="step", title=titles[name])
        ax.grid(alpha=0.3)
        if name != "val":
            ax.legend(fontsize=6, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.15))
    path = _save(fig, out / "eval_curve.png")
    plt.close(fig)
    return path


def _span(counts: list[int]) -> str:
    """``100`` or ``80-100``: the documents behind a panel's bars."""
    low, high = min(counts), max(counts)
    return f"{low}" if low == high else f"{low}-{high}"


def downstream_figure(downstream: dict[str, dict[str, Any]], out: Path = EVAL_DIR) -> Path | None:
    """Per task: our primary accuracy over the documents scored, with chance and majority beside
    it; our bpb; and the conversion check, ours and transformers' bpb over the same documents
    (transformers scores only evaluate.compare_docs of them, so its figure never sits beside a
    bar of more documents). A panel only where a task has its figure (no empty panel)."""
    if not downstream:
        return None
    plt = _pyplot()
    ranked = [n for n, r in downstream.items() if r["primary"] in ("acc", "len_norm")]
    compared = [n for n, r in downstream.items() if "ours_on_hf_docs" in r and "bpb" in r.get("hf", {})]
    names = list(downstream)
    panels = [p for p, tasks in (("acc", ranked), ("bpb", names), ("hf", compared)) if tasks]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 1.8 + 0.32 * len(names)), squeeze=False, layout="constrained")
    for ax, panel in zip(axes[0], panels, strict=True):
        if panel == "acc":
            rows, ys = [downstream[n] for n in ranked], list(range(len(ranked)))
            values = [r[f"{r['primary']}_v2"] for r in rows]
            ax.barh(ys, values, xerr=[r.get(f"{r['primary']}_v2/stderr", 0.0) for r in rows], color="tab:blue", label="ours ± 1 s.e.")
            ax.scatter([r.get("chance", float("nan")) for r in rows], ys, color="black", marker="|", s=140, label="chance (uniform guess)")
            ax.scatter([r.get("majority", float("nan")) for r in rows], ys, color="tab:red", marker="d", s=30, label="majority (one fixed answer)")
            ax.set_yticks(ys, [f"{n} ({downstream[n]['primary']})" for n in ranked], fontsize=7)
            ax.set(xlabel="accuracy", title=f"primary accuracy over {_span([int(r['docs']) for r in rows])} documents per task")
        elif panel == "bpb":
            rows, ys = [downstream[n] for n in names], list(range(len(names)))
            ax.barh(ys, [r["bpb_v2"] for r in rows], xerr=[r.get("bpb_v2/stderr", 0.0) for r in rows], color="tab:green", label="ours ± 1 s.e.")
            ax.set_yticks(ys, names, fontsize=7)
            what = "bits per byte of the gold continuation (lower is better)"
            ax.set(xlabel=what, title=f"bpb over {_span([int(r['docs']) for r in rows])} documents per task")
        else:
            rows, ys = [downstream[n] for n in compared], list(range(len(compared)))
            ax.barh(ys, [r["ours_on_hf_docs"]["bpb"] for r in rows], color="tab:green", alpha=0.5, label="ours")
            ax.scatter([r["hf"]["bpb"] for r in rows], ys, color="tab:orange", marker="x", label="transformers")
            ax.set_yticks(ys, compared, fontsize=7)
            few = _span([int(r["ours_on_hf_docs"]["docs"]) for r in rows])
            ax.set(xlabel="bits per byte of the gold continuation", title=f"conversion check: both models' bpb over the same {few} documents")
        ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.12))  # below the bars, never over them
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
    styles = task_styles(list(points[0]["tasks"]))
    for task, (colour, marker) in styles.items():
        ax2.plot(steps, [p["tasks"][task]["bpb"] for p in points], marker=marker, color=colour, label=task)
    ax2.set(xlabel="step", ylabel="bpb", title="downstream bpb by checkpoint")
    ax2.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)  # beside the curves, not over them
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    path = _save(fig, out / "checkpoints.png")
    plt.close(fig)
    return path
