"""Fused RMSNorm: the Triton kernels under the interpreter (a subprocess, since the interpreter
must be chosen before triton is imported) against the eager reference, and the module's CPU
path (the eager reference) against a float64 computation from the definition."""

import os

import pytest
import torch

from moe.kernels import rmsnorm
from moe.nn import RMSNorm
from tests.helpers import run_under_triton_interpreter


def test_triton_kernels_match_the_eager_norm_under_the_interpreter():
    run_under_triton_interpreter(["tests/kernels/rmsnorm_check.py"], "rmsnorm kernels ok")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_module_on_cpu_is_the_eager_reference(dtype):
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter routes CPU tensors to the kernels")
    torch.manual_seed(0)
    norm = RMSNorm(24, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(24))
    x = (torch.randn(3, 5, 24) * 2).to(dtype)
    assert not rmsnorm.fusable(x, norm.weight)
    y = norm(x)
    assert y.dtype == dtype and torch.equal(y, rmsnorm.rms_norm_reference(x, norm.weight, 1e-5))
    # the numerics' order: n = (x32 * rstd) cast to x's dtype, then weight * n
    x64 = x.double()
    n = (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    expect = (norm.weight.double() * n.double()).to(dtype)
    tol = 1e-6 if dtype == torch.float32 else 2.0**-7
    torch.testing.assert_close(y, expect, rtol=tol, atol=tol)
    assert list(norm.state_dict()) == ["weight"]
