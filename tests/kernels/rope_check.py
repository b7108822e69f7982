"""Run under TRITON_INTERPRET=1: the fused RoPE kernel against the eager rotate-half reference,
forward and backward, fp32 (tight) and bf16 (two bf16 steps: the interpreter truncates), on the
transposed-view layout the attention passes and on a contiguous tensor."""

import os

assert os.environ.get("TRITON_INTERPRET") == "1"
import torch  # noqa: E402

from moe.kernels import rope  # noqa: E402
from moe.nn.rope import RotaryEmbedding  # noqa: E402


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1.0)).item()


def case(b, s, h, d, dtype, transposed, tol):
    torch.manual_seed(0)
    emb = RotaryEmbedding(d, s + 3, 10000.0)
    base = torch.randn(b, s, h, d, dtype=torch.float64)
    g = torch.randn(b, h, s, d, dtype=torch.float64)
    x = (base.transpose(1, 2) if transposed else base.transpose(1, 2).contiguous()).to(dtype)
    assert rope.fusable(x, emb.cos)
    xf = x.detach().clone().requires_grad_(True)
    y = rope.apply_rope(xf, emb.cos, emb.sin)
    y.backward(g.to(dtype))
    xr = x.detach().double().requires_grad_(True)
    ref = rope.rope_reference(xr, emb.cos[:s].double(), emb.sin[:s].double())
    ref.backward(g)
    assert y.shape == ref.shape and y.dtype == dtype
    e_y, e_g = rel(y, ref), rel(xf.grad, xr.grad)
    assert e_y <= tol and e_g <= tol, (b, s, h, d, dtype, transposed, e_y, e_g)


for shape in [(2, 5, 3, 8), (1, 7, 2, 64), (2, 3, 4, 6)]:
    for transposed in (True, False):
        case(*shape, torch.float32, transposed, 1e-6)
        case(*shape, torch.bfloat16, transposed, 2.0**-6)
# tables that do not fit the input take the eager path (which raises on a short table)
emb = RotaryEmbedding(8, 4, 10000.0)
x = torch.randn(1, 2, 5, 8)
assert not rope.fusable(x, emb.cos, emb.sin)  # 4 positions for a sequence of 5
assert not rope.fusable(torch.randn(1, 2, 3, 6), emb.cos, emb.sin)  # head_dim 6 against an 8-wide table
assert rope.fusable(torch.randn(1, 2, 3, 8), emb.cos, emb.sin)
print("rope kernels ok")
