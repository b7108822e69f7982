"""Run under Triton's interpreter (tests/kernels/test_adamw.py): the Triton AdamW step against
torch's AdamW, and the optimizer's step through it against optim.step_kernel=torch."""

import torch

from moe.kernels import adamw


def reference(p, g, m, v, step, lr, betas, eps, wd, grad_div=None):
    p, m, v = p.clone(), m.clone(), v.clone()
    g = g.float() / grad_div if grad_div is not None else g.float()
    p -= lr * wd * p
    m = betas[0] * m + (1 - betas[0]) * g
    v = betas[1] * v + (1 - betas[1]) * g * g
    bc1 = 1 - betas[0] ** step
    bc2 = 1 - betas[1] ** step
    p -= lr / bc1 * m / (v.sqrt() / bc2**0.5 + eps)
    return p, m, v


def rounded(master, mirror):
    """mirror is master rounded to bf16: to nearest even on the GPU (bench/adamw.py checks it
    bitwise there); Triton's interpreter truncates, so either is accepted here."""
    truncated = (master.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)
    return bool(((mirror == master.to(torch.bfloat16)) | (mirror == truncated)).all())


def check_kernel():
    torch.manual_seed(0)
    n = 5000  # not a multiple of the block
    for wd, grad_div in ((0.1, None), (0.0, torch.tensor(2.0))):
        p, g = torch.randn(n), torch.randn(n)
        m, v = torch.randn(n) * 0.1, torch.rand(n) * 0.01
        step = torch.tensor(3.0)
        mirror = torch.empty(n, dtype=torch.bfloat16)
        want = reference(p, g, m, v, 3, 1e-3, (0.9, 0.95), 1e-8, wd, grad_div)
        got = [p.clone(), g.clone(), m.clone(), v.clone()]
        hyper = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": wd}
        adamw.adamw_step(got[0], got[1], got[2], got[3], step, **hyper, mirror=mirror, grad_div=grad_div)
        for a, b in zip((got[0], got[2], got[3]), want, strict=True):
            torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7)
        assert rounded(got[0], mirror), "the bf16 copy is the new master rounded"
        assert torch.equal(got[1], g), "the gradient is not written"
    # a gradient in another layout is read as its values (a transposed view here)
    p, m, v = torch.randn(8, 6), torch.zeros(8, 6), torch.zeros(8, 6)
    g = torch.randn(6, 8).t()
    want = reference(p, g, m, v, 1, 1e-3, (0.9, 0.95), 1e-8, 0.1)
    adamw.adamw_step(p, g, m, v, torch.tensor(1.0), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    torch.testing.assert_close(p, want[0], rtol=2e-6, atol=1e-7)
    try:  # a written tensor in another layout is refused, not written wrongly
        adamw.adamw_step(p.t(), g.t(), m.t(), v.t().contiguous(), torch.tensor(1.0), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
        raise AssertionError("a non-contiguous master was stepped")
    except ValueError as e:
        assert "contiguous" in str(e)
    # a learning rate held on the device (a captured step's) steps to the float's bits
    p, g, m, v = torch.randn(n), torch.randn(n), torch.randn(n) * 0.1, torch.rand(n) * 0.01
    hyper = {"betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    by_float, by_tensor = [[t.clone() for t in (p, m, v)] for _ in range(2)]
    adamw.adamw_step(by_float[0], g, by_float[1], by_float[2], torch.tensor(2.0), lr=3e-4, **hyper)
    adamw.adamw_step(by_tensor[0], g, by_tensor[1], by_tensor[2], torch.tensor(2.0), lr=torch.tensor(3e-4), **hyper)
    assert all(torch.equal(a, b) for a, b in zip(by_float, by_tensor, strict=True))
    try:
        adamw.adamw_step(p, g, m, v, torch.tensor(2.0), lr=torch.tensor(3e-4, dtype=torch.float64), **hyper)
        raise AssertionError("an fp64 learning rate was taken")
    except ValueError as e:
        assert "fp32 scalar" in str(e)
    # a skipped step writes nothing
    p, g, m, v = torch.randn(n), torch.randn(n), torch.zeros(n), torch.zeros(n)
    mirror = torch.zeros(n, dtype=torch.bfloat16)
    before = [t.clone() for t in (p, m, v, mirror)]
    adamw.adamw_step(p, g, m, v, torch.tensor(1.0), lr=1.0, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, mirror=mirror, found_inf=torch.tensor(1.0))
    assert all(torch.equal(a, b) for a, b in zip((p, m, v, mirror), before, strict=True))


def check_optimizer():
    """Three steps (one skipped by found_inf, one with a clipping scale) through MasterWeightAdamW
    with each step kernel, on the same gradients: same masters and state within fp32 rounding,
    the bf16 weights their masters rounded, and every step bumps the version of each tensor it
    wrote (the bf16 weights; a released weight's master)."""
    from torch import nn

    from moe.config import OptimizerConfig
    from moe.optim import MasterWeightAdamW

    def run(kernel):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 8)).to(torch.bfloat16)
        opt = MasterWeightAdamW(model, OptimizerConfig(lr=1e-2, step_kernel=kernel), master_weights=True)
        assert opt._triton_steps() == (kernel == "triton")
        # what the step writes: the bf16 weights, and a released weight's master (an FP8 expert's)
        released = opt.release_weight(model[2].weight)
        written = [p for n, p in model.named_parameters() if n != "2.weight"] + [released]
        for i, (found, scale) in enumerate(((None, None), (torch.tensor(1.0), None), (torch.tensor(0.0), torch.tensor(0.5)))):
            gen = torch.Generator().manual_seed(i)  # the same gradients for both kernels
            for p in opt.params:
                p.grad_holder.grad = torch.randn(p.param.shape, generator=gen)
            if kernel == "triton" and i == 1:  # from here the learning rate is read on the device
                opt.keep_lr_on_device()
            if kernel == "triton":
                opt.write_lr()
            versions = [t._version for t in written]
            opt.step(found_inf=found, grad_scale=scale)
            # caches keyed on a weight's version (the FP8 copies) see every step's weights
            assert all(t._version > v for t, v in zip(written, versions, strict=True)), f"{kernel}: a written weight kept its version"
            opt.zero_grad()
        state = opt.named_state()
        return [p.detach().clone() for p in model.parameters()], opt.named_masters(), state

    params_t, masters_t, state_t = run("triton")
    params_r, masters_r, state_r = run("torch")
    for name in masters_r:
        torch.testing.assert_close(masters_t[name], masters_r[name], rtol=1e-5, atol=1e-6)
        assert torch.equal(state_t[name]["step"], state_r[name]["step"]), name
        assert float(state_t[name]["step"]) == 2.0, "the skipped step is not counted"
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(state_t[name][key], state_r[name][key], rtol=1e-5, atol=1e-7)
    for a, name in zip(params_t, masters_t, strict=True):
        if name != "2.weight":  # released: one element
            assert rounded(masters_t[name], a), f"{name}: the bf16 weight is its master rounded"


if __name__ == "__main__":
    check_kernel()
    check_optimizer()
    print("adamw kernel ok")
