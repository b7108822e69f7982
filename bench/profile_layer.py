"""Where the MoE layer's time goes: CUDA kernel times of one forward+backward (torch.profiler).

python -m bench.profile_layer --shape 2048,1024,64,8 --tokens 16384
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench.layer import Shape, build_ours, make_weights


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shape", default="2048,1024,64,8")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--rows", type=int, default=18)
    args = p.parse_args(argv)
    shape = Shape(*map(int, args.shape.split(",")))
    device = torch.device("cuda")
    layer = build_ours(shape, make_weights(shape, device), torch.bfloat16)
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
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=100))
    iters = 5
    gemm = other = 0.0
    for evt in prof.key_averages():
        t = getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0.0)
        if "cutlass" in evt.key and "Gemm" in evt.key:
            gemm += t
        else:
            other += t
    print(
        f"{shape.label}: per forward+backward grouped GEMM {gemm / iters / 1e3:.3f} ms, "
        f"everything else {other / iters / 1e3:.3f} ms ({100 * other / (gemm + other):.1f}%)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
