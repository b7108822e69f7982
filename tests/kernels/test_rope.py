"""Fused RoPE: the Triton kernel under the interpreter (a subprocess, since the interpreter must be
chosen before triton is imported) against the eager rotate-half reference, and the CPU path."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe.kernels import rope
from moe.nn.rope import RotaryEmbedding

REPO = Path(__file__).resolve().parents[2]


def test_triton_kernel_matches_the_eager_rotation_under_the_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, str(REPO / "tests/kernels/rope_check.py")], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "rope kernels ok" in r.stdout


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
