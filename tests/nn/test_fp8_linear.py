"""FP8 dense projections (precision.fp8_dense): the GEMMs on quantised operands against an
independent quantise-dequantise reference (layouts and scales right: bf16 rounding only), the
bf16 linear (FP8's own error), torch._scaled_mm itself on CPU, the per-GEMM bf16 fallback,
and the recipe installing it from outside the model without touching checkpoints."""

import pytest
import torch
from torch import nn

from moe.config import ConfigError, ExperimentConfig
from moe.kernels.fp8 import pow2_encode_scale
from moe.layers.gemm_fp8 import Fp8Rule
from moe.model import Transformer
from moe.nn.fp8_linear import Fp8Linear, dense_linears, to_fp8
from moe.nn.fp8_policy import DENSE_MIN_DIM
from moe.precision import resolve_recipe

CPU = torch.device("cpu")


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def fq(t, dim):
    enc = pow2_encode_scale(t.float().abs().amax(dim, keepdim=True))
    return (t.float() * enc).clamp(-448, 448).to(torch.float8_e4m3fn).float() / enc


def _linear(out_dim=48, in_dim=64, emulate=True, min_dim=0):
    torch.manual_seed(0)
    lin = nn.Linear(in_dim, out_dim, bias=False).bfloat16()
    return to_fp8(lin, Fp8Rule(min_dim), emulate)


@pytest.mark.parametrize("emulate", [True, False])
def test_fp8_linear_matches_a_reference_over_quantised_operands(emulate):
    """emulate=False runs torch._scaled_mm itself (it has a CPU kernel)."""
    lin = _linear(emulate=emulate)
    x = torch.randn(2, 21, 64).bfloat16().requires_grad_(True)
    grad = torch.randn(2, 21, 48).bfloat16()
    out = lin(x)
    out.backward(grad)
    x2, g2, w = x.detach().reshape(-1, 64), grad.reshape(-1, 48), lin.weight.detach()
    ref_out = fq(x2, 1) @ fq(w, 1).t()
    ref_dx = fq(g2, 1) @ fq(w, 0)
    ref_dw = fq(g2, 0).t() @ fq(x2, 0)
    assert rel(out.reshape(-1, 48), ref_out) < 1e-2
    assert rel(x.grad.reshape(-1, 64), ref_dx) < 1e-2
    assert rel(lin.weight.grad, ref_dw) < 1e-2
    # and FP8's own error against the bf16 linear
    assert rel(out.reshape(-1, 48), x2.float() @ w.float().t()) < 0.1


def test_thin_gemms_stay_bf16_and_match_the_plain_linear_exactly():
    lin = _linear(min_dim=4096)
    plain = nn.Linear(64, 48, bias=False).bfloat16()
    plain.weight.data.copy_(lin.weight.data)
    x = torch.randn(5, 64).bfloat16()
    assert torch.equal(lin(x), plain(x))


def test_weight_copies_follow_the_weight_version():
    lin = _linear()
    x = torch.randn(7, 64).bfloat16()
    first = lin(x)
    assert torch.equal(lin(x), first)  # the cached copies
    with torch.no_grad():
        lin.weight.mul_(2.0)  # a new version: new copies
    assert rel(lin(x), 2 * first.float()) < 1e-2


def test_the_recipe_swaps_every_dense_projection_but_the_lm_head():
    cfg = ExperimentConfig.load({"model": {"preset": "tiny"}}).model
    recipe = resolve_recipe("fp8_rowwise", CPU, emulate=True, fp8_min_dim=0, fp8_dense=True, fp8_dense_min_dim=0)
    plain = Transformer(cfg, expert_gemm=recipe.expert_gemm)
    keys = set(plain.state_dict())
    model = recipe.prepare(plain)
    swapped = [name for name, m in model.named_modules() if isinstance(m, Fp8Linear)]
    assert swapped and len(swapped) == len(dense_linears(model))
    assert not isinstance(model.lm_head, Fp8Linear) and all(n.endswith("_proj") for n in swapped)
    assert set(model.state_dict()) == keys  # checkpoints do not see the recipe
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    logits = model(tokens)
    logits.float().sum().backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if "proj" in n)


def test_fp8_dense_needs_the_fp8_rowwise_recipe_and_not_fsdp():
    with pytest.raises(ConfigError, match="precision.fp8_dense"):
        ExperimentConfig.load({"precision": {"recipe": "bf16", "fp8_dense": True}})
    with pytest.raises(ConfigError, match="precision.fp8_dense"):
        ExperimentConfig.load({"precision": {"recipe": "fp8_rowwise", "fp8_dense": True}, "parallel": {"data_parallel": "fsdp"}})
    with pytest.raises(ConfigError, match="precision.fp8_dense"):
        resolve_recipe("bf16", CPU, fp8_dense=True)


def test_a_run_with_fp8_dense_projections_trains_like_bf16(tmp_path, corpus):
    """The trainer with every dense projection and expert GEMM in (emulated) FP8: the first steps'
    losses within 2% of the bf16 run's."""
    from moe.train.trainer import Trainer
    from tests.helpers import tiny_config

    losses = {}
    for name, precision in {
        "bf16": {"recipe": "bf16"},
        "fp8": {"recipe": "fp8_rowwise", "emulate": True, "fp8_min_dim": 0, "fp8_dense": True, "fp8_dense_min_dim": 0},
    }.items():
        trainer = Trainer(tiny_config(corpus, tmp_path / name, train={"max_steps": 2}, checkpoint={"save": False}, precision=precision))
        if name == "fp8":
            assert any(isinstance(m, Fp8Linear) for m in trainer.model.modules())
        losses[name] = trainer.fit().losses
    for step, loss in losses["bf16"].items():
        assert abs(losses["fp8"][step] - loss) < 0.02 * loss, (step, losses["fp8"][step], loss)


def test_a_directly_built_fp8_linear_has_the_dense_default_rule():
    lin = Fp8Linear(64, 48, bias=False).bfloat16()
    assert lin.rule.min_dim == DENSE_MIN_DIM == ExperimentConfig.load({}).precision.fp8_dense_min_dim
    assert Fp8Rule().min_dim == ExperimentConfig.load({}).precision.fp8_min_dim
    assert lin(torch.randn(3, 64).bfloat16()).shape == (3, 48)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (sm90+)")
@pytest.mark.cuda
def test_after_the_triton_step_the_dense_copies_are_of_the_new_weights(tmp_path, corpus):
    """The fused AdamW kernel writes the bf16 weights outside autograd; the FP8 copies (keyed on
    the weight's version) must still be remade from each step's weights, not the first step's."""
    from moe.kernels.fp8 import quantize_rows
    from moe.train.trainer import Trainer
    from tests.helpers import tiny_config

    precision = {"recipe": "fp8_rowwise", "fp8_min_dim": 0, "fp8_dense": True, "fp8_dense_min_dim": 0}
    train = {"max_steps": 3, "device": "cuda"}
    trainer = Trainer(tiny_config(corpus, tmp_path / "ck", train=train, checkpoint={"save": False}, precision=precision))
    assert trainer.opt._triton_steps()
    trainer.fit()
    linears = [m for m in trainer.model.modules() if isinstance(m, Fp8Linear) and m._fp8_cache is not None and m._fp8_cache._rows]
    assert linears, "the dense projections ran in FP8"
    for m in linears:
        cached, fresh = m._fp8_cache.rows(m.weight), quantize_rows(m.weight.detach())
        assert torch.equal(cached[0].view(torch.uint8), fresh[0].view(torch.uint8)) and torch.equal(cached[1], fresh[1])
