"""Run under TRITON_INTERPRET=1: the fused cross-entropy against torch's, value and gradient."""

import os

assert os.environ.get("TRITON_INTERPRET") == "1"
import torch  # noqa: E402

from moe.nn.loss import lm_loss  # noqa: E402


def main() -> int:
    torch.manual_seed(0)
    for n, v, z_weight, ignored in [(6, 37, 0.0, 0), (9, 300, 1e-2, 2), (4, 5000, 0.0, 1)]:
        logits = (torch.randn(1, n, v) * 3).to(torch.bfloat16)
        target = torch.randint(0, v, (1, n))
        target[0, :ignored] = -100
        scale = 0.25  # 1 / micro-batches
        ref_in = logits.clone().requires_grad_(True)
        ref = lm_loss(ref_in, target, z_weight=z_weight)
        (ref * scale).backward()
        for overwrite in (False, True):
            x = logits.clone().requires_grad_(True)
            y = x.clone()  # a non-leaf, as the model's logits are (the kernel may write over it)
            out = lm_loss(y, target, z_weight=z_weight, fused=True, overwrite_logits=overwrite)
            (out * scale).backward()
            assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5), (n, v, out.item(), ref.item())
            err = (x.grad.float() - ref_in.grad.float()).abs().max().item()
            assert err <= 1e-2 * ref_in.grad.float().abs().max().item(), (n, v, overwrite, err)
            if ignored:
                assert x.grad[0, :ignored].abs().max().item() == 0.0
            assert out.dtype == torch.float32
    print("cross entropy ok")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
