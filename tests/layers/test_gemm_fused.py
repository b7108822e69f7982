"""``model.moe.gemm: fused`` where Triton does not run (CPU): the same function on torch's grouped
GEMM, so a config naming it trains anywhere; the kernels themselves are checked under the
interpreter (tests/kernels/test_expert_mlp.py)."""

import dataclasses
import os

import pytest
import torch

from moe.config import MoEConfig
from moe.errors import ConfigError
from moe.layers import MoELayer
from moe.layers.gemm_fused import FusedExpertMLP
from moe.layers.gemm_registry import build_expert_gemm

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the interpreter routes CPU tensors to the kernels")


def _layers():
    cfg = MoEConfig(num_experts=4, top_k=2, expert_hidden=24)
    out = {}
    for gemm in ("grouped_mm", "fused"):
        torch.manual_seed(0)
        layer = MoELayer(32, dataclasses.replace(cfg, gemm=gemm).validate())
        layer.reset_parameters(0.05)
        out[gemm] = layer
    return out


def test_fused_layer_equals_the_grouped_mm_layer_on_cpu():
    layers = _layers()
    x = torch.randn(2, 9, 32)
    grads = {}
    for gemm, layer in layers.items():
        xi = x.clone().requires_grad_(True)
        out = layer(xi)
        out.square().sum().backward()
        grads[gemm] = (out.detach(), xi.grad, [p.grad for p in layer.parameters()])
    ref, got = grads["grouped_mm"], grads["fused"]
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], ref[1], rtol=0, atol=0)
    for a, b in zip(got[2], ref[2], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_fused_is_a_known_expert_gemm_and_deterministic():
    gemm = build_expert_gemm("fused")
    assert isinstance(gemm, FusedExpertMLP) and gemm.deterministic
    with pytest.raises(ValueError, match="fused"):
        build_expert_gemm("nope")


def test_unknown_gemm_in_config_names_the_key():
    with pytest.raises(ConfigError, match="gemm"):
        MoEConfig.from_dict({"gemm": "nope"}, prefix="model.moe")
    assert MoEConfig.from_dict({"gemm": "fused"}).gemm == "fused"


def test_row_index_without_inverse_is_refused():
    gemm = FusedExpertMLP()
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="order, inverse and weights"):
        gemm.expert_mlp(x, torch.randn(2, 16, 8), torch.randn(2, 8, 8), torch.tensor([2, 4], dtype=torch.int32), order=torch.arange(4))


def test_config_refuses_fused_with_an_fp8_recipe_which_would_replace_it():
    from moe.config import ExperimentConfig

    with pytest.raises(ConfigError, match="model.moe.gemm"):
        ExperimentConfig.load({"model": {"moe": {"gemm": "fused"}}, "precision": {"recipe": "fp8_rowwise"}})
    assert ExperimentConfig.load({"model": {"moe": {"gemm": "fused"}}, "train": {"recompute": "selective"}}).model.moe.gemm == "fused"


def test_selective_recompute_keeps_the_fused_forward_gemms():
    """The fused MLP's forward GEMMs are torch ops in the recompute policy's saved set."""
    from moe.layers.gemm_fused import FORWARD_OPS
    from moe.parallel.recompute import SAVED_OPS

    for mode in ("matmuls", "selective"):
        assert set(FORWARD_OPS) <= SAVED_OPS[mode]
