"""The expert weight gradient with gradient accumulation: torch's grouped GEMM plus a separate add
(the reference) against the GEMM that accumulates in its epilogue (moe/kernels/grouped_wgrad.py).

    python -m bench.wgrad                      # OLMoE width (fp32 accumulator) and the paper
                                               # experts stage at 8 and 128 experts (bf16 accumulator)
    python -m bench.wgrad --configs all        # every tile config of the fused kernel
    python -m bench.wgrad --fp8 [--configs all] # the FP8 weight gradient at paper and OLMoE width:
                                               # bf16 fused, FP8 GEMM + add_, FP8 fused (+ quantisation)
    python -m bench.wgrad --orders             # the shipped tile with its experts in index order and
                                               # heaviest first (checked bitwise against each other)
    python -m bench.wgrad --ws                 # the Triton kernel against the warp-specialised Gluon one

Per case, both expert weights (gate_up: grad [R, 2h], x [R, d]; down: grad [R, d], x [R, h]).
Random routing (multinomial counts over the experts), dropless; the "-collapsed" cases send every
row to 8 of the experts (max/mean load 16 at 128 experts: what the Qwen-like `moe train` run's
layers 1-7 show in its first steps). Outputs are checked against an
fp32 per-expert reference before anything is timed. TFLOP/s = 2 * R * M * K / time (the GEMM
alone; the accumulator's read and write are what the fused kernel hides in it).
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench.common import environment, matmul_peak_tflops, print_table, save_result, time_cuda
from moe.kernels import grouped_wgrad_ws as ws

# name, d, h, experts, top_k, tokens per micro-batch, accumulator dtype
CASES = [
    ("olmoe", 2048, 1024, 64, 8, 16384, torch.float32),
    ("paper-experts-8", 2048, 2048, 8, 4, 8192, torch.bfloat16),
    ("paper-experts-128", 2048, 2048, 128, 4, 8192, torch.bfloat16),
    ("qwen-like", 2048, 768, 128, 8, 16384, torch.float32),
    ("qwen-like-collapsed", 2048, 768, 128, 8, 16384, torch.float32),
]
COLLAPSED_EXPERTS = 8  # the experts a "-collapsed" case's rows all go to
# name, d, h, experts, top_k, tokens per micro-batch (fp32 accumulator: the master gradient)
FP8_CASES = [
    ("paper", 4096, 4096, 64, 4, 16384),
    ("olmoe", 2048, 1024, 64, 8, 16384),
]
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages[, blocks per SM, split epilogue]); two blocks per SM
# (one's accumulator epilogue beside the other's GEMM) lost at every shape (T231453Z)
FP8_CONFIGS = [
    (128, 256, 128, 8, 3),
    (256, 128, 128, 8, 3, 1, True),
    (256, 128, 64, 8, 4, 1, True),
    (128, 256, 64, 8, 5, 1, True),
    (128, 128, 128, 8, 2, 2, True),
]
# the bf16 kernel with two blocks per SM, beside its shipped config (in the --fp8 cases)
BF16_TWO_BLOCK_CONFIGS = [
    (128, 128, 64, 4, 2, 2, True),
    (128, 128, 32, 4, 3, 2, True),
    (128, 128, 64, 8, 2, 2, True),
]
# (Triton's flattened persistent loop and warp specialisation were swept too, and lost or tied at
# every shape: wgrad-NVIDIA-H200-20261203T211131Z.json, bench/NOTES.md; removed)
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


def case_counts(name: str, experts: int, rows: int, gen: torch.Generator) -> torch.Tensor:
    """Rows per expert: multinomial over all experts, or over COLLAPSED_EXPERTS random ones."""
    device = gen.device
    if name.endswith("-collapsed"):
        hot = torch.randperm(experts, device=device, generator=gen)[:COLLAPSED_EXPERTS]
        return torch.bincount(hot[torch.randint(0, COLLAPSED_EXPERTS, (rows,), device=device, generator=gen)], minlength=experts)
    return torch.bincount(torch.randint(0, experts, (rows,), device=device, generator=gen), minlength=experts)


def run_case(name, d, h, experts, top_k, tokens, acc_dtype, configs, iters, switch: str | None = None) -> list[dict]:
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    rows = tokens * top_k
    ends = case_counts(name, experts, rows, gen).cumsum(0).to(torch.int32)
    out = []
    for weight, m, k in (("gate_up", 2 * h, d), ("down", d, h)):
        grad = torch.randn(rows, m, device=device, dtype=torch.bfloat16, generator=gen)
        x = torch.randn(rows, k, device=device, dtype=torch.bfloat16, generator=gen)
        acc = torch.zeros(experts, m, k, device=device, dtype=acc_dtype)
        if switch:
            out += time_switch(f"{name} {weight}", grad, x, ends, acc, switch, iters)
        else:
            out += time_weight(f"{name} {weight}", grad, x, ends, acc, configs, iters)
        del grad, x, acc
        torch.cuda.empty_cache()
    return out


# The side-by-side switches (--orders): (flag, [(variant, grouped_wgrad keyword)]); the first variant
# is the reference every other is checked bitwise against before anything is timed. (The accumulator
# tile asked of L2 before the main loop, PTX prefetch.global.L2::evict_last, was measured this way and
# lost: 0.91-0.93x on random routing, tied in the step; bench/results/wgrad_prefetch/; removed. A Gluon
# kernel reading each tile's old sum by TMA under its main loop, with loads ahead across tiles, was
# bitwise equal and 0.90-0.92x at best: bench/results/wgrad_overlap/, `git show 28eab87`; removed.)
SWITCHES = {
    "orders": [("index order", {"ordered": False}), ("heaviest first", {"ordered": True})],
    # the warp-specialised Gluon kernel (moe/kernels/grouped_wgrad_ws.py) beside the Triton one
    "ws": [("triton", {"kernel": "triton"})] + [(f"ws {name}", {"kernel": "ws", "ws_config": cfg}) for name, cfg in ws.CONFIGS.items()],
}


def time_switch(label, grad, x, ends, acc, switch, iters) -> list[dict]:
    """The shipped tile accumulating into a non-zero fp32 sum under each variant of one switch
    (SWITCHES), every result checked bitwise against the first variant's before any is timed.
    For orders, also the expert ranking alone. (One descriptor per operand with a masked last
    block of rows, and the fp32 sum added by TMA's reduce, were measured here too and lost at
    every shape: wgrad-NVIDIA-H200-20261204T174833Z.json, -T175331Z.json; removed.)"""
    from moe.kernels import grouped_wgrad as gw

    variants = SWITCHES[switch]
    flops = 2 * grad.shape[0] * grad.shape[1] * x.shape[1]
    base = torch.randn(acc.shape, device=acc.device, generator=torch.Generator(device=acc.device).manual_seed(1)).to(acc.dtype)
    want = base.clone()
    gw.grouped_wgrad(grad, x, ends, want, accumulate=True, **variants[0][1])
    nonempty = int(torch.nonzero(torch.diff(ends, prepend=ends.new_zeros(1))).flatten()[0])
    first = slice(int(ends[nonempty - 1]) if nonempty else 0, int(ends[nonempty]))
    ref = grad[first].float().t() @ x[first].float()
    err = ((want[nonempty].float() - base[nonempty].float() - ref).norm() / ref.norm()).item()
    out = []
    for variant, kwargs in variants:
        got = base.clone()
        gw.grouped_wgrad(grad, x, ends, got, accumulate=True, **kwargs)
        same = torch.equal(got, want)
        del got
        row = {"case": label, "variant": variant, "accumulator": str(acc.dtype).removeprefix("torch."), "rel_err": err, "bitwise": same}
        if not same:
            out.append(row | {"median_ms": float("nan"), "tflops": float("nan"), "error": f"differs from {variants[0][0]}"})
            continue
        ms = time_cuda(lambda kwargs=kwargs: gw.grouped_wgrad(grad, x, ends, acc, accumulate=True, **kwargs), iters=iters)["median_ms"]
        out.append(row | {"median_ms": ms, "tflops": flops / ms / 1e9})
    if switch == "orders":
        ms = time_cuda(lambda: gw.expert_order(ends), iters=iters)["median_ms"]
        out.append({"case": label, "variant": "expert_order alone", "accumulator": "-", "median_ms": ms, "tflops": None, "rel_err": None})
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
    if ws.supports(grad, x, acc):  # the shipped path on sm90: the warp-specialised kernel
        fresh = torch.full_like(acc, float("nan"))
        gw.grouped_wgrad(grad, x, ends, fresh, accumulate=False, kernel="ws")
        err = ((fresh[:4].float() - ref).norm() / ref.norm()).item()
        del fresh
        ms = time_cuda(lambda: gw.grouped_wgrad(grad, x, ends, acc, accumulate=True, kernel="ws"), iters=iters)["median_ms"]
        out.append(row("fused ws (the default on sm90)", ms, err))
    return out


def run_fp8_case(name, d, h, experts, top_k, tokens, configs, iters) -> list[dict]:
    """Both expert weights of one case, random routing, dropless, fp32 accumulator."""
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    rows = tokens * top_k
    counts = torch.bincount(torch.randint(0, experts, (rows,), device=device, generator=gen), minlength=experts)
    ends = counts.cumsum(0).to(torch.int32)
    out = []
    for weight, m, k in (("gate_up", 2 * h, d), ("down", d, h)):
        grad = torch.randn(rows, m, device=device, dtype=torch.bfloat16, generator=gen)
        x = torch.randn(rows, k, device=device, dtype=torch.bfloat16, generator=gen)
        out += time_fp8_weight(f"{name} {weight}", grad, x, ends, configs, iters)
        del grad, x
        torch.cuda.empty_cache()
    return out


def _dequantised_reference(gt, sg, xt, sx, padded, experts: int) -> torch.Tensor:
    """The first four experts' weight gradients from the FP8 operands, in fp32: what the FP8
    GEMM computes, to check it against."""
    m, k = gt.shape[0], xt.shape[0]
    ref, start = [], 0
    for g, end in enumerate(padded[:4].tolist()):
        a = gt[:, start:end].float() * sg.view(experts, m)[g, :, None]
        b = xt[:, start:end].float() * sx.view(experts, k)[g, :, None]
        ref.append(a @ b.t())
        start = end
    return torch.stack(ref)


def _time_configs(prefix, configs, launch, acc, check, row, iters) -> list[dict]:
    """One row per tile config of an accumulating kernel (``launch(out, accumulate, config)``),
    each checked first (``check(out) -> (error, error against the bf16 rows)``); a config that
    does not fit or gets a wrong result is reported, not timed."""
    out = []
    for cfg in configs:
        fresh = torch.full_like(acc, float("nan"))
        try:
            launch(fresh, False, cfg)
            torch.cuda.synchronize()
        except Exception as exc:  # a tile config that does not fit (shared memory)
            out.append(row(f"{prefix} {cfg}", float("nan")) | {"error": str(exc).splitlines()[0][:120]})
            continue
        err, err_exact = check(fresh)
        if not torch.isfinite(fresh).all() or err > 1e-3:
            out.append(row(f"{prefix} {cfg}", float("nan"), err) | {"error": "wrong result"})
            continue
        out.append(row(f"{prefix} {cfg}", time_cuda(lambda cfg=cfg: launch(acc, True, cfg), iters=iters)["median_ms"], err, err_exact))
    return out


def time_fp8_weight(label, grad, x, ends, configs, iters) -> list[dict]:
    """The bf16 accumulating GEMM (the default before), torch's FP8 grouped GEMM plus a separate
    add (FP8 wgrad before the sink), and the FP8 accumulating GEMM on pre-quantised operands and
    with the two column quantisations it needs. Each FP8 result is checked against the
    dequantised operands multiplied per expert in fp32 before it is timed."""
    from moe.kernels import grouped_wgrad as gw
    from moe.kernels.fp8 import quantize_cols_grouped

    experts, m, k = ends.numel(), grad.shape[1], x.shape[1]
    acc = torch.zeros(experts, m, k, device=grad.device, dtype=torch.float32)
    flops = 2 * grad.shape[0] * m * k

    def quantise():
        gt, sg, padded = quantize_cols_grouped(grad, ends, pad=True)
        xt, sx, _ = quantize_cols_grouped(x, ends, pad=True)
        return gt, sg, xt, sx, padded

    gt, sg, xt, sx, padded = operands = quantise()
    exact = _reference(grad[: int(ends[3])], x[: int(ends[3])], ends[:4])
    ref = _dequantised_reference(*operands, experts)

    def row(variant, ms, err=None, err_exact=None):
        return {
            "case": label,
            "variant": variant,
            "accumulator": "float32",
            "median_ms": ms,
            "tflops": flops / ms / 1e9,
            "rel_err": err,
            "rel_err_vs_bf16_rows": err_exact,
        }

    def rel(t, r):
        return ((t[:4].float() - r).norm() / r.norm()).item()

    def bf16(out, add, cfg=None):
        gw.grouped_wgrad(grad, x, ends, out, accumulate=add, config=cfg)

    def fp8(out, add, cfg=None):
        gw.grouped_wgrad_fp8(*operands, out, accumulate=add, config=cfg)

    def scaled():
        return torch._scaled_grouped_mm(gt, xt.t(), sg, sx, offs=padded, out_dtype=torch.bfloat16, use_fast_accum=True)

    out = _time_configs("bf16 fused", [None], bf16, acc, lambda t: (rel(t, exact),) * 2, row, iters)
    out[0]["variant"] = "bf16 fused (default)"
    out += _time_configs("bf16 fused", BF16_TWO_BLOCK_CONFIGS if len(configs) > 1 else [], bf16, acc, lambda t: (rel(t, exact),) * 2, row, iters)
    check = scaled()
    out.append(
        row("fp8 scaled_grouped_mm + add_", time_cuda(lambda: acc.add_(scaled()), iters=iters)["median_ms"], rel(check, ref), rel(check, exact))
    )
    del check
    out += _time_configs("fp8 fused", configs, fp8, acc, lambda t: (rel(t, ref), rel(t, exact)), row, iters)
    out.append(row("quantise both operands", time_cuda(quantise, iters=iters)["median_ms"]))
    out.append(
        row("fp8 quantise + fused (shipped)", time_cuda(lambda: gw.grouped_wgrad_fp8(*quantise(), acc, accumulate=True), iters=iters)["median_ms"])
    )
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="default", help="default (the shipped CUDA_CONFIG) or all")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--fp8", action="store_true", help="the FP8 weight-gradient cases (FP8_CASES)")
    p.add_argument("--orders", action="store_true", help="the shipped tile with its experts in index order and heaviest first")
    p.add_argument("--ws", action="store_true", help="the Triton kernel against the warp-specialised Gluon one (bitwise checked)")
    p.add_argument("--case", action="append", default=None, help="only this case (repeatable; default: every case)")
    p.add_argument("--no-save", action="store_true")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> list[dict]:
    """Every case and variant; each row also against the reference (grouped_mm + add_)."""
    from moe.kernels import grouped_wgrad as gw

    rows = []
    if args.fp8:
        for case in [c for c in FP8_CASES if args.case is None or c[0] in args.case]:
            rows += run_fp8_case(*case, FP8_CONFIGS if args.configs == "all" else [gw.FP8_CUDA_CONFIG], args.iters)
    else:
        for case in [c for c in CASES if args.case is None or c[0] in args.case]:
            rows += run_case(*case, CONFIGS if args.configs == "all" else [gw.CUDA_CONFIG], args.iters, switch(args))
    reference = ("grouped_mm + add_ (reference)", "bf16 fused (default)") + tuple(v[0][0] for v in SWITCHES.values())
    for r in rows:
        ref = next(x for x in rows if x["case"] == r["case"] and x["variant"] in reference)
        r["reference_over_this"] = ref["median_ms"] / r["median_ms"] if r["median_ms"] == r["median_ms"] else None
    return rows


def switch(args: argparse.Namespace) -> str | None:
    """The side-by-side switch asked for (SWITCHES), if any."""
    return next((name for name in SWITCHES if getattr(args, name)), None)


def report(args: argparse.Namespace, rows: list[dict]) -> None:
    columns = ["case", "variant", "accumulator", "median_ms", "tflops", "reference_over_this", "rel_err"]
    print_table(rows, columns + (["rel_err_vs_bf16_rows"] if args.fp8 else []) + (["bitwise"] if switch(args) else []))
    if not args.no_save:
        payload = {
            "environment": environment(),
            "config": {
                "routing": "random, dropless; -collapsed cases: every row to 8 random experts",
                "iters": args.iters,
                "cases": [c[:6] for c in (FP8_CASES if args.fp8 else CASES)],
                "flops": "2*R*M*K",
                "reference": "bf16 fused (default)" if args.fp8 else (SWITCHES[switch(args)][0][0] if switch(args) else "grouped_mm + add_"),
            },
            "matmul_peak_tflops": matmul_peak_tflops(),
            "rows": rows,
        }
        save_result("wgrad-fp8" if args.fp8 else "wgrad", payload)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.wgrad needs a CUDA GPU", file=sys.stderr)
        return 2
    report(args, run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
