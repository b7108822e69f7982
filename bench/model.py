"""Full training steps of an OLMoE-width model on one GPU: tokens/s, TFLOP/s, MFU, host syncs,
peak memory.

    python -m bench.model --layers 8 --seq 4096 --micro 4 --steps 10
    python -m bench.model --layers 8 --recipe fp8_rowwise
    python -m bench.model --layers 8 --seq 4096 --micro 4 --accum 4 --loss-chunk 4096

The model is OLMoE-1B-7B's width (d=2048, 16 heads, 64 experts of 1024, top-8) with as many
layers as fit; data are random token ids (never zeros) in the library's token format; the
step is the library's own (--recipe, default bf16: bf16 weights, fp32 master weights, fused AdamW, clipping). MFU is
against both the measured bf16 matmul ceiling of this GPU and the datasheet peak. One step
runs under torch.cuda.set_sync_debug_mode("error") to prove it makes no host sync.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.common import environment, matmul_peak_tflops, pipelined_train_steps, print_table, save_result, timed_train_steps
from moe.config import ExperimentConfig
from moe.data import write_token_file
from moe.hardware import configure_cuda_allocator, gpu_by_device_name
from moe.kernels import rmsnorm
from moe.plan.accounting import flops_per_token
from moe.train.cuda_graph import WARMUP as CUDA_GRAPH_WARMUP
from moe.train.trainer import Trainer


def make_data(directory: Path, tokens: int, vocab: int) -> None:
    rng = np.random.default_rng(0)
    write_token_file(directory / "part-00000.npy", rng.integers(1, vocab, size=tokens), vocab_size=vocab, eos_id=0)


def profile_step(trainer: Trainer, rows: int) -> None:
    """One step under torch.profiler (moe.train.step_profile): kernel time per category, the
    largest kernels with the op that launched each, and GPU busy against wall time."""
    from moe.train.step_profile import StepProfiler, idle_gaps, top_entries

    profiler = StepProfiler(trainer.device).start()
    trainer.train_step()
    trainer.step += 1
    figures = profiler.stop(keep_events=True)
    events = profiler.events
    kernels = sum(e.time_range.elapsed_us() for e in events if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation) / 1e3
    print(
        f"profiled step: {figures['profile/wall_ms']:.1f} ms wall, {figures['profile/total_ms']:.1f} ms attributed, "
        f"{kernels:.1f} ms of device records in the trace"
    )
    for key, value in figures.items():
        print(f"  {key}: {value:.1f}")
    table = [{"category": c, "ms": round(ms, 2), "count": n, "kernel": k, "launched by": o} for c, k, o, ms, n in top_entries(events, True, rows)]
    print_table(table, ["category", "ms", "count", "kernel", "launched by"])
    idle, gaps = idle_gaps(events, 15)
    print(f"GPU idle between the step's first and last kernel: {idle:.1f} ms; the longest gaps:")
    print_table([{"ms": round(ms, 3), "after": a[:70], "before": b[:70]} for ms, a, b in gaps], ["ms", "after", "before"])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--micro", type=int, default=4, help="sequences per micro-batch")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step (gradient accumulation)")
    p.add_argument("--steps", type=int, default=10, help="timed steps after warm-up")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--routing", default="learned", choices=["learned", "random"])
    p.add_argument("--experts", type=int, default=64)
    p.add_argument(
        "--width",
        default="olmoe",
        choices=list(WIDTHS),
        help="olmoe: d=2048, 64x1024 experts, top-8; paper: d=4096, 64x4096 experts, top-4, 32 heads; "
        "narrow: d=1024, 64x1024 experts, top-8, 16 heads; qwen-like: experts of 768 (with --experts 128)",
    )
    p.add_argument(
        "--expert-grad-accum",
        default="fp32",
        choices=["fp32", "bf16"],
        help="optim.expert_grad_accum: where the expert weights' gradient accumulates over micro-batches",
    )
    p.add_argument(
        "--expert-wgrad",
        default="gemm",
        choices=["gemm", "separate", "paired"],
        help="optim.expert_wgrad: the expert weight gradient accumulated inside its GEMM, or added by a separate pass, "
        "or one GEMM per two micro-batches (paired)",
    )
    p.add_argument("--recipe", default="bf16", help="precision.recipe (bf16, fp8_rowwise, ...)")
    p.add_argument("--fp8-min-dim", type=int, default=None, help="precision.fp8_min_dim (default: the library's)")
    p.add_argument("--fp8-dense", action="store_true", help="precision.fp8_dense: the dense projections in FP8 too (fp8_rowwise)")
    p.add_argument(
        "--fp8-sink-wgrad-min-dim",
        type=int,
        default=None,
        help="precision.fp8_sink_wgrad_min_dim (default: the library's; the A/B behind Fp8Rule.sink_wgrad_min_dim)",
    )
    p.add_argument("--loss-chunk", type=int, default=0, help="train.loss_chunk_tokens: fused, chunked head + loss (0: unfused)")
    p.add_argument(
        "--torch-loss",
        dest="fused_loss",
        action="store_false",
        help="train.fused_loss=false: torch's fp32 log-softmax loss instead of the fused Triton kernel (for a side-by-side)",
    )
    p.add_argument(
        "--torch-adamw",
        dest="step_kernel",
        action="store_const",
        const="torch",
        default="triton",
        help="optim.step_kernel=torch: torch's fused AdamW and a copy into the bf16 weights instead of the Triton step (for a side-by-side)",
    )
    p.add_argument("--deterministic", action="store_true", help="train.deterministic: bitwise-identical reruns at one layout")
    p.add_argument(
        "--cuda-graph",
        action="store_true",
        help="train.cuda_graph: the step captured once as a CUDA graph and replayed (the capture falls in the warm-up)",
    )
    p.add_argument(
        "--layout-invariant",
        action="store_true",
        help="train.layout_invariant: the same bits at any data-parallel size (implies --deterministic on CUDA)",
    )
    p.add_argument("--logit-z-loss", type=float, default=0.0, help="train.logit_z_loss_weight (the olmoe-1b-7b recipe's is 1e-5)")
    p.add_argument("--recompute", default="none", help="train.recompute (none, matmuls, selective, full)")
    p.add_argument(
        "--sdpa",
        default="default",
        choices=["default", "flash", "cudnn", "efficient"],
        help="restrict SDPA to one backend (torch.nn.attention.sdpa_kernel) for the whole run",
    )
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="ROWS",
        help="profile one extra step (torch.profiler) and print its ROWS most expensive CUDA kernels",
    )
    p.add_argument("--eager-norm-rope", action="store_true", help="use the eager RMSNorm and RoPE instead of the fused kernels (for a side-by-side)")
    p.add_argument(
        "--peak-breakdown",
        action="store_true",
        help="one more step with the allocator's history on: what is live at its peak, by allocation site (bench.memory_trace)",
    )
    p.add_argument("--no-save", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_cuda_allocator()  # as training does (moe.parallel.env.pick_device), before CUDA allocates
    if not torch.cuda.is_available():
        print("bench.model needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.eager_norm_rope:
        import moe.nn.norm
        from moe.kernels import rmsnorm, rope

        moe.nn.norm.rms_norm = rmsnorm.rms_norm_reference
        rope.fusable = lambda *a: False
    report(args, run(args))
    return 0


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The measured matmul ceiling, then the training steps on random token ids (under --sdpa's
    backend): the result row, step times, losses and the optional peak breakdown."""
    peak_measured = matmul_peak_tflops()
    if args.cuda_graph:  # its eager steps and the capture, all in the warm-up
        args.warmup = max(args.warmup, CUDA_GRAPH_WARMUP + 1)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "tokens"
        data.mkdir()
        total_steps = args.warmup + 2 * args.steps + 2  # + the pipelined steps, the sync-check step and a profiled one
        # the data (and so the batches every step sees) must not depend on --profile
        make_data(data, (args.seq + 1) * args.micro * args.accum * (total_steps + 2), 50304)
        cfg = build_config(args, data, Path(tmp) / "ck", total_steps)
        trainer = Trainer(cfg)
        with sdpa_backend(args.sdpa):
            return measure(args, cfg, trainer, peak_measured)


