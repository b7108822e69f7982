"""Our model against transformers' own OlmoeForCausalLM, loaded through from_pretrained."""

import json

import pytest
import torch
from safetensors.torch import save_file

from moe.config import ModelConfig
from moe.interop import ConversionError, from_hf, hf_config, model_config_from_hf, to_hf
from moe.model import Transformer

transformers = pytest.importorskip("transformers")


def save_hf_dir(path, cfg, model):
    save_file(to_hf(cfg, model.state_dict()), str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(hf_config(cfg, eos_id=0, pad_id=None)))


@pytest.mark.parametrize(
    "over",
    [{}, {"tie_embeddings": True, "n_kv_heads": 2}, {"moe": {"normalize_top_k": True, "top_k": 3}}],
)
def test_logits_match_transformers_olmoe(tmp_path, over):
    cfg = ModelConfig.from_dict({"preset": "tiny", **over}).validate()
    model = Transformer(cfg).eval()
    save_hf_dir(tmp_path, cfg, model)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(hf).__name__ == "OlmoeForCausalLM"
    x = torch.randint(0, cfg.vocab_size, (2, 40))
    with torch.no_grad():
        ours, theirs = model(x), hf(x).logits
    assert (ours - theirs).abs().max() < 1e-5 * max(1.0, theirs.abs().max().item())
    # and back: HF weights -> our names, bit-exact
    back = from_hf(model_config_from_hf(json.loads((tmp_path / "config.json").read_text())), hf.state_dict())
    for name, p in model.named_parameters():
        assert torch.equal(back[name], p), name


@pytest.mark.parametrize(
    "over, key",
    [
        ({"moe": {"num_shared_experts": 1}}, "model.moe.num_shared_experts"),
        ({"moe": {"score_func": "sigmoid"}}, "model.moe.score_func"),
        ({"dense_layers": [0], "dense_hidden": 32}, "model.dense_layers"),
        ({"moe": {"bias_update_rate": 0.01}}, "model.moe.bias_update_rate"),
        ({"qk_norm": False}, "model.qk_norm"),
    ],
)
def test_inexpressible_options_are_refused_by_name(over, key):
    cfg = ModelConfig.from_dict({"preset": "tiny", **over}).validate()
    with pytest.raises(ConversionError, match=key):
        hf_config(cfg, eos_id=0, pad_id=None)


def test_non_olmoe_config_is_refused():
    with pytest.raises(ConversionError, match="model_type is 'llama', not 'olmoe'"):
        model_config_from_hf({"model_type": "llama"})


@pytest.mark.parametrize(
    "key, value",
    [("hidden_act", "gelu"), ("clip_qkv", 8.0), ("attention_bias", True), ("attention_dropout", 0.1),
     ("mlp_bias", True), ("sliding_window", 4096), ("layer_types", ["full_attention"])],
)
def test_every_hf_setting_we_do_not_express_is_refused_by_name(key, value):
    hf = hf_config(ModelConfig.from_dict({"preset": "tiny"}).validate(), eos_id=0, pad_id=None)
    model_config_from_hf(hf)  # our own export converts back
    with pytest.raises(ConversionError, match=f"{key}="):
        model_config_from_hf({**hf, key: value})


def test_transformers_own_olmoe_config_converts():
    """Every key transformers writes for a default OLMoE config is mapped or known to be inert."""
    hf = transformers.OlmoeConfig().to_dict()
    cfg = model_config_from_hf(hf)
    assert cfg.moe.num_experts == hf["num_experts"] and cfg.d_model == hf["hidden_size"]
