"""Parameter counts and FLOPs per token from the model config: the counts equal a built model's."""

import pytest
import torch

from moe.config import ExperimentConfig, ModelConfig
from moe.layers.experts import GroupedExperts
from moe.model import Transformer
from moe.plan.accounting import flops_per_token, param_counts


def test_flops_per_token_counts_only_top_k_experts_and_attention():
    cfg = ModelConfig.from_dict(
        {"vocab_size": 100, "d_model": 16, "n_layers": 2, "n_heads": 2, "moe": {"num_experts": 8, "top_k": 2, "expert_hidden": 4}}
    ).validate()
    d, v, s = 16, 100, 32
    per_layer = 4 * d * d + 8 * d + 2 * 3 * d * 4  # q,k,v,o + router + 2 active experts
    expected = 6 * (2 * per_layer + v * d) + 12 * 2 * s * d
    assert flops_per_token(cfg, s) == expected
    assert param_counts(cfg).matmul_active == 2 * per_layer + v * d


def built_counts(cfg: ModelConfig) -> tuple[int, int]:
    """(total, active) parameters of the model built on the meta device (active: top_k of the
    routed experts)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    seen, total, inactive = set(), 0, 0
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            total += p.numel()
            if isinstance(module, GroupedExperts):
                inactive += p.numel() * (module.num_experts - cfg.moe.top_k) // module.num_experts
    return total, total - inactive


@pytest.mark.parametrize(
    "model",
    [
        {},
        {"dense_layers": [0], "dense_hidden": 96, "tie_embeddings": True, "moe": {"num_shared_experts": 2}},
        {"qk_norm": False, "n_kv_heads": 1},
        {"preset": "olmoe-1b-7b", "n_layers": 2},
    ],
    ids=["tiny", "dense-shared-tied", "no-qk-norm-gqa", "olmoe-2-layers"],
)
def test_counts_from_the_config_equal_the_built_model(model):
    cfg = ExperimentConfig.load({"model": {"preset": "tiny", **model}})
    counts = param_counts(cfg.model)
    assert (counts.total, counts.active) == built_counts(cfg.model)
