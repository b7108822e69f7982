"""Fused RoPE: the Triton kernel under the interpreter (a subprocess, since the interpreter must be
chosen before triton is imported) against the eager rotate-half reference, and the CPU path."""

import os

import pytest
import torch

from moe.kernels import rope
from moe.nn.rope import RotaryEmbedding
from tests.helpers import run_under_triton_interpreter


def test_triton_kernel_matches_the_eager_rotation_under_the_interpreter():
    run_under_triton_interpreter(["tests/kernels/rope_check.py"], "rope kernels ok")


def test_cpu_path_is_the_eager_reference():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter routes CPU tensors to the kernel")
    emb = RotaryEmbedding(8, 16, 10000.0)
    q, k = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5, 8)
    assert not rope.fusable(q, emb.cos)
    qr, kr = emb(q, k)
    half = 4
    expect = q * emb.cos[:5] + torch.cat((-q[..., half:], q[..., :half]), -1) * emb.sin[:5]
    assert torch.equal(qr, expect) and kr.shape == k.shape
    with pytest.raises(ValueError, match="max_seq_len"):
        emb(torch.randn(1, 1, 17, 8), torch.randn(1, 1, 17, 8))
