"""Run under TRITON_INTERPRET=1 (or on CUDA): the fixed-point kernels bitwise against the torch path."""

import os
import sys

import torch

from moe.kernels import fixed_point as kernels
from moe.parallel import fixed_point as ref

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


def torch_sums(x: torch.Tensor) -> torch.Tensor:
    """fixed_point.square_sums with the kernels switched off."""
    saved, kernels.use_triton = kernels.use_triton, lambda t: False
    try:
        return ref.square_sums(x)
    finally:
        kernels.use_triton = saved


def check_quantize_add() -> None:
    torch.manual_seed(0)
    for shape, dtype in [((3, 4100), torch.float32), ((7,), torch.float32), ((64, 33), torch.bfloat16)]:
        scales = ref.power_of_two(torch.tensor([30, 41, -3], dtype=torch.int32, device=DEVICE))
        g0 = (torch.randn(shape, device=DEVICE) * 1e-3).to(dtype)
        g1 = (torch.randn(shape, device=DEVICE) * 5).to(dtype)
        g1.view(-1)[0] = 2.5 / scales[1].item()  # a tie: rounds half to even
        g1.view(-1)[1] = 3.5 / scales[1].item()
        want_max = torch.zeros(3, device=DEVICE)
        got_max = torch.zeros(3, device=DEVICE)
        want = None
        got = None
        for g in (g0, g1):
            ref_scales = ref.FixedPointScales(["a", "b", "c"], 4, torch.device(DEVICE))
            ref_scales.scales, ref_scales.max_abs = scales, want_max
            saved, kernels.use_triton = kernels.use_triton, lambda t: False
            try:
                want = ref_scales.observe_and_add(1, want, g.clone(), None)
            finally:
                kernels.use_triton = saved
            before = g.clone()
            got = kernels.observe_quantize_add(got, g, scales, got_max, 1)
            assert torch.equal(g, before), "the kernel leaves the gradient as it was"
        assert torch.equal(got, want), (shape, dtype, (got - want).abs().max())
        assert torch.equal(got_max, want_max), (got_max, want_max)
        assert got_max[0] == 0 and got_max[2] == 0
    g = torch.tensor([1.0, float("nan"), -2.0], device=DEVICE)
    m = torch.zeros(1, device=DEVICE)
    kernels.observe_quantize_add(None, g, torch.ones(1, device=DEVICE), m, 0)
    assert m[0] == float("inf"), m


def check_square_sums() -> None:
    torch.manual_seed(1)
    cases = [
        torch.randn(6, 4096, device=DEVICE),
        torch.randn(3, 5, 7, device=DEVICE) * 1e30,
        torch.randn(37, device=DEVICE),
        torch.zeros(4, 12, device=DEVICE),
        torch.randn(2, 10, device=DEVICE) * 1e-40,  # subnormal values
        (torch.randn(9, 24, device=DEVICE) * 3).to(torch.bfloat16),
    ]
    cases[3][1, 3] = 1e-45
    for x in cases:
        got, want = ref.square_sums(x), torch_sums(x)
        assert got.dtype == torch.float64 and torch.equal(got, want), (x.shape, (got - want).abs().max())


def check_dequantize() -> None:
    q = torch.tensor([[0, 1, -3, 2**62 - 1], [-(2**62), 12345678901, 7, -1]], dtype=torch.int64, device=DEVICE)
    inverse = ref.power_of_two(torch.tensor(-40, dtype=torch.int32, device=DEVICE))
    got = kernels.dequantize(q, inverse)
    assert torch.equal(got, q.to(torch.float32).mul_(inverse)) and got.shape == q.shape


def main() -> int:
    check_quantize_add()
    check_square_sums()
    check_dequantize()
    print("fixed point kernels ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
