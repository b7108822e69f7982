"""Training-step time of one layout on N local GPUs (NCCL): e.g. EP=2 against EP=1 on two H200s.

    python -m bench.ep --nproc 2 --parallel ep=1 --parallel ep=2
    python -m bench.ep --nproc 2 --parallel ep=1 --parallel ep=2 --parallel ep=2,ep_backend=nvshmem --sync-debug
    python -m bench.ep --nproc 2 --skew --parallel ep=1 --parallel ep=2 --parallel ep=2,ep_backend=nvshmem

Each --parallel runs the same model (OLMoE-1B-7B width, --layers layers), the same per-GPU
batch and the library's own training step, in fresh processes; step times are CUDA-event
medians after warm-up on rank 0 (every rank runs the same number of collectives per step).
--skew biases every router so that all tokens pick experts of EP rank 0 (the same routing
at EP=1); --sync-debug runs one more step under torch.cuda.set_sync_debug_mode("error") and
records whether it made a host sync. Peak memory includes NVSHMEM symmetric buffers.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import environment, print_table, save_result
from moe.config import parse_value
from moe.parallel.spawn import run_ranks

COLUMNS = [
    "layout",
    "world",
    "step_s",
    "tokens_per_s_per_gpu",
    "tflops_per_gpu",
    "step_vs_first",
    "peak_mem_gib",
    "host_sync",
    "loss_rel_diff_vs_nccl",
    "buckets_in_backward",
]


# ------------------------------------------------------------------ one rank (a spawned process)


def _worker(rank: int, world: int, args: dict, parallel: dict, out: str) -> None:
    """One rank of one layout: warm-up, timed steps, the optional sync check and profile; rank 0
    writes the layout's result to ``out``/result.pt."""
    from moe.parallel.env import shutdown_distributed
    from moe.train.trainer import Trainer

    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if args["sm_carveout"]:  # leave SMs to NCCL: GEMMs that honour it size their grids to the rest
        torch._C._set_sm_carveout_experimental(args["sm_carveout"])
    cfg = _config(args, world, parallel, out, device_type)
    trainer = Trainer(cfg)
    if args["skew"]:
        _skew_routers(trainer, world)
    for _ in range(args["warmup"]):
        trainer.train_step()
        trainer.step += 1
    times = _timed_steps(trainer, args["steps"], device_type)
    sync = _sync_check(trainer) if args["sync_debug"] and device_type == "cuda" else None
    profile = None
    if args.get("profile") and device_type == "cuda":  # every rank runs the step (collectives); rank 0 reports
        profile = _profile_step(trainer, rank, parallel, args["profile"])
    trainer.layout.settle()  # ZeRO-1 weight broadcasts still in flight after the last step
    if rank == 0:
        result = _result(trainer, cfg, args, parallel, world, times, sync, profile, device_type)
        torch.save(result, Path(out) / "result.pt")
    shutdown_distributed()


def _config(args: dict, world: int, parallel: dict, out: str, device_type: str):
    from moe.config import ExperimentConfig

    return ExperimentConfig.load(
        {
            "model": {"preset": args["preset"], "n_layers": args["layers"], "max_seq_len": args["seq"]},
            "data": {"paths": [args["data"]], "seq_len": args["seq"], "verify_checksums": False},
            "train": {
                "global_batch_size": args["micro"] * world,
                "micro_batch_size": args["micro"],
                "max_steps": args["warmup"] + args["steps"],
                "log_every": 10_000,
                "device": device_type,
            },
            "schedule": {"warmup_steps": 1},
            "checkpoint": {"dir": str(Path(out) / "ck")},
            "parallel": parallel,
            "precision": {"recipe": args["recipe"]},
        }
    )


def _skew_routers(trainer, world: int) -> None:
    """All top-k choices among the experts of EP rank 0 (no bias updates: rate 0)."""
    for _, layer in trainer.model.moe_layers():
        bias = torch.zeros(layer.router.num_experts, device=layer.router.weight.device)
        bias[: layer.router.num_experts // world] = 100.0
        layer.router.expert_bias = bias


def _timed_steps(trainer, steps: int, device_type: str) -> list[float]:
    """Seconds of each step: CUDA events on the GPU, the wall clock on the CPU."""
    times = []
    for _ in range(steps):
        if device_type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            t0 = time.perf_counter()
        trainer.train_step()
        trainer.step += 1
        if device_type == "cuda":
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            times.append(time.perf_counter() - t0)
    return times


def _sync_check(trainer) -> str:
    """One more step with host syncs as errors: "none", or the first line of the error."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        trainer.train_step()
        sync = "none"
    except RuntimeError as exc:
        sync = str(exc).splitlines()[0][:200]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    trainer.step += 1
    return sync


def _profile_step(trainer, rank: int, parallel: dict, rows: int) -> dict[str, float] | None:
    """One more step under torch.profiler; rank 0 prints its top kernels and returns the overlap."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from bench.common import kernel_overlap

    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        trainer.train_step()
        torch.cuda.synchronize()
    trainer.step += 1
    if rank != 0:
        return None
    profile = kernel_overlap(prof)
    print(f"rank 0, one profiled step of {parallel}: {profile}")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=rows, max_name_column_width=70))
    return profile


