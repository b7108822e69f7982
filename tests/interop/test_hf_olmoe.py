"""Our model against transformers' own OlmoeForCausalLM, loaded through from_pretrained."""

import json
import re

import pytest
import torch
from safetensors.torch import save_file

from moe.config import ModelConfig
from moe.interop import ConversionError, check_hf_tensors, from_hf, hf_config, model_config_from_hf, to_hf
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
    [
        ("hidden_act", "gelu"),
        ("clip_qkv", 8.0),
        ("attention_bias", True),
        ("attention_dropout", 0.1),
        ("mlp_bias", True),
        ("sliding_window", 4096),
        ("layer_types", ["full_attention"]),
    ],
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


# ------------------------------------------------------------------ hostile config.json values


def tiny_hf(**over):
    cfg = ModelConfig.from_dict({"preset": "tiny", **over}).validate()
    return cfg, hf_config(cfg, eos_id=0, pad_id=None)


@pytest.mark.parametrize(
    "key, value, words",
    [
        ("hidden_size", "64", "hidden_size must be an integer, got str '64'"),
        ("hidden_size", 64.5, "hidden_size must be an integer, got float 64.5"),
        ("num_hidden_layers", True, "num_hidden_layers must be an integer, got bool True"),
        ("num_experts", None, "num_experts must be an integer, got NoneType None"),
        ("num_key_value_heads", "2", "num_key_value_heads must be an integer or null"),
        ("rms_norm_eps", "small", "rms_norm_eps must be a number"),
        ("rms_norm_eps", float("nan"), "rms_norm_eps must be a number"),
        ("tie_word_embeddings", "yes", "tie_word_embeddings must be a bool"),
        ("rope_scaling", "linear", "rope_scaling must be an object or null, got str 'linear'"),
        ("rope_parameters", [10000.0], "rope_parameters must be an object or null"),
        ("rope_parameters", {"rope_type": "yarn"}, "rope_parameters has rope_type 'yarn'"),
        ("rope_parameters", {"rope_theta": "big"}, "rope_parameters.rope_theta must be a number"),
        ("num_attention_heads", 3, "hidden_size (model.d_model): d_model=64 is not divisible by n_heads=3"),
        ("num_experts_per_tok", 0, "num_experts_per_tok (model.moe.top_k)"),
    ],
)
def test_config_values_are_refused_by_file_and_key(key, value, words):
    _, hf = tiny_hf()
    with pytest.raises(ConversionError) as exc:
        model_config_from_hf({**hf, key: value}, "d/config.json")
    assert str(exc.value).startswith("d/config.json: ") and words in str(exc.value)


def test_a_config_that_is_not_an_object_or_lacks_a_size_is_refused():
    with pytest.raises(ConversionError, match="d/config.json: expected a JSON object of settings, got list"):
        model_config_from_hf([1, 2], "d/config.json")
    _, hf = tiny_hf()
    del hf["vocab_size"]
    with pytest.raises(ConversionError, match="d/config.json: vocab_size is missing"):
        model_config_from_hf(hf, "d/config.json")


# ------------------------------------------------------------------ tensor names and shapes


@pytest.mark.parametrize("over", [{}, {"tie_embeddings": True, "n_kv_heads": 2}])
def test_the_shapes_config_json_implies_are_those_of_our_export_and_of_transformers(over):
    cfg, hf = tiny_hf(**over)
    ours = {name: tuple(t.shape) for name, t in to_hf(cfg, Transformer(cfg).state_dict()).items()}
    check_hf_tensors(cfg, ours)  # per-expert layout
    theirs = transformers.OlmoeForCausalLM(transformers.OlmoeConfig(**hf)).state_dict()
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in theirs)  # transformers v5 holds the fused layout
    check_hf_tensors(cfg, {name: tuple(t.shape) for name, t in theirs.items() if not (cfg.tie_embeddings and name == "lm_head.weight")})


def _tiny_shapes():
    cfg, _ = tiny_hf()
    return cfg, {name: tuple(t.shape) for name, t in to_hf(cfg, Transformer(cfg).state_dict()).items()}


def test_every_tensor_name_and_shape_is_checked_against_the_config():
    cfg, shapes = _tiny_shapes()
    n_exp, layers = cfg.moe.num_experts, cfg.n_layers
    gate = shapes["model.layers.0.mlp.experts.0.gate_proj.weight"]
    cases = [
        ({f"model.layers.0.mlp.experts.{n_exp}.gate_proj.weight": gate}, f"expert {n_exp} does not exist (config.json num_experts={n_exp})"),
        ({f"model.layers.{layers}.input_layernorm.weight": (cfg.d_model,)}, f"layer {layers} does not exist"),
        ({"model.layers.0.mlp.shared_expert.weight": gate}, "model.layers.0.mlp.shared_expert.weight has no counterpart"),
        ({f"model.layers.{'9' * 5000}.input_layernorm.weight": (cfg.d_model,)}, "input_layernorm.weight has no counterpart"),
        ({"model.norm.weight": (cfg.d_model + 1,)}, f"model.norm.weight has shape ({cfg.d_model + 1},), config.json says ({cfg.d_model},)"),
        ({"model.layers.1.mlp.experts.gate_up_proj": (n_exp, 2 * cfg.moe.expert_hidden, cfg.d_model)}, "model.layers.1 holds both"),
    ]
    for extra, words in cases:
        with pytest.raises(ConversionError, match=re.escape(words)):
            check_hf_tensors(cfg, {**shapes, **extra}, "d")
    for name in ("lm_head.weight", "model.layers.1.self_attn.k_norm.weight", f"model.layers.1.mlp.experts.{n_exp - 1}.down_proj.weight"):
        with pytest.raises(ConversionError, match=re.escape(f"d: tensor {name} is missing")):
            check_hf_tensors(cfg, {k: v for k, v in shapes.items() if k != name}, "d")


def test_a_config_claiming_a_billion_experts_fails_fast():
    cfg, shapes = _tiny_shapes()
    huge = cfg.replace(n_layers=10**9, moe=cfg.moe.replace(num_experts=10**9))
    with pytest.raises(ConversionError, match="has shape"):  # the router's rows, checked before anything is counted
        check_hf_tensors(huge, shapes)
    routers = {k: (10**9, cfg.d_model) for k in shapes if k.endswith("mlp.gate.weight")}
    with pytest.raises(ConversionError, match=re.escape(f"model.layers.0.mlp.experts.{cfg.moe.num_experts}.gate_proj.weight is missing")):
        check_hf_tensors(huge, {**shapes, **routers})  # stops at the first gap: no billion-name loop


def test_a_tied_lm_head_is_dropped_only_when_it_is_the_embedding():
    cfg, _ = tiny_hf(tie_embeddings=True)
    hf_state = to_hf(cfg, Transformer(cfg).state_dict())
    assert "lm_head.weight" not in from_hf(cfg, {**hf_state, "lm_head.weight": hf_state["model.embed_tokens.weight"].clone()})
    with pytest.raises(ConversionError, match="lm_head.weight differs from model.embed_tokens.weight"):
        from_hf(cfg, {**hf_state, "lm_head.weight": torch.zeros_like(hf_state["model.embed_tokens.weight"])})