def sdpa_backend(name: str):
    """--sdpa: SDPA restricted to one backend for the whole run (default: torch's choice)."""
    if name == "default":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}[name]
    return sdpa_kernel([backend])


# each width's overrides of the olmoe-1b-7b preset: (model, model.moe)
WIDTHS = {
    "olmoe": ({}, {}),
    "paper": ({"d_model": 4096, "n_heads": 32}, {"expert_hidden": 4096, "top_k": 4}),
    "narrow": ({"d_model": 1024, "n_heads": 16}, {"expert_hidden": 1024}),
    "qwen-like": ({}, {"expert_hidden": 768}),  # with --experts 128: the Qwen3-30B-A3B-like experts
}


def build_config(args: argparse.Namespace, data: Path, ckpt: Path, total_steps: int) -> ExperimentConfig:
    """The benchmark's training config from its arguments (tests rebuild it from a result's JSON)."""
    return ExperimentConfig.load(
        {
            "model": {
                "preset": "olmoe-1b-7b",
                "n_layers": args.layers,
                "max_seq_len": args.seq,
                **WIDTHS[args.width][0],
                "moe": {
                    "routing": args.routing,
                    "num_experts": args.experts,
                    **WIDTHS[args.width][1],
                },
            },
            "data": {"paths": [str(data)], "seq_len": args.seq, "verify_checksums": False},
            "train": {
                "global_batch_size": args.micro * args.accum,
                "micro_batch_size": args.micro,
                "max_steps": total_steps,
                "log_every": 1000,
                "device": "cuda",
                "loss_chunk_tokens": args.loss_chunk,
                # (records from before train.fused_loss existed ran torch's loss)
                "fused_loss": getattr(args, "fused_loss", False),
                **({"deterministic": True} if getattr(args, "deterministic", False) else {}),
                # (records from before train.cuda_graph existed ran eagerly)
                **({"cuda_graph": True} if getattr(args, "cuda_graph", False) else {}),
                **({"layout_invariant": True} if getattr(args, "layout_invariant", False) else {}),
                "recompute": args.recompute,
                "logit_z_loss_weight": args.logit_z_loss,
            },
            "schedule": {"warmup_steps": 1},
            # (records from before optim.expert_wgrad existed were measured on the separate path)
            # (records from before optim.step_kernel existed ran torch's AdamW)
            "optim": {
                "expert_grad_accum": args.expert_grad_accum,
                "expert_wgrad": getattr(args, "expert_wgrad", "separate"),
                "step_kernel": getattr(args, "step_kernel", "torch"),
            },
            "checkpoint": {"dir": str(ckpt)},
            "precision": {
                "recipe": args.recipe,
                **({"fp8_min_dim": args.fp8_min_dim} if args.fp8_min_dim is not None else {}),
                # (records from before the key existed have no such argument)
                **({"fp8_sink_wgrad_min_dim": v} if (v := getattr(args, "fp8_sink_wgrad_min_dim", None)) is not None else {}),
                **({"fp8_dense": True} if args.fp8_dense else {}),
            },
        }
    )


