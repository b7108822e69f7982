"""Loss parity between precision recipes: the same real-data run in bf16 and in FP8.

    python -m bench.parity run --recipe bf16 --data DIR --out runs/parity/bf16          # on a GPU
    python -m bench.parity run --recipe fp8_rowwise --data DIR --out runs/parity/fp8     # (another GPU)
    python -m bench.parity report runs/parity/bf16 runs/parity/fp8                      # anywhere

``run`` trains the library's own step (OLMoE-1B-7B width, ``--layers`` blocks, learned routing,
the same seed and data order) on a tokenised corpus (``moe tokenize`` / ``moe paper tokenize``
output: a ``manifest.json`` and ``train/``) and writes ``metrics.jsonl`` (the loss of every step)
and ``run.json`` (config, environment, wall time) into ``--out``. FP8 runs every expert GEMM in
FP8 by default (``--fp8-min-dim 0``): the point is the format's numerics, not the per-shape rule.

``report`` compares two runs: the final loss (mean of the last ``--tail`` steps, which smooths
the per-batch noise both runs share) and its relative difference, the largest gap along the
curve, a PNG of both curves, both curves as MLflow runs (one parent, one child per recipe, in
the project's MLflow store), and a JSON result in ``bench/results/``. The issue's bar: final loss
within 1% relative.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def run(args: argparse.Namespace) -> int:
    import torch

    from bench.common import environment
    from moe.train.sinks import JsonlSink
    from moe.train.trainer import Trainer

    data = Path(args.data)
    manifest = data / "manifest.json"
    if not manifest.is_file():
        print(f"{manifest}: not found (a tokenised corpus from `moe tokenize` or `moe paper tokenize`)", file=sys.stderr)
        return 2
    vocab = int(json.loads(manifest.read_text())["tokenizer"]["vocab_size"])
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        print(f"{out}: exists and is not empty; choose a new --out", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    cfg = config(args, data, vocab, "cuda" if torch.cuda.is_available() else "cpu")
    trainer = Trainer(cfg, sinks=[JsonlSink(out / "metrics.jsonl")])
    start = time.perf_counter()
    summary = trainer.fit()
    wall = time.perf_counter() - start
    result = {
        "recipe": args.recipe,
        "config": cfg.to_dict(),
        "environment": environment(),
        "wall_s": wall,
        "final_loss": summary.final_loss,
        "steps": summary.steps,
    }
    (out / "run.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"{args.recipe}: {summary.steps} steps in {wall:.0f} s, final loss {summary.final_loss:.4f}")
    return 0


def config(args: argparse.Namespace, data: Path, vocab: int, device: str):
    """The run's config: the preset at ``--layers``, the recipe (FP8 every expert GEMM by default)."""
    from moe.config import ExperimentConfig

    model: dict[str, Any] = {"preset": args.preset, "vocab_size": max(vocab, 256), "max_seq_len": args.seq}
    if args.layers:
        model["n_layers"] = args.layers
    precision: dict[str, Any] = {"recipe": args.recipe}
    if args.recipe != "bf16" and args.recipe.startswith(("fp8", "mx")):
        precision["fp8_min_dim"] = args.fp8_min_dim
        if args.emulate:
            precision["emulate"] = True
    return ExperimentConfig.load(
        {
            "model": model,
            "data": {"paths": [str(data / "train")], "seq_len": args.seq},
            "train": {
                "global_batch_size": args.micro * args.accum,
                "micro_batch_size": args.micro,
                "max_steps": args.steps,
                "log_every": 1,
                "device": device,
                "seed": args.seed,
            },
            "optim": {"lr": args.lr},
            "schedule": {"warmup_steps": max(1, args.steps // 10)},
            "checkpoint": {"dir": str(Path(args.out) / "checkpoints"), "every": 0, "save": False},
            "precision": precision,
        }
    )


def load_curve(run_dir: Path) -> tuple[dict[str, Any], list[tuple[int, float]]]:
    meta_path, metrics = run_dir / "run.json", run_dir / "metrics.jsonl"
    for f in (meta_path, metrics):
        if not f.is_file():
            raise SystemExit(f"{f}: not found (is {run_dir} a `bench.parity run` output?)")
    meta = json.loads(meta_path.read_text())
    curve = []
    for line in metrics.read_text().splitlines():
        row = json.loads(line)
        if isinstance(row.get("loss"), (int, float)):
            curve.append((int(row["step"]), float(row["loss"])))
    if not curve:
        raise SystemExit(f"{metrics}: no loss rows")
    return meta, curve


def compare(a: list[tuple[int, float]], b: list[tuple[int, float]], tail: int) -> dict[str, Any]:
    """Final-loss parity of two curves over their common steps."""
    la, lb = dict(a), dict(b)
    steps = sorted(set(la) & set(lb))
    if not steps:
        raise SystemExit("the two runs share no logged step")
    last = steps[-tail:]
    fa, fb = statistics.fmean(la[s] for s in last), statistics.fmean(lb[s] for s in last)
    gaps = [abs(lb[s] - la[s]) / abs(la[s]) for s in steps if la[s]]
    return {
        "steps": len(steps),
        "last_step": steps[-1],
        "tail": len(last),
        "final_a": fa,
        "final_b": fb,
        "final_rel_diff": (fb - fa) / fa,
        "max_rel_gap": max(gaps) if gaps else math.nan,
        "within_1pct": abs(fb - fa) / fa <= 0.01,
    }


def plot(a_name: str, a, b_name: str, b, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, curve in ((a_name, a), (b_name, b)):
        ax.plot([s for s, _ in curve], [v for _, v in curve], label=name, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("loss parity: same run, same data and seed")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(args: argparse.Namespace) -> int:
    from bench.common import write_result

    if args.tail < 1:
        print(f"--tail must be >= 1, got {args.tail}", file=sys.stderr)
        return 2
    (ma, a), (mb, b) = load_curve(Path(args.a)), load_curve(Path(args.b))
    na, nb = ma["recipe"], mb["recipe"]
    differ = sorted(
        k for k in set(ma["config"]) | set(mb["config"]) if k not in ("precision", "checkpoint") and ma["config"].get(k) != mb["config"].get(k)
    )
    if differ:
        print(f"warning: the two runs differ in more than the recipe: {', '.join(differ)}", file=sys.stderr)
    result = compare(a, b, args.tail)
    png = Path(args.plot) if args.plot else ROOT / "bench" / "results" / f"parity-{na}-{nb}.png"
    png.parent.mkdir(parents=True, exist_ok=True)
    plot(na, a, nb, b, png)
    print(f"{'':>12} {'final loss':>11} (mean of the last {result['tail']} of {result['steps']} steps)")
    print(f"{na:>12} {result['final_a']:>11.4f}")
    print(f"{nb:>12} {result['final_b']:>11.4f}")
    print(
        f"relative difference {result['final_rel_diff']:+.3%} (bar: 1%): {'met' if result['within_1pct'] else 'NOT met'}; "
        f"largest per-step gap {result['max_rel_gap']:.2%}; plot {png}"
    )
    # `moe bench log FILE` records it: a parent run with the result and the plot, a child run per curve.
    payload = {
        "benchmark": "parity",
        "environment": ma["environment"],
        "config": {"a": ma["config"], "b": mb["config"]},
        "recipes": [na, nb],
        "wall_s": [ma.get("wall_s"), mb.get("wall_s")],
        "result": result,
        "curves": {na: a, nb: b},
        # (moe bench log uploads an artifact only from the JSON's own folder)
        "artifacts": [png.name] if png.resolve().parent == (Path(args.results_dir) if args.results_dir else ROOT / "bench/results").resolve() else [],
        "mlflow": {"experiment": args.experiment, "run_name": "fp8-loss-parity"},
    }
    if not args.no_save:
        path = write_result("parity", payload, Path(args.results_dir) if args.results_dir else None)
        print(f"wrote {path} (record it in MLflow with `moe bench log {path}`)")
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="one training run (a GPU)")
    r.add_argument("--recipe", required=True, help="precision.recipe: bf16, fp8_rowwise, mxfp8, ...")
    r.add_argument("--data", required=True, help="tokenised corpus folder (manifest.json, train/)")
    r.add_argument("--out", required=True)
    r.add_argument("--preset", default="olmoe-1b-7b")
    r.add_argument("--layers", type=int, default=8)
    r.add_argument("--seq", type=int, default=1024)
    r.add_argument("--micro", type=int, default=8)
    r.add_argument("--accum", type=int, default=1)
    r.add_argument("--steps", type=int, default=300)
    r.add_argument("--lr", type=float, default=4e-4)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--fp8-min-dim", type=int, default=0, help="precision.fp8_min_dim for FP8 recipes (0: every expert GEMM)")
    r.add_argument("--emulate", action="store_true", help="precision.emulate (FP8 numerics on CPU; slow: a smoke run)")
    c = sub.add_parser("report", help="compare two runs, plot, write the JSON `moe bench log` records")
    c.add_argument("a")
    c.add_argument("b")
    c.add_argument("--tail", type=int, default=20, help="steps averaged for the final loss")
    c.add_argument("--plot", default=None)
    c.add_argument("--experiment", default="fp8-loss-parity", help="the MLflow experiment `moe bench log` records it in")
    c.add_argument("--results-dir", default=None, help="where the JSON goes (default bench/results)")
    c.add_argument("--no-save", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run(args) if args.cmd == "run" else report(args)


if __name__ == "__main__":
    sys.exit(main())
