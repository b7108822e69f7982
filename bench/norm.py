"""RMSNorm forward + backward on the GPU: the fused Triton norm against the eager one and peers.

    python -m bench.norm                      # [16384, 2048] and [65536, 2048], bf16
    python -m bench.norm --shape 65536,4096   # other rows,width (repeatable)

Peers, on the same random bf16 inputs (weight near 1, not ones): ``eager`` (moe's reference,
``rms_norm_reference``), ``fused`` (our Triton kernels, ``rms_norm_triton``: the library's
path for mixed dtypes; with one dtype it takes ``torch``), ``compiled`` (torch.compile of the
eager norm; ``--no-compile`` skips it), ``torch`` (``F.rms_norm``: one rounding, not OLMoE's
order) and ``liger`` (Liger-Kernel's llama-order norm, skipped with a note where it does not
import). Before timing, each peer's y, dx and dweight are compared with an fp32 computation on
the same inputs; the fused norm must be within 2x the eager norm's error (+ half a bf16 step)
and bitwise equal across two runs, else nothing is timed and the exit code is 1.

Per shape and peer: forward ms, forward + backward ms (CUDA-event medians after warm-up), the
fwd+bwd rate in GB/s of the minimum traffic (read x, write y; read x and dy, write dx: 8 bytes
per bf16 element), and the bytes per row autograd keeps (saved-tensor hooks, weight excluded).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from bench.common import environment, print_table, rel_error, save_result, time_cuda
from moe.kernels.rmsnorm import rms_norm_reference, rms_norm_triton

SHAPES = [(16384, 2048), (65536, 2048)]
EPS = 1e-5
HALF_BF16_STEP = 2.0**-9

Norm = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


def _liger() -> tuple[Norm | None, str]:
    try:
        import liger_kernel
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except Exception as exc:  # not installed, or not importable with this torch/triton
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
    version = getattr(liger_kernel, "__version__", "?")
    return (lambda x, w, eps: LigerRMSNormFunction.apply(x, w, eps, 0.0, "llama", False)), f"liger-kernel {version}"


def peers(compile_: bool) -> tuple[dict[str, Norm], dict[str, str]]:
    out: dict[str, Norm] = {"eager": rms_norm_reference, "fused": rms_norm_triton, "torch": lambda x, w, eps: F.rms_norm(x, (x.shape[-1],), w, eps)}
    notes: dict[str, str] = {}
    if compile_:
        out["compiled"] = torch.compile(rms_norm_reference, dynamic=False)
    liger, note = _liger()
    notes["liger"] = note
    if liger is not None:
        out["liger"] = liger
    return out, notes


def _run(fn: Norm, x: torch.Tensor, w: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
    xs, ws = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    y = fn(xs, ws, EPS)
    y.backward(g)
    return y.detach(), xs.grad, ws.grad


def _truth(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return _run(rms_norm_reference, x.float(), w.float(), g.float())


def saved_bytes_per_row(fn: Norm, x: torch.Tensor, w: torch.Tensor) -> float:
    """Bytes of the tensors autograd keeps for backward (each storage once; the weight excluded)."""
    xs, ws = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() != ws.untyped_storage().data_ptr():
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(xs, ws, EPS)
    return sum(seen.values()) / x.shape[0]


def check(fns: dict[str, Norm], x: torch.Tensor, w: torch.Tensor, g: torch.Tensor) -> dict[str, Any]:
    truth = _truth(x, w, g)
    res: dict[str, Any] = {}
    outs = {}
    for name, fn in fns.items():
        try:
            outs[name] = _run(fn, x, w, g)
        except Exception as exc:  # a peer that fails is reported and left out of the timing
            res[f"{name}_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            continue
        for part, a, t in zip(("y", "dx", "dw"), outs[name], truth, strict=True):
            res[f"{name}_{part}_rel_vs_fp32"] = rel_error(a, t)
    if "fused" in outs:
        y, dx, dw = outs["fused"]
        ey, edx, edw = outs["eager"]
        res["fused_y_bitwise_equal_to_eager"] = float((y == ey).float().mean())
        res["fused_dx_bitwise_equal_to_eager"] = float((dx == edx).float().mean())
        res["fused_dw_rel_vs_eager"] = rel_error(dw, edw)
        again = _run(fns["fused"], x, w, g)
        res["fused_deterministic"] = all(torch.equal(a, b) for a, b in zip(outs["fused"], again, strict=True))
        res["ok"] = res["fused_deterministic"] and all(
            res[f"fused_{p}_rel_vs_fp32"] <= 2 * res[f"eager_{p}_rel_vs_fp32"] + HALF_BF16_STEP for p in ("y", "dx", "dw")
        )
    else:
        res["ok"] = False
    res["peers_ok"] = sorted(outs)
    return res


def bench_shape(rows: int, width: int, fns: dict[str, Norm], iters: int, warmup: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(rows, width, device="cuda", generator=gen) * 2).bfloat16()
    w = (1 + 0.1 * torch.randn(width, device="cuda", generator=gen)).bfloat16()
    g = torch.randn(rows, width, device="cuda", generator=gen).bfloat16()
    result = check(fns, x, w, g)
    table: list[dict[str, Any]] = []
    if not result["ok"]:
        return result, table
    min_bytes = 8 * rows * width
    for name in result["peers_ok"]:
        fn = fns[name]
        xs, ws = x.clone().requires_grad_(True), w.clone().requires_grad_(True)

        def forward(fn=fn, xs=xs, ws=ws):
            with torch.no_grad():
                fn(xs, ws, EPS)

        def fwd_bwd(fn=fn, xs=xs, ws=ws):
            fn(xs, ws, EPS).backward(g)

        def clear(xs=xs, ws=ws):
            xs.grad = ws.grad = None

        row: dict[str, Any] = {"shape": f"{rows}x{width}", "norm": name}
        row["fwd_ms"] = time_cuda(forward, warmup=warmup, iters=iters)["median_ms"]
        row["fwd_bwd_ms"] = time_cuda(fwd_bwd, warmup=warmup, iters=iters, before=clear)["median_ms"]
        row["fwd_bwd_gbps"] = min_bytes / row["fwd_bwd_ms"] / 1e6
        row["saved_bytes_per_row"] = saved_bytes_per_row(fn, x, w)
        table.append(row)
    eager = next(r for r in table if r["norm"] == "eager")
    for r in table:
        r["speedup_vs_eager"] = eager["fwd_bwd_ms"] / r["fwd_bwd_ms"]
    return result, table


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", action="append", help="rows,width (repeatable); default: 16384,2048 and 65536,2048")
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--no-compile", action="store_true", help="leave out the torch.compile peer")
    p.add_argument("--no-save", action="store_true")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every shape checked, then timed where the check passed: the rows, the checks per shape,
    the peers and their notes, and whether every check passed."""
    shapes = [tuple(map(int, s.split(","))) for s in args.shape] if args.shape else SHAPES
    fns, notes = peers(not args.no_compile)
    checks, rows, ok = {}, [], True
    for r, d in shapes:
        result, table = bench_shape(r, d, fns, args.iters, args.warmup)
        checks[f"{r}x{d}"] = result
        ok = ok and result["ok"]
        rows.extend(table)
        if not result["ok"]:
            print(f"{r}x{d}: the check failed, not timed: {result}", file=sys.stderr)
    return {"shapes": shapes, "peers": sorted(fns), "notes": notes, "checks": checks, "rows": rows, "ok": ok}


def report(args: argparse.Namespace, got: dict[str, Any]) -> None:
    print_table(got["rows"], ["shape", "norm", "fwd_ms", "fwd_bwd_ms", "fwd_bwd_gbps", "speedup_vs_eager", "saved_bytes_per_row"])
    for shape, result in got["checks"].items():
        print(shape, {k: v for k, v in result.items() if k.startswith("fused_") or k.endswith("_error")})
    payload = {
        "benchmark": "rmsnorm",
        "environment": environment(),
        "config": {
            "shapes": got["shapes"],
            "dtype": "bfloat16",
            "eps": EPS,
            "iters": args.iters,
            "warmup": args.warmup,
            "timing": "CUDA-event median",
            "peers": got["peers"],
            "notes": got["notes"],
        },
        "checks": got["checks"],
        "results": got["rows"],
    }
    save_result("norm", payload, save=not args.no_save)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.norm needs a CUDA GPU", file=sys.stderr)
        return 2
    got = run(args)
    report(args, got)
    return 0 if got["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
