"""Activation memory, peak memory and tokens/s per recompute mode, and the plan's calibration.

    python -m bench.memory                       # the default sweep (OLMoE width, seq 4096)
    python -m bench.memory --write-calibration   # also refresh moe/train/plan_calibration.json

For each config (layers, micro-batch, micro-batches per step, recompute mode) it runs the
library's own training step (bf16 weights, fp32 masters, fused AdamW) on random token ids and
measures: the memory held between steps (weights, masters, AdamW), the activations autograd
keeps through the blocks of one micro-batch (allocated memory at the final norm minus before
the forward), the peak allocated memory of the timed steps and their median tokens/s. The
calibration (activation bytes per token per layer against the analytic count, per mode, and
the head's) comes from the first config of each mode at the reference shape; the plan's
predicted peak is then compared with the measured one for every config.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from bench.common import environment, print_table, save_result, timed_train_steps
from moe.config import ExperimentConfig
from moe.data import write_token_file
from moe.hardware import GIB
from moe.parallel.recompute import RECOMPUTE_MODES, apply_recompute
from moe.plan.activations import CALIBRATION, analytic_head_bytes, analytic_layer_bytes
from moe.plan.planner import WORKSPACE_GIB, make_plan
from moe.train.trainer import Trainer

# (layers, micro-batch, micro-batches per step, modes), most important first.
SWEEP = [
    (8, 4, 1, RECOMPUTE_MODES),
    (4, 4, 1, RECOMPUTE_MODES),
    (12, 4, 2, ("none", "selective")),
    (8, 2, 2, ("none", "full")),
    (8, 1, 1, ("none", "selective")),
    (16, 4, 1, ("selective", "full")),
    (20, 4, 1, ("full",)),
]


def experiment(data: Path, ckpt: Path, layers: int, seq: int, micro: int, accum: int, mode: str, steps: int) -> ExperimentConfig:
    return ExperimentConfig.load(
        {
            "model": {"preset": "olmoe-1b-7b", "n_layers": layers, "max_seq_len": seq},
            "data": {"paths": [str(data)], "seq_len": seq, "verify_checksums": False},
            "train": {
                "global_batch_size": micro * accum,
                "micro_batch_size": micro,
                "max_steps": steps,
                "log_every": 10_000,
                "device": "cuda",
                "recompute": mode,
            },
            "schedule": {"warmup_steps": 1},
            "checkpoint": {"dir": str(ckpt)},
            "precision": {"recipe": "bf16"},
        }
    )


def measure_forward(trainer: Trainer) -> dict[str, float]:
    """Allocated bytes kept by one micro-batch's forward: through the blocks, and after the loss."""
    model = trainer.model
    batch = trainer.loader.next_batch()[0].to(trainer.device)
    marks: dict[str, int] = {}
    handle = model.norm.register_forward_pre_hook(lambda m, a: marks.__setitem__("blocks", torch.cuda.memory_allocated()))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    model.train()
    with trainer.recipe.autocast(trainer.device):
        logits = model(batch[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].reshape(-1))
    del logits
    torch.cuda.synchronize()
    after_loss = torch.cuda.memory_allocated()
    loss.backward()
    handle.remove()
    trainer.opt.zero_grad()
    del loss
    return {"blocks": marks["blocks"] - before, "after_loss": after_loss - before}


