"""FP8 rowwise expert GEMMs on the GPU: correctness first, then each GEMM against bf16.

    python -m bench.fp8 check        # real torch._scaled_grouped_mm against the emulation (subprocess-safe)
    python -m bench.fp8 gemm         # fwd / dgrad / wgrad of both projections, bf16 vs FP8, 3 shapes
    python -m bench.fp8 quant        # the wgrad operands' column quantisation: launch sweep, previous kernel, cast roofline

``check`` runs the three FP8 GEMMs on ragged groups (one empty) through torch's kernel and
through the emulation (the same quantised operands, dequantised, fp32 GEMM) and the Triton
quantisation kernels against the torch path; it prints one JSON line. Run it in its own
process: a bad operand layout can break the CUDA context.

``gemm`` times, at 16384 tokens and balanced expert loads (random data, CUDA-event medians):
each GEMM in bf16 (torch._grouped_mm) and in FP8 including its quantisation passes, the bare
FP8 GEMM on pre-quantised operands (so the quantisation cost is visible), and, when torchao
imports, torchao's FP8 rowwise grouped GEMM forward + backward next to ours. It also prints
which GEMMs the per-shape rule (moe.layers.gemm_fp8.Fp8Rule) sends to FP8.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch

from bench.common import environment, print_table, rel_error, time_cuda, write_result
from moe.kernels import fp8 as q8
from moe.layers.gemm import GroupedMM, grouped_mm
from moe.layers.gemm_fp8 import Fp8GroupedGemm, Fp8Rule, _dgrad, _forward_fp8, _wgrad, scaled_grouped_mm

SHAPES = [(2048, 1024, 64, 8), (4096, 4096, 64, 4), (2048, 768, 128, 8)]


def check(dev: torch.device | None = None) -> dict[str, Any]:
    dev = dev or torch.device("cuda")
    torch.manual_seed(0)
    counts = torch.tensor([40, 0, 333, 17, 128, 1, 250, 255])
    offsets = counts.cumsum(0).to(torch.int32).to(dev)
    n, g, m, k = int(counts.sum()), len(counts), 256, 512
    x = torch.randn(n, k, device=dev).bfloat16()
    w = (torch.randn(g, m, k, device=dev) * 0.05).bfloat16()
    grad = torch.randn(n, m, device=dev).bfloat16()
    res: dict[str, Any] = {}
    xq, sx = q8.quantize_rows(x)
    ref_cpu = q8.quantize_rows(x.cpu())
    res["kernel_rows_scales_equal"] = bool(torch.equal(sx.cpu(), ref_cpu[1]))
    res["kernel_rows_codes_equal"] = float((xq.cpu().float() == ref_cpu[0].float()).float().mean())
    cq, cs, cp = q8.quantize_cols_grouped(grad, offsets, pad=True)
    rq, rs, rp = q8.quantize_cols_grouped(grad.cpu(), offsets.cpu(), pad=True)
    res["kernel_cols_scales_equal"] = bool(torch.equal(cs.cpu(), rs))
    res["kernel_cols_codes_equal"] = float((cq.cpu().float() == rq.float()).float().mean())
    h = torch.randn(n, 2 * m, device=dev).bfloat16()
    sq, ss = q8.swiglu_quantize(h)
    tq, ts = q8.swiglu_quantize(h.cpu())
    res["kernel_swiglu_scales_equal"] = bool(torch.equal(ss.cpu(), ts))
    res["kernel_swiglu_codes_equal"] = float((sq.cpu().float() == tq.float()).float().mean())
    for name, fn in [
        ("fwd", lambda e: _forward_fp8(xq, sx, w, offsets, e)),
        ("dgrad", lambda e: _dgrad(grad, w, offsets, True, e)),
        ("wgrad", lambda e: _wgrad(grad, x, offsets, True, e)),
    ]:
        try:
            real = fn(False)
            torch.cuda.synchronize()
            emu = fn(True)
            res[f"{name}_rel_vs_emulated"] = rel_error(real, emu)
            bf16 = {
                "fwd": lambda: grouped_mm(x, w.transpose(-2, -1), offs=offsets),
                "dgrad": lambda: grouped_mm(grad, w, offs=offsets),
                "wgrad": lambda: grouped_mm(grad.t(), x, offs=offsets),
            }[name]()
            res[f"{name}_rel_vs_bf16"] = rel_error(real, bf16)
            if name == "wgrad":
                res["wgrad_empty_group_zero"] = bool(real[1].abs().max().item() == 0)
        except Exception as exc:  # reported, and the caller keeps that GEMM in bf16
            res[f"{name}_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
            torch.cuda.synchronize()
    res["ok"] = all(res.get(f"{n}_rel_vs_emulated", 1.0) < 1e-2 for n in ("fwd", "dgrad", "wgrad"))
    return res


def _torchao_gemm():
    try:
        from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm as f
    except Exception as exc:  # not installed or not importable on this torch
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    import torchao

    return (lambda x, w, offs: f(x, w.transpose(-2, -1), offs, pad_token_groups_for_grouped_mm=False)), torchao.__version__


def gemm_sweep(tokens: int, iters: int, shapes, dev: torch.device | None = None) -> list[dict[str, Any]]:
    dev = dev or torch.device("cuda")
    rule = Fp8Rule()
    ao, ao_note = _torchao_gemm()
    rows = []
    for d, hdim, e, k in shapes:
        n = tokens * k
        counts = torch.full((e,), n // e)
        counts[-1] += n - int(counts.sum())
        offsets = counts.cumsum(0).to(torch.int32).to(dev)
        for proj, (m, kk) in {"gate_up": (2 * hdim, d), "down": (d, hdim)}.items():
            g = torch.Generator(device=dev).manual_seed(0)
            x = torch.randn(n, kk, device=dev, generator=g).bfloat16()
            w = (torch.randn(e, m, kk, device=dev, generator=g) * 0.02).bfloat16()
            grad = torch.randn(n, m, device=dev, generator=g).bfloat16()
            xq, sx = q8.quantize_rows(x)
            wq, sw = q8.quantize_rows(w.reshape(e * m, kk))
            wq_t, sw2 = wq.view(e, m, kk).transpose(-2, -1), sw.view(e, m)
            plan = rule.plan(n, e, m, kk)
            flops = 2.0 * n * m * kk
            # The lambdas and closures below run within this iteration (B023); the names are del'd at its end to free GPU memory (F821).
            cases = {
                "fwd": (
                    lambda: grouped_mm(x, w.transpose(-2, -1), offs=offsets),  # noqa: B023, F821
                    lambda: _forward_fp8(*q8.quantize_rows(x), w, offsets, False),  # noqa: B023, F821
                    lambda: scaled_grouped_mm(xq, wq_t, sx, sw2, offsets, False),  # noqa: B023, F821
                    plan.fwd,
                ),
                "dgrad": (lambda: _dgrad(grad, w, offsets, False, False), lambda: _dgrad(grad, w, offsets, True, False), None, plan.dgrad),  # noqa: B023, F821
                "wgrad": (lambda: _wgrad(grad, x, offsets, False, False), lambda: _wgrad(grad, x, offsets, True, False), None, plan.wgrad),  # noqa: B023, F821
            }
            for gemm, (bf, f8, bare, chosen) in cases.items():
                row: dict[str, Any] = {
                    "shape": f"d={d}/h={hdim}/E={e}/k={k}",
                    "proj": proj,
                    "gemm": gemm,
                    "rows_per_expert": n // e,
                    "rule_fp8": chosen,
                }
                row["bf16_ms"] = time_cuda(bf, iters=iters)["median_ms"]
                row["fp8_ms"] = time_cuda(f8, iters=iters)["median_ms"]
                if bare is not None:
                    row["fp8_gemm_only_ms"] = time_cuda(bare, iters=iters)["median_ms"]
                row["bf16_tflops"] = flops / row["bf16_ms"] / 1e9
                row["fp8_tflops"] = flops / row["fp8_ms"] / 1e9
                row["speedup"] = row["bf16_ms"] / row["fp8_ms"]
                rows.append(row)
            # forward + backward of the projection: bf16, ours (all FP8), torchao
            xs, ws = x.clone().requires_grad_(True), w.clone().requires_grad_(True)

            def fb(gemm):
                def run():
                    gemm(xs, ws, offsets).backward(grad)  # noqa: B023, F821

                return run

            def clear():
                xs.grad = ws.grad = None  # noqa: B023, F821
                with torch.no_grad():
                    ws.mul_(1.0)  # noqa: B023, F821 - a weight update between calls: FP8 weight copies are remade

            row = {"shape": f"d={d}/h={hdim}/E={e}/k={k}", "proj": proj, "gemm": "fwd+bwd", "rows_per_expert": n // e}
            row["bf16_ms"] = time_cuda(fb(GroupedMM()), iters=iters, before=clear)["median_ms"]
            row["fp8_ms"] = time_cuda(fb(Fp8GroupedGemm(Fp8Rule(0))), iters=iters, before=clear)["median_ms"]
            row["speedup"] = row["bf16_ms"] / row["fp8_ms"]
            row["bf16_tflops"], row["fp8_tflops"] = 3 * flops / row["bf16_ms"] / 1e9, 3 * flops / row["fp8_ms"] / 1e9
            if ao is not None:
                try:
                    clear()
                    out = ao(xs, ws, offsets)
                    out.backward(grad)
                    ours = Fp8GroupedGemm(Fp8Rule(0))(x, w, offsets)
                    row["torchao_rel_vs_ours_out"] = rel_error(out, ours)
                    row["torchao_ms"] = time_cuda(fb(ao), iters=iters, before=clear)["median_ms"]
                    row["torchao_tflops"] = 3 * flops / row["torchao_ms"] / 1e9
                    row["ours_over_torchao"] = row["torchao_ms"] / row["fp8_ms"]
                except Exception as exc:
                    row["torchao_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            else:
                row["torchao_error"] = ao_note
            rows.append(row)
            del x, w, grad, xq, wq, xs, ws
            torch.cuda.empty_cache()
    return rows


def _random_routing(tokens: int, experts: int, k: int, dev) -> tuple[torch.Tensor, torch.Tensor]:
    """Random top-k routing (dropless): expert-ordered row -> token index, and cumulative ends."""
    g = torch.Generator(device=dev).manual_seed(1)
    choice = torch.rand(tokens, experts, device=dev, generator=g).topk(k, dim=1).indices.reshape(-1)
    order = torch.argsort(choice, stable=True)
    ends = torch.bincount(choice, minlength=experts).cumsum(0).to(torch.int32)
    return order // k, ends


QUANT_SWEEP = [
    {"BLOCK_R": r, "BLOCK_C": c, "num_warps": w, "programs": 16384}
    for r, c in ((64, 64), (128, 32), (128, 64), (128, 128), (256, 32), (256, 64))
    for w in (4, 8)
] + [{"BLOCK_R": 128, "BLOCK_C": 64, "num_warps": 4, "programs": p} for p in (4096, 65536)]


def _torch_reference(x: torch.Tensor, ends: torch.Tensor, kw: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """quantize_cols_grouped(pad=True) by the library's torch reference (device ops), on the GPU."""
    rows = x.index_select(0, kw["row_index"]) if "row_index" in kw else x
    if "row_scale" in kw:
        rows = rows.float() * kw["row_scale"].float()[:, None]
    width = q8.padded_width(rows.shape[0], ends.numel())
    dst = q8.padded_group_ends(ends, width)
    q = torch.empty(rows.shape[1], width, dtype=q8.E4M3, device=x.device)
    s = torch.empty(ends.numel() * rows.shape[1], dtype=torch.float32, device=x.device)
    q8._quant_cols_grouped_torch(rows, ends, dst, q, s, True)
    return q, s, dst