def _planned_peak(cfg) -> float | None:
    """What `moe plan` predicts for this run's peak (GiB; allocated memory, as measured here)."""
    from moe.plan.planner import make_plan

    try:
        return make_plan(cfg, "h200", 1, knobs=False).peak_gib
    except Exception as exc:  # the benchmark's own figures stand without it
        print(f"plan: {type(exc).__name__}: {exc}")
        return None


def measure(args: argparse.Namespace, cfg: ExperimentConfig, trainer: Trainer, peak_measured: float) -> dict[str, Any]:
    """Warm-up, one step under sync-debug "error", the timed steps (synchronised per step, then back
    to back as training runs them), then the optional profiled step and peak breakdown."""
    for _ in range(args.warmup):
        trainer.train_step()
        trainer.step += 1
    syncs_ok, sync_error = sync_check(trainer)
    torch.cuda.synchronize()
    if trainer.captured is None:  # (a captured step allocated its memory once, at the capture: kept in its peak)
        torch.cuda.reset_peak_memory_stats()
    times = timed_train_steps(trainer, args.steps)
    losses = torch.stack([v for _, v in trainer._pending]).tolist()
    assert all(np.isfinite(losses)), "non-finite loss in the benchmark"
    peak_mem_gib = torch.cuda.max_memory_allocated() / 2**30
    pipelined = pipelined_train_steps(trainer, args.steps)
    if args.profile:
        profile_step(trainer, args.profile)
    breakdown = None
    if args.peak_breakdown:
        from bench.memory_trace import peak_breakdown

        breakdown = peak_breakdown(trainer.train_step, top=60)
        trainer.step += 1
    fpt = flops_per_token(cfg.model, args.seq)
    row = result_row(args, trainer, fpt, times, peak_measured, peak_mem_gib, syncs_ok, _planned_peak(cfg))
    row["step_s_pipelined"] = statistics.median(pipelined)
    row["mfu_measured_peak_pipelined"] = row["tokens_per_step"] * fpt / row["step_s_pipelined"] / 1e12 / peak_measured
    return {
        "row": row,
        "flops_per_token": fpt,
        "times": times,
        "pipelined_times": pipelined,
        "losses": losses,
        "sync_error": sync_error,
        "breakdown": breakdown,
        "peak_measured": peak_measured,
    }


