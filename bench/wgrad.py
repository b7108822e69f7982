"""The expert weight gradient with gradient accumulation: torch's grouped GEMM plus a separate add
(the reference) against the GEMM that accumulates in its epilogue (moe/kernels/grouped_wgrad.py).

    python -m bench.wgrad                      # OLMoE width (fp32 accumulator) and the paper
                                               # experts stage at 8 and 128 experts (bf16 accumulator)
    python -m bench.wgrad --configs all        # every tile config of the fused kernel

Per case, both expert weights (gate_up: grad [R, 2h], x [R, d]; down: grad [R, d], x [R, h]).
Random routing (multinomial counts over the experts), dropless. Outputs are checked against an
fp32 per-expert reference before anything is timed. TFLOP/s = 2 * R * M * K / time (the GEMM
alone; the accumulator's read and write are what the fused kernel hides in it).
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench.common import environment, matmul_peak_tflops, print_table, save_result, time_cuda

# name, d, h, experts, top_k, tokens per micro-batch, accumulator dtype
CASES = [
    ("olmoe", 2048, 1024, 64, 8, 16384, torch.float32),
    ("paper-experts-8", 2048, 2048, 8, 4, 8192, torch.bfloat16),
    ("paper-experts-128", 2048, 2048, 128, 4, 8192, torch.bfloat16),
]
CONFIGS = [
    (128, 256, 64, 8, 3),
    (128, 128, 64, 8, 4),
    (128, 128, 64, 8, 3),
    (128, 256, 64, 8, 2),
    (128, 128, 64, 4, 4),
    (128, 256, 32, 8, 3),
    (128, 256, 32, 8, 4),
]


def _reference(grad, x, ends) -> torch.Tensor:
    out, start = [], 0
    for end in ends.tolist():
        out.append(grad[start:end].float().t() @ x[start:end].float())
        start = end
    return torch.stack(out)


def run_case(name, d, h, experts, top_k, tokens, acc_dtype, configs, iters) -> list[dict]:
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    rows = tokens * top_k
    counts = torch.bincount(torch.randint(0, experts, (rows,), device=device, generator=gen), minlength=experts)
    ends = counts.cumsum(0).to(torch.int32)
    out = []
    for weight, m, k in (("gate_up", 2 * h, d), ("down", d, h)):
        grad = torch.randn(rows, m, device=device, dtype=torch.bfloat16, generator=gen)
        x = torch.randn(rows, k, device=device, dtype=torch.bfloat16, generator=gen)
        out += time_weight(f"{name} {weight}", grad, x, ends, torch.zeros(experts, m, k, device=device, dtype=acc_dtype), configs, iters)
        torch.cuda.empty_cache()
    return out


def time_weight(label, grad, x, ends, acc, configs, iters) -> list[dict]:
    """Every variant for one expert weight; accumulating into ``acc``."""
    from moe.kernels import grouped_wgrad as gw
    from moe.layers.gemm import grouped_mm

    rows, m, k = grad.shape[0], grad.shape[1], x.shape[1]
    ref = _reference(grad[: int(ends[3])], x[: int(ends[3])], ends[:4])  # four experts checked
    flops = 2 * rows * m * k
    out = []

    def row(variant: str, ms: float, err: float | None) -> dict:
        return {
            "case": label,
            "variant": variant,
            "accumulator": str(acc.dtype).removeprefix("torch."),
            "median_ms": ms,
            "tflops": flops / ms / 1e9,
            "rel_err": err,
        }

    def separate():
        acc.add_(grouped_mm(grad.t(), x, offs=ends))

    check = grouped_mm(grad.t(), x, offs=ends)[:4].float()
    err_sep = ((check - ref).norm() / ref.norm()).item()
    out.append(row("grouped_mm alone", time_cuda(lambda: grouped_mm(grad.t(), x, offs=ends), iters=iters)["median_ms"], err_sep))
    out.append(row("grouped_mm + add_ (reference)", time_cuda(separate, iters=iters)["median_ms"], err_sep))
    for cfg in configs:
        fresh = torch.full_like(acc, float("nan"))
        try:
            gw.grouped_wgrad(grad, x, ends, fresh, accumulate=False, config=cfg)
            torch.cuda.synchronize()
        except Exception as exc:  # a tile config that does not fit (shared memory)
            out.append(row(f"fused {cfg}", float("nan"), None) | {"error": str(exc).splitlines()[0][:120]})
            continue
        err = ((fresh[:4].float() - ref).norm() / ref.norm()).item()
        if not torch.isfinite(fresh).all() or err > 1e-2:
            out.append(row(f"fused {cfg}", float("nan"), err) | {"error": "wrong result"})
            continue
        del fresh

        def fused(cfg=cfg):
            gw.grouped_wgrad(grad, x, ends, acc, accumulate=True, config=cfg)

        out.append(row(f"fused {cfg}", time_cuda(fused, iters=iters)["median_ms"], err))
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="default", help="default (the shipped CUDA_CONFIG) or all")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--no-save", action="store_true")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> list[dict]:
    """Every case and variant; each row also against the reference (grouped_mm + add_)."""
    from moe.kernels import grouped_wgrad as gw

    configs = CONFIGS if args.configs == "all" else [gw.CUDA_CONFIG]
    rows = []
    for case in CASES:
        rows += run_case(*case, configs, args.iters)
    for r in rows:
        ref = next(x for x in rows if x["case"] == r["case"] and x["variant"].startswith("grouped_mm +"))
        r["reference_over_this"] = ref["median_ms"] / r["median_ms"] if r["median_ms"] == r["median_ms"] else None
    return rows


def report(args: argparse.Namespace, rows: list[dict]) -> None:
    print_table(rows, ["case", "variant", "accumulator", "median_ms", "tflops", "reference_over_this", "rel_err"])
    if not args.no_save:
        payload = {
            "environment": environment(),
            "config": {"routing": "random, dropless", "iters": args.iters, "cases": [c[:6] for c in CASES], "flops": "2*R*M*K"},
            "matmul_peak_tflops": matmul_peak_tflops(),
            "rows": rows,
        }
        save_result("wgrad", payload)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.wgrad needs a CUDA GPU", file=sys.stderr)
        return 2
    report(args, run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