def run_config(args, data: Path, tmp: Path, layers: int, micro: int, accum: int, modes, rows: list, deadline: float) -> None:
    total = args.warmup + args.steps + 2
    cfg = experiment(data, tmp / f"ck{layers}-{micro}", layers, args.seq, micro, accum, "none", 10 * total * len(modes))
    trainer = None
    try:
        trainer = Trainer(cfg)
        for mode in modes:
            if time.perf_counter() > deadline:
                print(f"time budget spent: skipping layers={layers} micro={micro} mode={mode}", flush=True)
                continue
            row = {"layers": layers, "micro": micro, "accum": accum, "mode": mode, "tokens_per_micro": micro * args.seq}
            apply_recompute(trainer.model, mode)
            try:
                for _ in range(args.warmup):
                    trainer.train_step()
                    trainer.step += 1
                trainer._pending.clear()
                torch.cuda.synchronize()
                row["static_gib"] = torch.cuda.memory_allocated() / GIB
                fwd = measure_forward(trainer)
                row["act_blocks_gib"] = fwd["blocks"] / GIB
                row["act_after_loss_gib"] = fwd["after_loss"] / GIB
                row["act_bytes_per_token_layer"] = fwd["blocks"] / (micro * args.seq * layers)
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                times = timed_train_steps(trainer, args.steps)
                losses = torch.stack([v for _, v in trainer._pending]).tolist()
                trainer._pending.clear()
                assert all(np.isfinite(losses)), f"non-finite loss: {losses}"
                row["peak_gib"] = torch.cuda.max_memory_allocated() / GIB
                row["step_s"] = statistics.median(times)
                row["tokens_per_s"] = micro * accum * args.seq / row["step_s"]
                row["step_times_s"] = times
                row["oom"] = False
            except torch.OutOfMemoryError:
                row["oom"] = True
                trainer.opt.zero_grad()
                trainer._pending.clear()
            except Exception as exc:  # record it and go on: one GPU session measures everything
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                trainer.opt.zero_grad()
                trainer._pending.clear()
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "step_times_s"}), flush=True)
    except torch.OutOfMemoryError:
        rows.append({"layers": layers, "micro": micro, "accum": accum, "mode": ",".join(modes), "oom": True, "at": "build"})
        print(f"OOM building layers={layers} micro={micro}", flush=True)
    finally:
        del trainer
        gc.collect()
        torch.cuda.empty_cache()


def calibrate(rows: list, seq: int) -> dict:
    """Measured / analytic activation bytes per token per layer, per mode (first config of
    each mode without OOM), and the head's factor from the reference 'none' config."""
    model_cfg = experiment(Path("."), Path("."), 8, seq, 1, 1, "none", 1).model
    factors, measured = {}, {}
    for mode in RECOMPUTE_MODES:
        row = next((r for r in rows if r["mode"] == mode and not r.get("oom") and "act_bytes_per_token_layer" in r), None)
        if row is None:
            continue
        analytic = analytic_layer_bytes(model_cfg, mode, True)
        factors[mode] = row["act_bytes_per_token_layer"] / analytic
        measured[mode] = {
            "bytes_per_token_layer": row["act_bytes_per_token_layer"],
            "analytic": analytic,
            "from": {k: row[k] for k in ("layers", "micro", "accum")},
        }
    ref = next((r for r in rows if r["mode"] == "none" and r["accum"] == 1 and not r.get("oom") and "peak_gib" in r), None)
    head_factor = 1.0
    if ref is not None:
        tokens = ref["tokens_per_micro"]
        head = (ref["peak_gib"] - ref["static_gib"] - ref["act_blocks_gib"]) * GIB
        head_factor = head / (tokens * analytic_head_bytes(model_cfg))
    env = environment()
    return {
        "source": f"measured on {env.get('device')} (torch {env['torch']}, commit {env['git_commit'][:12]})",
        "device": env.get("device"),
        "torch": env["torch"],
        "git_commit": env["git_commit"],
        "date": env["date"],
        "shape": {
            "d_model": model_cfg.d_model,
            "num_experts": model_cfg.moe.num_experts,
            "top_k": model_cfg.moe.top_k,
            "expert_hidden": model_cfg.moe.expert_hidden,
            "seq_len": seq,
            "vocab_size": model_cfg.vocab_size,
        },
        "layer_factor": factors,
        "head_factor": head_factor,
        "measured": measured,
    }


