import math

import pytest
import torch
from torch import nn

from moe.config import OptimizerConfig, ScheduleConfig
from moe.optim import MasterWeightAdamW, lr_lambda
from moe.precision import resolve_recipe


def test_bf16_params_get_fp32_masters_and_fp32_gradient_accumulation():
    torch.manual_seed(0)
    model = nn.Linear(8, 8, bias=False).to(torch.bfloat16)
    opt = MasterWeightAdamW(model, OptimizerConfig(lr=1e-2, weight_decay=0.0), master_weights=True)
    (master,) = opt.masters
    assert master.dtype == torch.float32 and master is not model.weight
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    for _ in range(3):  # accumulate
        model(x).float().sum().backward()
    assert model.weight.grad is None and master.grad.dtype == torch.float32
    before = master.detach().clone()
    opt.step()
    assert not torch.equal(master, before)
    assert torch.equal(model.weight, master.to(torch.bfloat16))


def test_accumulation_adds_each_bf16_gradient_in_fp32_exactly():
    """The in-kernel bf16 -> fp32 add equals summing grad.float() of each micro-batch, bitwise."""
    torch.manual_seed(0)
    model = nn.Linear(16, 16, bias=False).to(torch.bfloat16)
    opt = MasterWeightAdamW(model, OptimizerConfig(lr=1e-2), master_weights=True)
    (master,) = opt.masters
    expected = torch.zeros(16, 16)
    for i in range(5):
        x = torch.randn(4, 16, dtype=torch.bfloat16) * (10.0**i)  # magnitudes where rounding order would show
        w = model.weight.detach().clone().requires_grad_(True)
        (x @ w.t()).float().sum().backward()
        expected += w.grad.float()
        model(x).float().sum().backward()
    assert torch.equal(master.grad, expected)


def test_fp32_params_are_their_own_masters():
    model = nn.Linear(4, 4)
    opt = MasterWeightAdamW(model, OptimizerConfig(), master_weights=False)
    assert opt.masters[0] is model.weight


def test_found_inf_skips_the_update_on_device():
    model = nn.Linear(4, 4)
    opt = MasterWeightAdamW(model, OptimizerConfig(lr=0.1), master_weights=False)
    model(torch.randn(2, 4)).sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    opt.step(found_inf=torch.tensor(1.0))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    opt.step(found_inf=torch.tensor(0.0))
    assert not torch.equal(before[0], model.weight)


@pytest.mark.parametrize("scale", [1.0, 0.25, 1e-3])
def test_grad_scale_is_applied_inside_the_step_as_if_the_gradients_were_scaled(scale):
    """Clipping rides in the fused step (grad_scale); the update is the one on scaled gradients."""
    torch.manual_seed(0)
    x = torch.randn(3, 4)
    results = []
    for inside in (True, False):
        model = nn.Linear(4, 4)
        with torch.no_grad():
            model.weight.copy_(torch.arange(16.0).view(4, 4) / 10)
            model.bias.zero_()
        opt = MasterWeightAdamW(model, OptimizerConfig(lr=0.1), master_weights=False)
        for _ in range(3):
            model(x).pow(2).sum().backward()
            if inside:
                opt.step(grad_scale=torch.tensor(scale))
            else:
                torch._foreach_mul_([p.grad for p in model.parameters()], scale)
                opt.step()
            opt.zero_grad()
        assert opt.inner.grad_scale is None and opt.inner.found_inf is None  # nothing lingers
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_no_weight_decay_on_norms_and_embeddings():
    model = nn.ModuleDict({"embed": nn.Embedding(5, 4), "norm": nn.LayerNorm(4), "proj": nn.Linear(4, 4, bias=False)})
    opt = MasterWeightAdamW(model, OptimizerConfig(weight_decay=0.1), master_weights=False)
    decayed = {id(p) for g in opt.inner.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    assert decayed == {id(model["proj"].weight)}


def test_schedule_warmup_then_cosine_to_floor():
    f = lr_lambda(ScheduleConfig(warmup_steps=4, decay="cosine", min_lr_ratio=0.1), max_steps=14)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == pytest.approx(1.0)
    assert f(13) == pytest.approx(0.1)
    mid = f(4 + 9 / 2)
    assert mid == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2)))
    lin = lr_lambda(ScheduleConfig(warmup_steps=0, decay="linear", min_lr_ratio=0.0), max_steps=11)
    assert lin(0) == 1.0 and lin(10) == pytest.approx(0.0) and lin(5) == pytest.approx(0.5)


def _tiny_bf16_model():
    from moe.config import ModelConfig
    from moe.model import Transformer

    torch.manual_seed(0)
    return Transformer(ModelConfig.from_dict({"preset": "tiny", "vocab_size": 64}).validate()).to(torch.bfloat16)


def _backward(model, seed):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 64, (2, 17), generator=g)
    logits = model(tokens[:, :-1])
    torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()).backward()


def test_bf16_expert_accumulation_defers_the_fp32_add_to_the_last_micro_batch():
    """expert_grad_accum bf16: expert gradients sum in bf16 (autograd adds in place) and reach
    the fp32 holder once; dense gradients still go to fp32 every micro-batch."""
    model = _tiny_bf16_model()
    opt = MasterWeightAdamW(model, OptimizerConfig(expert_grad_accum="bf16"), master_weights=True)
    assert not opt.deferred  # the expert weights are declared to it by the recipe, once
    resolve_recipe("bf16", torch.device("cpu")).attach_optimizer(model, opt, broadcasts_expert_weights=False)
    experts = {p.name: p for p in opt.deferred}
    assert experts and all(".experts." in name for name in experts)
    dense = next(p for p in opt.params if p.name not in experts and p.param.ndim == 2)
    for seed in range(2):
        _backward(model, seed)
    for p in experts.values():
        assert p.param.grad is not None and p.param.grad.dtype == torch.bfloat16 and p.grad is None
    assert dense.param.grad is None and dense.grad.dtype == torch.float32
    summed = {n: p.param.grad.clone() for n, p in experts.items()}
    opt.last_micro_batch()
    _backward(model, 2)  # folds as each expert gradient is produced
    reference = _tiny_bf16_model()
    _backward(reference, 2)
    ref_grads = dict(reference.named_parameters())
    for name, p in experts.items():
        assert p.param.grad is None
        expected = (summed[name] + ref_grads[name].grad).float()  # the third micro-batch added in bf16
        assert torch.equal(p.grad, expected), name
    opt.step()
    opt.zero_grad()
    _backward(model, 3)  # without last_micro_batch (the pipeline schedule): fold_deferred does it
    pending = {n: p.param.grad.float() for n, p in experts.items()}
    opt.fold_deferred()
    assert all(torch.equal(experts[n].grad, g) for n, g in pending.items())


def test_bf16_expert_accumulation_needs_fp32_masters():
    from moe.config import ConfigError

    with pytest.raises(ConfigError, match="optim.expert_grad_accum"):
        MasterWeightAdamW(nn.Linear(4, 4), OptimizerConfig(expert_grad_accum="bf16"), master_weights=False)
    with pytest.raises(ConfigError, match="expert_grad_accum"):
        OptimizerConfig.from_dict({"expert_grad_accum": "fp16"}).validate()
