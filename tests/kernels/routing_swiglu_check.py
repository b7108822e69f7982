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
