"""The MoE layer's forward row gather (token rows copied into expert order, k copies of each):
our Triton pass (moe.kernels.routing.gather_rows_copy) against torch's index_select.

    python -m bench.gather            # OLMoE width and the Qwen-like width: 16,384 tokens, top-8, d=2048

Learned-routing-like index: the T*k slots of random top-k choices sorted by expert (the
dispatcher's stable argsort), so each source row is read k times from scattered places. Both
outputs are checked bitwise equal before anything is timed. GB/s counts the minimum traffic:
each output row written once and read once from its source (2 x rows x d x 2 bytes).
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench.common import environment, print_table, save_result, time_cuda

# name, tokens, top_k, d, experts
CASES = [("olmoe", 16384, 8, 2048, 64), ("qwen-like", 16384, 8, 2048, 128)]


def run_case(name: str, tokens: int, top_k: int, d: int, experts: int, iters: int) -> list[dict]:
    from moe.kernels.routing import gather_rows_copy

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    choice = torch.rand(tokens, experts, device="cuda", generator=gen).topk(top_k, dim=1).indices.reshape(-1)
    row_index = torch.argsort(choice, stable=True) // top_k
    want = x.index_select(0, row_index)
    got = gather_rows_copy(x, row_index)
    if not torch.equal(got, want):
        raise SystemExit(f"{name}: the Triton gather differs from index_select")
    nbytes = 2 * row_index.numel() * d * x.element_size()
    rows = []
    for variant, fn in (("index_select", lambda: x.index_select(0, row_index)), ("triton", lambda: gather_rows_copy(x, row_index))):
        ms = time_cuda(fn, iters=iters)["median_ms"]
        rows.append({"case": name, "variant": variant, "rows": row_index.numel(), "d": d, "median_ms": ms, "gb_per_s": nbytes / ms / 1e6})
    base = rows[0]["median_ms"]
    for r in rows:
        r["index_select_over_this"] = base / r["median_ms"]
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--no-save", action="store_true")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.gather needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = [r for case in CASES for r in run_case(*case, args.iters)]
    print_table(rows, ["case", "variant", "rows", "d", "median_ms", "gb_per_s", "index_select_over_this"])
    if not args.no_save:
        save_result(
            "gather", {"environment": environment(), "config": {"cases": CASES, "iters": args.iters, "bytes": "2 * rows * d * 2"}, "rows": rows}
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
