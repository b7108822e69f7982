"""Tile sweep of the fused expert-MLP kernels, each against torch's grouped GEMM doing the same GEMM.

    python -m bench.tune_expert_mlp --shape 2048,1024,64,8 --tokens 65536

For one layer shape (random routing, dropless: the same expert-ordered rows for every kernel) it
times each of the fused path's six launches (up projection + SwiGLU with the gather, down
projection, dgrad with dSwiGLU and the combine's scaling, the two weight gradients, the input
gradient) under several tile configs, and the unfused path's equivalent (torch._grouped_mm on the
pre-gathered contiguous rows; the weight gradients as torch's grouped GEMM over the transposed
rows). TFLOP/s = 2 * rows * K * N / time for each GEMM. Outputs are checked against the
torch GEMM before timing. The question it answers: does any tile config bring the Triton
kernels near CUTLASS's grouped GEMM (the fused path can only win by the traffic it saves,
about the gather's and SwiGLU's bytes)?
"""

from __future__ import annotations

import argparse
import itertools

import torch

from bench.common import environment, print_table, rel_error, time_cuda, write_result
from moe.kernels import expert_mlp as km

CONFIGS = [  # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, programs per SM)
    (128, 128, 64, 8, 3, 1),  # today's
    (128, 128, 64, 8, 4, 1),
    (128, 256, 64, 8, 3, 1),
    (128, 128, 64, 4, 4, 2),
    (64, 128, 64, 4, 4, 2),
    (128, 128, 32, 8, 5, 1),
    (128, 64, 64, 4, 4, 2),
]


def _set(cfg: tuple[int, ...]) -> None:
    bm, bn, bk, warps, stages, per_sm = cfg
    km.BLOCK_M, km.BLOCK_N, km.BLOCK_K = bm, bn, bk
    km.WGRAD_BLOCK_M, km.WGRAD_BLOCK_N, km.WGRAD_BLOCK_K = bm, bn, bk
    km.CUDA_LAUNCH = {"num_warps": warps, "num_stages": stages}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    km._programs = lambda upper, device: max(1, min(upper, sms * per_sm))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="2048,1024,64,8", help="d,h,E,k")
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args(argv)
    d, h, e, k = map(int, args.shape.split(","))
    t = args.tokens
    dev = torch.device("cuda")
    torch.manual_seed(0)
    x = torch.randn(t, d, device=dev, dtype=torch.bfloat16)
    gate_up = torch.randn(e, 2 * h, d, device=dev, dtype=torch.bfloat16) / d**0.5
    down = torch.randn(e, d, h, device=dev, dtype=torch.bfloat16) / h**0.5
    experts = torch.rand(t, e, device=dev).topk(k, dim=1).indices.reshape(-1)
    order = torch.argsort(experts, stable=True)
    row_index = (order // k).contiguous()
    ends = torch.bincount(experts, minlength=e).cumsum(0).to(torch.int32)
    n = t * k
    rows = x.index_select(0, row_index)
    h_act = torch.randn(n, 2 * h, device=dev, dtype=torch.bfloat16)
    act = torch.randn(n, h, device=dev, dtype=torch.bfloat16)
    g_out = torch.randn(n, d, device=dev, dtype=torch.bfloat16)
    dh = torch.randn(n, 2 * h, device=dev, dtype=torch.bfloat16)
    mm = torch._grouped_mm
    # (name, fused launch, torch equivalent, flops)
    cases = [
        ("up+swiglu", lambda: km.grouped_gemm(x, gate_up.transpose(1, 2), ends, row_index=row_index, swiglu_epilogue=True)[0],
         lambda: mm(rows, gate_up.transpose(1, 2), offs=ends), 2 * n * d * 2 * h),
        ("down", lambda: km.grouped_gemm(act, down.transpose(1, 2), ends)[0], lambda: mm(act, down.transpose(1, 2), offs=ends), 2 * n * h * d),
        ("dgrad+dswiglu", lambda: km.grouped_gemm(g_out, down, ends, dswiglu_h=h_act)[0], lambda: mm(g_out, down, offs=ends), 2 * n * d * h),
        ("wgrad down", lambda: km.grouped_wgrad(g_out, act, ends), lambda: mm(g_out.t(), act, offs=ends), 2 * n * d * h),
        ("wgrad up (gather)", lambda: km.grouped_wgrad(dh, x, ends, row_index=row_index), lambda: mm(dh.t(), rows, offs=ends), 2 * n * 2 * h * d),
        ("dgrad x", lambda: km.grouped_gemm(dh, gate_up, ends)[0], lambda: mm(dh, gate_up, offs=ends), 2 * n * 2 * h * d),
    ]
    table = []
    for name, fused, ref, flops in cases:
        ref_out = ref()
        t_ref = time_cuda(ref, iters=args.iters)["median_ms"]
        row = {"kernel": name, "torch TF/s": round(flops / t_ref / 1e9, 1)}
        best = (0.0, None)
        for cfg in CONFIGS:
            _set(cfg)
            try:
                out = fused()
                err = rel_error(out.float(), ref_out.float()) if name not in ("dgrad+dswiglu",) and out.shape == ref_out.shape else float("nan")
                ms = time_cuda(fused, iters=args.iters)["median_ms"]
            except Exception as exc:  # a config that does not compile or fit: recorded, not fatal
                row[str(cfg)] = f"fail: {type(exc).__name__}"
                continue
            tf = flops / ms / 1e9
            row[str(cfg)] = f"{tf:.0f} ({tf * t_ref * 1e9 / flops:.2f}x, err {err:.1e})"
            if tf > best[0]:
                best = (tf, cfg)
        row["best"] = f"{best[0]:.0f} {best[1]}"
        row["best/torch"] = round(best[0] * t_ref * 1e9 / flops, 3)
        table.append(row)
        print(row, flush=True)
    print_table(table, ["kernel", "torch TF/s", "best", "best/torch"])
    write_result("tune_expert_mlp", {"environment": environment(), "shape": [d, h, e, k], "tokens": t, "routing": "random, dropless",
                                     "flops": "2*rows*K*N per GEMM", "configs": CONFIGS, "rows": table})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
