"""The fixed-point accumulation of train.layout_invariant on one GPU: one micro-batch's fp32
gradient of an OLMoE-width expert weight (64 x 2048 x 1024 values) folded into its int64 sum,
by the torch path (aminmax, scale, round, convert, add) and by the fused kernel at several
launch shapes, against a plain int64 ``add_`` of the same size as the bandwidth yardstick
(reads 16 and writes 8 bytes per value; the fused kernel reads 12 and writes 8). Each variant's
sum is checked bitwise against the torch path's before it is timed (a random gradient, not zeros).

    python -m bench.fixed_point [--numel N] [--iters 50]

Prints a table (median ms, GB/s of the bytes each variant must move) and writes JSON to
bench/results/fixed_point-<device>-<time>.json."""

from __future__ import annotations

import argparse
import sys

import torch

from bench.common import environment, print_table, save_result, time_cuda

LAUNCHES = [
    {"BLOCK": 4096, "ITERS": 1, "num_warps": 4},
    {"BLOCK": 4096, "ITERS": 1, "num_warps": 8},
    {"BLOCK": 2048, "ITERS": 4, "num_warps": 4},
    {"BLOCK": 2048, "ITERS": 8, "num_warps": 8},
    {"BLOCK": 4096, "ITERS": 4, "num_warps": 8},
    {"BLOCK": 8192, "ITERS": 2, "num_warps": 16},
    {"BLOCK": 1024, "ITERS": 16, "num_warps": 4},
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--numel", type=int, default=64 * 2048 * 1024)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--no-save", action="store_true")
    args = p.parse_args(argv)
    from moe.kernels import fixed_point as kernels
    from moe.parallel import fixed_point as ref

    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    n = args.numel
    g = torch.randn(n, device=device, generator=gen) * 1e-3
    scales = ref.power_of_two(torch.tensor([40], dtype=torch.int32, device=device))
    start = torch.randint(-(2**40), 2**40, (n,), device=device, generator=gen)
    gb = n / 1e9

    def torch_path(total: torch.Tensor, maxima: torch.Tensor) -> torch.Tensor:
        s = ref.FixedPointScales(["w"], 4, device)
        s.scales, s.max_abs = scales, maxima
        saved, kernels.use_triton = kernels.use_triton, lambda t: False
        try:
            return s.observe_and_add(0, total, g.clone(), scratch)
        finally:
            kernels.use_triton = saved

    scratch = torch.empty(n, dtype=torch.int64, device=device)
    want_max = torch.zeros(1, device=device)
    want = torch_path(start.clone(), want_max)
    rows = []
    total = start.clone()
    rows.append({"variant": "int64 add_ (yardstick)", "bytes_per_value": 24, **_timed(lambda: total.add_(start), args.iters, 24 * gb)})
    maxima = torch.zeros(1, device=device)
    rows.append({"variant": "torch path", "bytes_per_value": 60, **_timed(lambda: torch_path(total, maxima), args.iters, 60 * gb)})
    for launch in LAUNCHES:
        kernels.QUANTIZE_LAUNCH = launch
        got_max = torch.zeros(1, device=device)
        got = kernels.observe_quantize_add(start.clone(), g, scales, got_max, 0)
        ok = torch.equal(got, want) and torch.equal(got_max, want_max)
        name = f"fused BLOCK={launch['BLOCK']} ITERS={launch['ITERS']} warps={launch['num_warps']}"
        if not ok:
            rows.append({"variant": name, "error": "differs from the torch path"})
            continue

        def fused(maxima=got_max):
            kernels.observe_quantize_add(total, g, scales, maxima, 0)

        rows.append({"variant": name, "bytes_per_value": 20, **_timed(fused, args.iters, 20 * gb)})
    print(f"{n:,} fp32 gradient values into an int64 sum, {torch.cuda.get_device_name()}")
    print_table(rows, ["variant", "bytes_per_value", "median_ms", "gb_per_s", "error"])
    save_result("fixed_point", {"environment": environment(), "config": {"numel": n, "iters": args.iters}, "rows": rows}, save=not args.no_save)
    return 0 if all("error" not in r for r in rows) else 1


def _timed(fn, iters: int, gbytes: float) -> dict:
    ms = time_cuda(fn, warmup=5, iters=iters)["median_ms"]
    return {"median_ms": round(ms, 4), "gb_per_s": round(gbytes / ms * 1e3, 1)}


if __name__ == "__main__":
    sys.exit(main())
