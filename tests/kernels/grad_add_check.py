"""Run under Triton's interpreter (tests/kernels/test_grad_add.py): the gradient-accumulation
kernel gives torch's values bit for bit (the first micro-batch's cast and each later add), and
falls back to torch where it does not apply. Run directly on a GPU machine it checks the compiled
kernel (bench/h200/step_target.sh)."""

import os

import torch

from moe.kernels import grad_add


def check() -> None:
    grad_add.TRITON_ADD = True  # opt-in (MOE_GRAD_ADD=triton): checked whatever the environment says
    torch.manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    n = 3 * grad_add.BLOCK + 77  # not a multiple of the block
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        grads = [torch.randn(n, dtype=torch.float32, device=dev).mul(10.0 ** (i - 2)).to(dtype) for i in range(4)]
        want = grads[0].float()
        got = grad_add.accumulate_fp32(None, grads[0])
        assert got.dtype == torch.float32 and torch.equal(got, want), dtype
        for g in grads[1:]:
            want.add_(g)
            same = grad_add.accumulate_fp32(got, g)
            assert same is got, "the accumulator is updated in place"
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), dtype
    # non-finite values pass through (the step's found_inf reads them); -0.0 and subnormals keep their bits
    # (Triton's interpreter widens bf16 subnormals wrongly, numpy's doing: those are checked compiled only)
    subnormals = [1e-40, -1e-39] if dev == "cuda" else [1e-30, -1e-29]
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, *subnormals, 3.0], device=dev)
    for dtype in (torch.bfloat16, torch.float32):
        g = special.to(dtype)
        got = grad_add.accumulate_fp32(None, g)
        assert torch.equal(got.view(torch.int32), g.float().view(torch.int32)), dtype
        acc = torch.tensor([1.0, 2.0, 3.0, 0.0, 1e-40, 1e-39, -0.0], device=dev)  # fp32 subnormals in the sum
        want = acc.clone().add_(g)
        grad_add.accumulate_fp32(acc, g)
        assert torch.equal(acc.isnan(), want.isnan()), dtype
        assert torch.equal(acc.nan_to_num().view(torch.int32), want.nan_to_num().view(torch.int32)), dtype
    # shapes kept; a strided gradient takes torch's path with the same values
    g = torch.randn(64, 48, dtype=torch.bfloat16, device=dev)
    assert grad_add.accumulate_fp32(None, g).shape == (64, 48)
    acc = torch.zeros(48, 64, device=dev)
    assert torch.equal(grad_add.accumulate_fp32(acc, g.t()), g.t().float())
    print(f"grad add ok ({dev})")


if __name__ == "__main__":
    check()