def predict(rows: list, seq: int, calibration: dict) -> None:
    for r in rows:
        if "peak_gib" not in r:
            continue
        cfg = experiment(Path("."), Path("."), r["layers"], seq, r["micro"], r["accum"], r["mode"], 1)
        plan = make_plan(cfg, "h200", 1, knobs=False, calibration=calibration)
        r["predicted_peak_gib"] = plan.peak_gib - WORKSPACE_GIB  # the allocator's share (the context is not in it)
        r["prediction_error"] = r["predicted_peak_gib"] / r["peak_gib"] - 1


def predict_from(path: Path) -> int:
    """Re-predict a measured sweep with this checkout's plan and calibration table (CPU only)."""
    from moe.plan.activations import load_calibration

    result = json.loads(path.read_text())
    rows = [r for r in result["rows"] if "peak_gib" in r]
    predict(rows, result["config"]["seq"], load_calibration())
    print_table(rows, ["layers", "micro", "accum", "mode", "peak_gib", "predicted_peak_gib", "prediction_error"])
    worst = max(abs(r["prediction_error"]) for r in rows)
    print(f"{len(rows)} configs; largest error {worst:.1%}")
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--steps", type=int, default=4, help="timed steps per config")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--only", type=int, default=0, help="run only the first N configs of the sweep (0: all)")
    p.add_argument("--budget-s", type=float, default=1e9, help="skip configs once this many seconds have passed")
    p.add_argument("--write-calibration", action="store_true", help=f"write {CALIBRATION.name} next to moe/train/plan.py")
    p.add_argument("--no-save", action="store_true")
    p.add_argument(
        "--predict", type=Path, metavar="RESULT_JSON", help="no GPU: the current plan's predictions against the peaks measured in an earlier result"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.predict:
        return predict_from(args.predict)
    if not torch.cuda.is_available():
        print("bench.memory needs a CUDA GPU", file=sys.stderr)
        return 2
    report(args, run(args))
    return 0


def run(args: argparse.Namespace) -> dict:
    """The sweep (within --budget-s) on random token ids, the calibration it gives and the
    plan's prediction for every config."""
    deadline = time.perf_counter() + args.budget_s
    sweep = SWEEP[: args.only] if args.only else SWEEP
    rows: list = []
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "tokens"
        data.mkdir()
        rng = np.random.default_rng(0)
        n = (args.seq + 1) * 4 * 2 * (args.warmup + args.steps + 2) * 4 * 2
        write_token_file(data / "part-00000.npy", rng.integers(1, 50304, size=n), vocab_size=50304, eos_id=0)
        for layers, micro, accum, modes in sweep:
            if time.perf_counter() > deadline:
                print(f"time budget spent: skipping layers={layers} micro={micro}", flush=True)
                continue
            run_config(args, data, Path(tmp), layers, micro, accum, modes, rows, deadline)
    calibration = calibrate(rows, args.seq)
    predict(rows, args.seq, calibration)
    return {"sweep": sweep, "rows": rows, "calibration": calibration}


COLUMNS = [
    "layers",
    "micro",
    "accum",
    "mode",
    "static_gib",
    "act_blocks_gib",
    "act_bytes_per_token_layer",
    "peak_gib",
    "predicted_peak_gib",
    "prediction_error",
    "tokens_per_s",
    "oom",
]


def report(args: argparse.Namespace, got: dict) -> None:
    """The table, the JSON and (--write-calibration) the plan's calibration table."""
    total_gib = torch.cuda.get_device_properties(0).total_memory / GIB
    print(f"GPU total memory {total_gib:.2f} GiB")
    print_table(got["rows"], COLUMNS)
    payload = {
        "benchmark": "memory",
        "environment": environment(),
        "config": {**vars(args), "sweep": [list(map(str, s)) for s in got["sweep"]]},
        "gpu_total_memory_gib": total_gib,
        "calibration": got["calibration"],
        "rows": got["rows"],
    }
    save_result("memory", payload, save=not args.no_save)
    if args.write_calibration:
        CALIBRATION.write_text(json.dumps(got["calibration"], indent=2, sort_keys=True) + "\n")
        print(f"wrote {CALIBRATION}")


if __name__ == "__main__":
    sys.exit(main())
