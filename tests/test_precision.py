"""Precision recipes: FP8 recipe validation (refused before any kernel launch where they cannot
run) and the expert GEMM they install."""

import pytest
import torch

from moe.config import ConfigError, ExperimentConfig
from moe.layers.experts import GroupedExperts
from moe.layers.gemm import GroupedMM
from moe.layers.gemm_fp8 import Fp8GroupedGemm, MxFp8GroupedGemm
from moe.model import Transformer
from moe.precision import resolve_recipe

CPU = torch.device("cpu")


def test_unknown_recipe_is_one_clear_error():
    with pytest.raises(ConfigError, match=r"precision.recipe: unknown recipe 'fp8'; known: auto, .*fp8_rowwise, mxfp8"):
        resolve_recipe("fp8", CPU)
    with pytest.raises(ConfigError, match=r"precision.recipe: 'fp8' is not one of .*did you mean"):
        ExperimentConfig.load({"precision": {"recipe": "fp8"}})
    with pytest.raises(ConfigError, match=r"precision.fp8_min_dim: must be >= 0"):
        ExperimentConfig.load({"precision": {"fp8_min_dim": -1}})


@pytest.mark.parametrize("name,need", [("fp8_rowwise", "9.0"), ("mxfp8", "10.0")])
def test_fp8_recipes_are_refused_on_cpu(name, need):
    with pytest.raises(ConfigError, match=rf"precision.recipe: {name} needs a CUDA GPU with compute capability >= {need}, but the device is cpu"):
        resolve_recipe(name, CPU)


def fake_gpu(monkeypatch, capability, name):
    launched = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    # any tensor work on the device would go through these: none may happen before the refusal
    monkeypatch.setattr(torch.cuda, "init", lambda: launched.append("init"))
    return launched


def test_mxfp8_is_refused_on_hopper_before_any_kernel(monkeypatch):
    launched = fake_gpu(monkeypatch, (9, 0), "NVIDIA H200")
    with pytest.raises(ConfigError) as err:
        resolve_recipe("mxfp8", torch.device("cuda", 0))
    msg = str(err.value)
    assert msg == "precision.recipe: mxfp8 needs compute capability >= 10.0, but NVIDIA H200 is sm90 (use fp8_rowwise on Hopper)"
    assert "\n" not in msg and not launched
    # fp8_rowwise is accepted there, and refused on Ampere
    assert resolve_recipe("fp8_rowwise", torch.device("cuda", 0)).name == "fp8_rowwise"
    fake_gpu(monkeypatch, (8, 0), "NVIDIA A100")
    with pytest.raises(ConfigError, match=r"fp8_rowwise needs compute capability >= 9.0, but NVIDIA A100 is sm80$"):
        resolve_recipe("fp8_rowwise", torch.device("cuda", 0))


def test_fp8_recipes_install_their_expert_gemm_from_outside_the_model():
    cfg = ExperimentConfig.load({"model": {"preset": "tiny"}}).model
    for name, kind in [("fp8_rowwise", Fp8GroupedGemm), ("mxfp8", MxFp8GroupedGemm), ("bf16", GroupedMM)]:
        recipe = resolve_recipe(name, CPU, emulate=True, fp8_min_dim=0)
        model = recipe.prepare(Transformer(cfg))
        experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
        assert experts and all(isinstance(m.gemm, kind) for m in experts)
        assert recipe.master_weights and all(p.dtype == torch.bfloat16 for p in model.parameters())
    gemm = next(m for m in model.modules() if isinstance(m, GroupedExperts)).gemm
    assert not isinstance(gemm, Fp8GroupedGemm)
    model = resolve_recipe("fp8_rowwise", CPU, emulate=True, fp8_min_dim=0).prepare(Transformer(cfg))
    gemm = next(m for m in model.modules() if isinstance(m, GroupedExperts)).gemm
    assert gemm.emulate and gemm.rule.min_dim == 0