def quant_sweep(tokens: int, iters: int, shape, dev: torch.device | None = None) -> list[dict[str, Any]]:
    """The four column quantisations of one FP8 expert layer's backward (both wgrads' operands) at
    ``shape``: the split amax + quantise kernels at the shipped launch and at each launch of
    QUANT_SWEEP, the library's torch reference (device ops), and a plain bf16 -> e4m3 cast of the
    same rows (one read, one write: the bandwidth roofline). Every launch's bytes and scales are
    compared with the torch reference's before timing. (The previous kernel, one program per
    column block and group: bench/results/fp8-quant-NVIDIA-H200-20261202T124650Z.json.)"""
    dev = dev or torch.device("cuda")
    d, hdim, e, k = shape
    n = tokens * k
    row_index, ends = _random_routing(tokens, e, k, dev)
    g = torch.Generator(device=dev).manual_seed(0)
    tok = torch.randn(tokens, d, device=dev, generator=g).bfloat16()
    grad_out = torch.randn(tokens, d, device=dev, generator=g).bfloat16()
    weight = torch.rand(n, device=dev, generator=g)
    grad_h = torch.randn(n, 2 * hdim, device=dev, generator=g).bfloat16()
    act = torch.randn(n, hdim, device=dev, generator=g).bfloat16()
    cases = {
        "gate_up grad [N,2H]": (grad_h, {}),
        "tokens via index [N,D]": (tok, {"row_index": row_index}),
        "combine grad via index*w [N,D]": (grad_out, {"row_index": row_index, "row_scale": weight}),
        "swiglu act [N,H]": (act, {}),
    }
    default = dict(q8.COLS_LAUNCH)
    launches = [{"name": "shipped", **default}] + [{"name": "sweep", **c} for c in QUANT_SWEEP]
    rows = []

    def same(out, ref) -> bool:
        return all(
            torch.equal(a.view(torch.uint8) if a.dtype == q8.E4M3 else a, b.view(torch.uint8) if b.dtype == q8.E4M3 else b)
            for a, b in zip(out, ref, strict=True)
        )

    try:
        for case, (x, kw) in cases.items():
            cols = x.shape[1]
            moved = n * cols * (2 + 1)  # bytes: each row read once (bf16) and written once (e4m3): the floor
            ref = _torch_reference(x, ends, kw)
            rows_in = x.index_select(0, row_index) if "row_index" in kw else x
            cast_ms = time_cuda(lambda: rows_in.to(q8.E4M3), iters=iters)["median_ms"]  # noqa: B023
            torch_ms = time_cuda(lambda: _torch_reference(x, ends, kw), iters=iters)["median_ms"]  # noqa: B023
            for launch in launches:
                q8.COLS_LAUNCH = {key: v for key, v in launch.items() if key != "name"}
                ok = same(q8.quantize_cols_grouped(x, ends, pad=True, **kw), ref)
                ms = time_cuda(lambda: q8.quantize_cols_grouped(x, ends, pad=True, **kw), iters=iters)["median_ms"]  # noqa: B023
                rows.append(
                    {
                        "case": case,
                        "launch": launch["name"],
                        "config": "/".join(str(launch[key]) for key in ("BLOCK_R", "BLOCK_C", "num_warps", "programs")),
                        "equal_to_torch_reference": ok,
                        "ms": ms,
                        "torch_reference_ms": torch_ms,
                        "cast_ms": cast_ms,
                        "GB_per_s_at_floor_bytes": moved / ms / 1e6,
                        "over_cast": ms / cast_ms,
                    }
                )
    finally:
        q8.COLS_LAUNCH = default
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["check", "gemm", "quant"])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--shape", action="append", help="d,h,E,k (repeatable); default: the three shapes")
    p.add_argument("--no-save", action="store_true")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.fp8 needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.what == "check":
        res = check()
        print(json.dumps(res))
        return 0 if res["ok"] else 1
    shapes = [tuple(map(int, s.split(","))) for s in args.shape] if args.shape else SHAPES
    if args.what == "quant":
        rows = [r | {"shape": ",".join(map(str, sh))} for sh in shapes for r in quant_sweep(args.tokens, args.iters, sh)]
        print_table(
            rows,
            [
                "shape",
                "case",
                "launch",
                "config",
                "equal_to_torch_reference",
                "ms",
                "torch_reference_ms",
                "cast_ms",
                "over_cast",
                "GB_per_s_at_floor_bytes",
            ],
        )
        payload = {
            "benchmark": "fp8_column_quantisation",
            "environment": environment(),
            "config": {
                "tokens": args.tokens,
                "iters": args.iters,
                "warmup": 5,
                "shapes": shapes,
                "routing": "random top-k, dropless",
                "floor_bytes": "rows x cols x (2 read + 1 written)",
                "shipped_launch": q8.COLS_LAUNCH,
            },
            "results": rows,
        }
        if not args.no_save:
            print(f"wrote {write_result('fp8-quant', payload)}")
        return 0 if all(r["equal_to_torch_reference"] for r in rows) else 1
    rows = gemm_sweep(args.tokens, args.iters, shapes)
    print_table(
        rows,
        [
            "shape",
            "proj",
            "gemm",
            "rows_per_expert",
            "rule_fp8",
            "bf16_ms",
            "fp8_ms",
            "fp8_gemm_only_ms",
            "bf16_tflops",
            "fp8_tflops",
            "speedup",
            "torchao_ms",
            "ours_over_torchao",
            "torchao_error",
        ],
    )
    payload = {
        "benchmark": "fp8_expert_gemms",
        "environment": environment(),
        "config": {"tokens": args.tokens, "iters": args.iters, "warmup": 5, "shapes": shapes, "rule_min_dim": Fp8Rule().min_dim, "loads": "balanced"},
        "results": rows,
    }
    if not args.no_save:
        print(f"wrote {write_result('fp8-gemm', payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
