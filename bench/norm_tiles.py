"""The Triton RMSNorm's launch shapes against torch's fused ``F.rms_norm`` (the bf16 path), on
one GPU: forward (rows per program, warps) and backward (programs, rows per iteration, warps,
stages) swept at [16384, 2048] bf16, the OLMoE-width norm of one 4 x 4,096-token micro-batch.

    python -m bench.norm_tiles [--rows 16384] [--width 2048] [--iters 100]

Every launch's y, rstd, dx and dweight are checked against the default launch's (within one bf16
step: another launch sums a row, and the weight gradient's rows, in another order) before it
is timed; the default's and torch's dx against an fp32 computation. Prints the table (median us, TB/s of the minimum
traffic: forward reads x and writes y, backward reads x and dy and writes dx) and writes JSON
to bench/results/norm_tiles-<device>-<time>.json."""

from __future__ import annotations

import argparse
import itertools
import sys

import torch
import torch.nn.functional as F

from bench.common import environment, print_table, save_result, time_cuda

FWD = [(r, w) for r in (1, 2, 4, 8) for w in (4, 8, 16)]
BWD = [(p, r, w, s) for p, r, w, s in itertools.product((264, 528, 1056, 2112), (1, 2, 4), (4, 8, 16), (1, 3)) if r * 2048 // (32 * w) >= 4]


def close(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-2) -> bool:
    """Within ``rel`` of b's largest magnitude (another launch sums a row in another order)."""
    return bool((a.float() - b.float()).abs().max() <= rel * b.float().abs().max())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args(argv)
    from moe.kernels import rmsnorm as k

    gen = torch.Generator(device="cuda").manual_seed(0)
    m, d = args.rows, args.width
    x = torch.randn(m, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = (1 + 0.1 * torch.randn(d, device="cuda", generator=gen)).to(torch.bfloat16)
    dy = torch.randn(m, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    eps = 1e-5
    nbytes_f, nbytes_b = 2 * m * d * 2, 3 * m * d * 2
    y0, r0 = k.rms_norm_forward(x, w, eps)
    dx0, dw0 = k.rms_norm_backward(dy, x, w, r0)
    rows = []

    def row(kind, launch, us, nbytes):
        rows.append({"pass": kind, "launch": launch, "median_us": us, "tb_per_s": nbytes / us / 1e6})

    # torch's fused norm: forward, and forward + backward minus forward
    xt = x.clone().requires_grad_(True)
    wt = w.clone().requires_grad_(True)
    yt = F.rms_norm(xt, (d,), wt, eps)
    yt.backward(dy)
    truth_dx = torch.func.vjp(lambda a: F.rms_norm(a.float(), (d,), w.float(), eps), x.float())[1](dy.float())[0]
    assert (xt.grad.float() - truth_dx).abs().max() / truth_dx.abs().max() < 1e-2
    assert (dx0.float() - truth_dx).abs().max() / truth_dx.abs().max() < 1e-2
    f = time_cuda(lambda: F.rms_norm(x, (d,), w, eps), iters=args.iters)["median_ms"] * 1e3

    def torch_both():
        xt.grad = wt.grad = None
        F.rms_norm(xt, (d,), wt, eps).backward(dy)

    fb = time_cuda(torch_both, iters=args.iters)["median_ms"] * 1e3
    row("fwd", "torch F.rms_norm", f, nbytes_f)
    row("bwd", "torch F.rms_norm (fwd+bwd - fwd)", fb - f, nbytes_b)
    for r, wp in FWD:
        y, rs = k.rms_norm_forward(x, w, eps, rows=r, warps=wp)
        assert close(y, y0) and close(rs, r0, 1e-6), (r, wp)
        row(
            "fwd",
            f"rows {r} warps {wp}",
            time_cuda(lambda r=r, wp=wp: k.rms_norm_forward(x, w, eps, rows=r, warps=wp), iters=args.iters)["median_ms"] * 1e3,
            nbytes_f,
        )
    for p, r, wp, st in BWD:
        dx, dw = k.rms_norm_backward(dy, x, w, r0, programs=p, rows=r, warps=wp, stages=st)
        assert close(dx, dx0) and close(dw, dw0), (p, r, wp, st)
        us = time_cuda(lambda p=p, r=r, wp=wp, st=st: k.rms_norm_backward(dy, x, w, r0, programs=p, rows=r, warps=wp, stages=st), iters=args.iters)
        row("bwd", f"programs {p} rows {r} warps {wp} stages {st}", us["median_ms"] * 1e3, nbytes_b)
    best = {
        kind: min((x for x in rows if x["pass"] == kind and not x["launch"].startswith("torch")), key=lambda x: x["median_us"])
        for kind in ("fwd", "bwd")
    }
    rows.sort(key=lambda x: (x["pass"], x["median_us"]))
    print_table([x for x in rows if x["pass"] == "fwd"] + [x for x in rows if x["pass"] == "bwd"][:16], ["pass", "launch", "median_us", "tb_per_s"])
    print("best:", best)
    save_result("norm_tiles", {"environment": environment(), "config": vars(args), "rows": rows, "best": best}, save=not args.no_save)
    return 0


if __name__ == "__main__":
    sys.exit(main())