def sync_check(trainer: Trainer) -> tuple[bool, str | None]:
    """One step with host syncs as errors: (no sync found, the first line of the error)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        trainer.train_step()
        trainer.step += 1
    except RuntimeError as exc:
        return False, str(exc).splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return True, None


def result_row(
    args, trainer: Trainer, fpt: float, times: list[float], peak_measured: float, peak_mem_gib: float, syncs_ok: bool, plan_peak: float | None
) -> dict[str, Any]:
    """The table's row: throughput, MFU against both peaks, memory against the plan, host syncs."""
    step = statistics.median(times)
    tokens = args.micro * args.accum * args.seq
    tflops = tokens * fpt / step / 1e12
    spec = gpu_by_device_name(torch.cuda.get_device_name())
    datasheet = spec.peak_bf16_tflops if spec else None
    return {
        "recipe": args.recipe,
        "fp8_min_dim": args.fp8_min_dim,
        "fp8_dense": args.fp8_dense,
        "fp8_sink_wgrad_min_dim": args.fp8_sink_wgrad_min_dim,
        "recompute": args.recompute,
        "sdpa": args.sdpa,
        "fused_norm_rope": not args.eager_norm_rope,
        "width": args.width,
        "layers": args.layers,
        "experts": args.experts,
        "routing": args.routing,
        "expert_grad_accum": args.expert_grad_accum,
        "expert_wgrad": args.expert_wgrad,
        "seq": args.seq,
        "accum": args.accum,
        "loss_chunk": args.loss_chunk,
        "fused_loss": args.fused_loss,
        "step_kernel": args.step_kernel,
        "norm_backward": "triton" if rmsnorm.TRITON_BACKWARD else "torch",  # MOE_NORM_BACKWARD
        "deterministic": args.deterministic,
        "layout_invariant": args.layout_invariant,
        "cuda_graph": getattr(args, "cuda_graph", False),
        "tokens_per_step": tokens,
        "step_s": step,
        "tokens_per_s": tokens / step,
        "tflops": tflops,
        "mfu_measured_peak": tflops / peak_measured,
        "mfu_datasheet": tflops / datasheet if datasheet else None,
        "peak_mem_gib": peak_mem_gib,
        # a captured step's memory is its graph's pool, reserved for good: what the GPU gives the run
        "reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
        # the whole card in use after the timed steps (CUDA context, modules, the allocator's
        # reserve): what the planner's workspace allowance stands for, beside reserved_gib
        "device_used_gib": _device_used_gib(),
        "plan_peak_gib": plan_peak,
        "zero_host_syncs": syncs_ok,
        "params_total": trainer.params_total,
        "params_active": trainer.params_active,
    }


def _device_used_gib() -> float:
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**30


COLUMNS = [
    "recipe",
    "recompute",
    "sdpa",
    "fused_norm_rope",
    "fused_loss",
    "step_kernel",
    "cuda_graph",
    "width",
    "layers",
    "experts",
    "routing",
    "expert_grad_accum",
    "expert_wgrad",
    "accum",
    "tokens_per_step",
    "step_s",
    "tokens_per_s",
    "tflops",
    "mfu_measured_peak",
    "mfu_datasheet",
    "peak_mem_gib",
    "reserved_gib",
    "plan_peak_gib",
    "zero_host_syncs",
    "step_s_pipelined",
    "mfu_measured_peak_pipelined",
]


def report(args: argparse.Namespace, got: dict[str, Any]) -> None:
    print(f"bf16 matmul 8192^3 on this GPU: {got['peak_measured']:.0f} TFLOP/s")
    print_table([got["row"]], COLUMNS)
    if got["sync_error"]:
        print(f"host sync found: {got['sync_error']}")
    payload = {
        "benchmark": "train_step",
        "environment": environment(),
        "config": {**vars(args), "flops_per_token": got["flops_per_token"]},
        "matmul_peak_tflops": got["peak_measured"],
        "step_times_s": got["times"],
        "pipelined_step_times_s": got["pipelined_times"],
        "losses": got["losses"],
        "result": got["row"],
        **({"peak_breakdown": got["breakdown"]} if got["breakdown"] else {}),
    }
    save_result("model", payload, save=not args.no_save)


if __name__ == "__main__":
    sys.exit(main())
