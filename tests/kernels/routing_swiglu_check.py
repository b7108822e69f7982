"""Run under TRITON_INTERPRET=1: the Triton kernels against the torch path, forward and backward."""

import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1"
import torch  # noqa: E402

from moe.kernels import routing  # noqa: E402
from moe.kernels.swiglu import swiglu as swiglu_fn  # noqa: E402


def check(t_out, r_out, name, tol=1e-5):
    err = (t_out.float() - r_out.float()).abs().max().item()
    assert err <= tol * max(1.0, r_out.abs().max().item()), f"{name}: {err}"


def main() -> int:
    torch.manual_seed(0)
    for n_tokens, k, d, e in [(7, 2, 24, 4), (33, 3, 40, 8), (5, 1, 8, 3)]:
        x = torch.randn(n_tokens, d, requires_grad=True)
        experts = torch.randint(0, e, (n_tokens, k))
        weights = torch.rand(n_tokens, k, requires_grad=True)
        order = torch.argsort(experts.reshape(-1), stable=True)
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel()))
        probe = torch.randn(n_tokens, d)
        # triton path (interpreter)
        rows = routing.gather_rows(x, order, inverse, k)
        y = rows * 1.5 + 0.1
        out = routing.combine(y, inverse, weights)
        (out * probe).sum().backward()
        gx, gw = x.grad.clone(), weights.grad.clone()
        x.grad = weights.grad = None
        # torch reference
        rows_r = x.index_select(0, order // k)
        y_r = rows_r * 1.5 + 0.1
        out_r = torch.bmm(weights.unsqueeze(1), y_r.index_select(0, inverse).view(n_tokens, k, d)).squeeze(1)
        (out_r * probe).sum().backward()
        check(rows, rows_r, "gather")
        check(out, out_r, "combine")
        check(gx, x.grad, "gather backward")
        check(gw, weights.grad, "combine weight backward")
        # the residual folded into the combine's pass (MOE_RESIDUAL_ADD=combine): residual + combine,
        # its gradient the output's; in bf16 one rounding of the fp32 sum
        for dtype in (torch.float32, torch.bfloat16):
            yb = y.detach().to(dtype).requires_grad_()
            res = torch.randn(n_tokens, d, dtype=dtype, requires_grad=True)
            wb = weights.detach().clone().requires_grad_()
            out_f = routing.combine(yb, inverse, wb, res)
            (out_f.float() * probe).sum().backward()
            acc = res.detach().float()  # the kernel's fp32 sum in its order, rounded once
            per_slot = yb.detach().float().index_select(0, inverse).view(n_tokens, k, d)
            for j in range(k):
                acc = acc + per_slot[:, j] * wb.detach()[:, j : j + 1]
            want = acc.to(dtype)
            # (Triton's interpreter narrows fp32 to bf16 by truncation, the GPU to nearest: one bf16 step here)
            assert out_f.dtype == dtype
            check(out_f, want, f"combine + residual {dtype}", tol=1e-6 if dtype == torch.float32 else 2**-7)
            assert torch.equal(res.grad, probe.to(dtype)), "the residual's gradient is the output's"
            yr = yb.detach().clone().requires_grad_()
            wr = wb.detach().clone().requires_grad_()
            (routing.combine(yr, inverse, wr).float() * probe).sum().backward()
            assert torch.equal(yb.grad, yr.grad) and torch.equal(wb.grad, wr.grad), "y and weight gradients as without the residual"
        h = torch.randn(n_tokens * k, 2 * d, requires_grad=True)
        a = swiglu_fn(h)
        g = torch.randn_like(a)
        (a * g).sum().backward()
        gh = h.grad.clone()
        h.grad = None
        gate, up = h.chunk(2, dim=-1)
        a_r = torch.nn.functional.silu(gate) * up
        (a_r * g).sum().backward()
        check(a, a_r, "swiglu")
        check(gh, h.grad, "swiglu backward")
    print("kernels ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