def _result(trainer, cfg, args: dict, parallel: dict, world: int, times, sync, profile, device_type: str) -> dict[str, Any]:
    from moe.parallel.transport import symmetric_bytes
    from moe.plan.accounting import flops_per_token

    losses = torch.stack([v for _, v in trainer._pending]).tolist()[: args["warmup"] + args["steps"]]
    symmetric = symmetric_bytes()
    grad_sync = getattr(trainer.layout, "sync", None)
    tokens = args["micro"] * args["seq"]  # per GPU per step
    step = statistics.median(times)
    fpt = flops_per_token(cfg.model, args["seq"])
    return {
        "parallel": parallel,
        "world": world,
        "step_s": step,
        "tokens_per_s_per_gpu": tokens / step,
        "tflops_per_gpu": tokens * fpt / step / 1e12,
        "step_times_s": times,
        "losses": losses,
        "peak_mem_gib": (torch.cuda.max_memory_allocated() + symmetric) / 2**30 if device_type == "cuda" else None,
        "symmetric_gib": symmetric / 2**30,
        "host_sync": sync,
        "profile": profile,
        # buckets whose reduction started inside the last step's backward, of all
        "buckets_in_backward": [getattr(grad_sync, "launched_in_backward", None), len(getattr(grad_sync, "buckets", []))],
    }


# ------------------------------------------------------------------ the driver


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--parallel", action="append", default=[], help="k=v[,k=v] of the parallel section (repeatable)")
    p.add_argument("--preset", default="olmoe-1b-7b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--recipe", default="bf16")
    p.add_argument("--skew", action="store_true", help="route every token to experts of EP rank 0")
    p.add_argument("--sync-debug", action="store_true", help="one extra step with host syncs as errors")
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="ROWS",
        help="one more step under torch.profiler: rank 0 prints its ROWS top kernels and the NCCL time not hidden by compute",
    )
    p.add_argument(
        "--sm-carveout", type=int, default=0, metavar="SMS", help="torch._C._set_sm_carveout_experimental(SMS) in every rank (SMs kept free for NCCL)"
    )
    p.add_argument("--no-save", action="store_true")
    return p.parse_args(argv)


def layouts(specs: list[str]) -> list[dict[str, Any]]:
    """``--parallel`` values (k=v[,k=v]) as parallel sections; default EP=1 then EP=2."""
    out = []
    for spec in specs or ["ep=1", "ep=2"]:
        layout = {}
        for item in spec.split(","):
            k, v = item.split("=")
            layout[k] = parse_value(v)
        out.append(layout)
    return out


def run(a: argparse.Namespace) -> list[dict[str, Any]]:
    """Each layout in fresh processes on the same data; one row per layout."""
    from bench.model import make_data
    from moe.config import ModelConfig

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "tokens"
        data.mkdir()
        vocab = ModelConfig.from_dict({"preset": a.preset}).vocab_size
        make_data(data, (a.seq + 1) * a.micro * a.nproc * (a.warmup + a.steps + 2), vocab)
        args = {**vars(a), "data": str(data)}
        for i, layout in enumerate(layouts(a.parallel)):
            out = Path(tmp) / f"run{i}"
            out.mkdir()
            run_ranks(_worker, a.nproc, args, layout, str(out))
            result = torch.load(out / "result.pt", weights_only=True)
            rows.append({"layout": ",".join(f"{k}={v}" for k, v in layout.items()), **result})
    compare_layouts(rows)
    return rows


def compare_layouts(rows: list[dict[str, Any]]) -> None:
    """Step time against the first layout; an NVSHMEM layout's losses against the same layout
    on the nccl backend (sync-free dispatcher parity)."""
    base = rows[0]["step_s"]
    for r in rows:
        r["step_vs_first"] = r["step_s"] / base
        peer = {**r["parallel"], "ep_backend": "nccl"}
        match = [q for q in rows if {"ep_backend": "nccl", **q["parallel"]} == peer and q is not r]
        if r["parallel"].get("ep_backend") == "nvshmem" and match:
            ref = match[0]["losses"]
            r["loss_rel_diff_vs_nccl"] = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref, strict=True))


def report(a: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    print_table(rows, COLUMNS)
    payload = {
        "benchmark": "layout_step",
        "environment": environment(),
        "config": {**vars(a), "nccl_env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}},
        "results": rows,
    }
    save_result("ep", payload, save=not a.no_save)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if torch.cuda.is_available() and torch.cuda.device_count() < a.nproc:
        print(f"need {a.nproc} GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    report(a, run(a))
    return 0


if __name__ == "__main__":
    sys.exit(main())
