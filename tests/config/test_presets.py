import pytest

from moe.config import ModelConfig, preset_names
from moe.model import Transformer
from moe.plan.accounting import param_counts


def counts(name, **over):
    return param_counts(ModelConfig.from_dict({"preset": name, **over}).validate())


def test_olmoe_1b_7b_counts():
    # allenai/OLMoE-1B-7B: 6.9B total, 1.3B active (1.28B exactly with its 50304 vocabulary).
    c = counts("olmoe-1b-7b")
    assert c.total == 6_919_161_856
    assert round(c.total / 1e9, 1) == 6.9
    assert round(c.active / 1e9, 1) == 1.3


def test_paper_8_layer_model_counts():
    # paper.md: 3.17B active / 24.31B total at 64 experts.
    c = counts("paper-8l")
    assert round(c.total / 1e9, 2) == 24.31
    assert round(c.active / 1e9, 2) == 3.17


@pytest.mark.parametrize("experts, total", [(8, 4.6), (128, 47)])
def test_paper_expert_sweep_totals(experts, total):
    # paper.md: experts 8 -> 128 at top-4, ~3.2B active, total 4.6B -> 47B.
    c = counts(f"paper-8l-e{experts}")
    assert round(c.total / 1e9, 0 if total > 10 else 1) == total
    assert round(c.active / 1e9, 1) == 3.2


def test_preset_overrides_apply_on_top():
    cfg = ModelConfig.from_dict({"preset": "olmoe-1b-7b", "moe": {"num_experts": 16}})
    assert cfg.moe.num_experts == 16 and cfg.moe.top_k == 8 and cfg.d_model == 2048


@pytest.mark.parametrize(
    "over",
    [
        {},
        {"tie_embeddings": True},
        {"n_kv_heads": 2, "dense_layers": [1], "dense_hidden": 48},
        {"moe": {"num_shared_experts": 2, "shared_expert_hidden": 16}},
    ],
)
def test_analytic_counts_match_a_built_model(over):
    cfg = ModelConfig.from_dict({"preset": "tiny", **over}).validate()
    model = Transformer(cfg)
    assert param_counts(cfg).total == sum(p.numel() for p in model.parameters())


def test_all_presets_validate():
    for name in preset_names():
        ModelConfig.from_dict({"preset": name}).validate()


def test_explicit_keys_win_over_the_preset_and_are_named():
    from moe.config import ModelConfig

    cfg = ModelConfig.from_dict({"preset": "olmoe-1b-7b", "d_model": 1024, "moe": {"num_experts": 64, "top_k": 4}}).validate()
    assert (cfg.d_model, cfg.n_layers, cfg.moe.num_experts, cfg.moe.top_k) == (1024, 16, 64, 4)
    assert cfg.preset == "olmoe-1b-7b" and cfg.preset_overrides == ["d_model", "moe.top_k"]
    again = ModelConfig.from_dict(cfg.to_dict()).validate()  # a job spec / checkpoint re-read
    assert again == cfg
    assert ModelConfig.from_dict({"preset": "tiny"}).preset_overrides == []


def test_params_yaml_preset_switch_gives_the_presets_shape(tmp_path):
    """`--set model.preset=olmoe-1b-7b` on the shipped params.yaml is the real OLMoE shape."""
    from pipeline.params import load_params
    from tests.helpers import committed_params

    params = tmp_path / "params.yaml"
    params.write_text(committed_params())
    cfg = load_params(params, ["model.preset=olmoe-1b-7b"])
    assert (cfg.model.d_model, cfg.model.n_layers, cfg.model.moe.num_experts, cfg.model.vocab_size) == (2048, 16, 64, 50304)
    assert cfg.model.preset_overrides == []
    assert load_params(params).model.d_model == 64
