"""Where the MoE layer's time goes: CUDA kernel times of one forward+backward (torch.profiler).

python -m bench.profile_layer --shape 2048,1024,64,8 --tokens 16384
python -m bench.profile_layer --shape 4096,4096,64,4 --recipe fp8   # every expert GEMM in FP8 rowwise

Random routing, dropless. Writes JSON (per-kernel times, GEMM against the rest) to bench/results/.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from bench.common import environment, save_result
from bench.layer import Shape, build_ours, build_ours_fp8, make_weights

ITERS = 5  # profiled forward + backward calls (after 3 warm-up calls)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shape", default="2048,1024,64,8")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--rows", type=int, default=18)
    p.add_argument("--recipe", choices=("bf16", "fp8"), default="bf16", help="fp8: every expert GEMM in FP8 rowwise")
    p.add_argument("--no-save", action="store_true")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Profile ITERS forward + backward calls of the layer: the profiler's table and the kernels
    (ms and calls per call, largest first)."""
    shape = Shape(*map(int, args.shape.split(",")))
    device = torch.device("cuda")
    weights = make_weights(shape, device)
    fp8 = args.recipe == "fp8"
    layer = build_ours_fp8(shape, weights, torch.bfloat16, min_dim=0) if fp8 else build_ours(shape, weights, torch.bfloat16)
    x = torch.randn(1, args.tokens, shape.d, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)

    def step() -> None:
        x.grad = None
        layer.zero_grad(set_to_none=True)  # as bench.layer: no gradient accumulation adds
        layer(x).backward(grad)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(ITERS):
            step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=100)
    kernels = []
    for evt in prof.key_averages():
        t = getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0.0)
        if t > 0:
            kernels.append({"kernel": evt.key[:160], "ms": t / ITERS / 1e3, "calls": evt.count // ITERS, "gemm": _is_gemm(evt.key)})
    kernels.sort(key=lambda r: -r["ms"])
    return {"shape": shape, "table": table, "kernels": kernels}


def report(args: argparse.Namespace, got: dict[str, Any]) -> None:
    print(got["table"])
    kernels = got["kernels"]
    gemm = sum(r["ms"] for r in kernels if r["gemm"])
    other = sum(r["ms"] for r in kernels if not r["gemm"])
    print(
        f"{got['shape'].label} {args.recipe}: per forward+backward grouped GEMM {gemm:.3f} ms, "
        f"everything else {other:.3f} ms ({100 * other / max(gemm + other, 1e-9):.1f}%)"
    )
    if not args.no_save:
        payload = {
            "environment": environment(),
            "config": {"shape": args.shape, "tokens": args.tokens, "recipe": args.recipe, "routing": "random, dropless", "iters": ITERS},
            "gemm_ms": gemm,
            "other_ms": other,
            "kernels": kernels,
        }
        save_result("profile_layer", payload)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.profile_layer needs a CUDA GPU", file=sys.stderr)
        return 2
    report(args, run(args))
    return 0


def _is_gemm(name: str) -> bool:
    """CUTLASS grouped GEMMs, bf16 and FP8 (torch._grouped_mm, torch._scaled_grouped_mm)."""
    low = name.lower()
    return "gemm" in low and ("cutlass" in low or "sm90" in low)


if __name__ == "__main__":
    sys.exit(main())
