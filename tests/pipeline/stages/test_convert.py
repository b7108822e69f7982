"""Conversion against transformers' own OlmoeForCausalLM, both directions."""

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from moe.interop import ConversionError
from moe.train.weights import load_checkpoint_weights
from pipeline.errors import PipelineError
from pipeline.stages.convert import check_hf_dir, convert_from_hf, convert_to_hf, load_tokens_tokenizer

transformers = pytest.importorskip("transformers")


def test_round_trip_dcp_hf_dcp_is_exact_and_logits_match(in_trained):
    tok = load_tokens_tokenizer("data/tokens")
    convert_to_hf("runs/train/checkpoints", "hf_a", tok)
    hf = transformers.AutoModelForCausalLM.from_pretrained("hf_a", dtype=torch.float32).eval()
    assert type(hf).__name__ == "OlmoeForCausalLM"
    assert transformers.AutoTokenizer.from_pretrained("hf_a").eos_token == tok.eos_token

    from moe.train.weights import load_model

    ours = load_model("runs/train/checkpoints", torch.device("cpu"))
    x = torch.randint(0, 300, (2, 24))
    with torch.no_grad():
        assert (ours(x) - hf(x).logits).abs().max() < 1e-5

    convert_from_hf("hf_a", "back")
    _, original, _ = load_checkpoint_weights("runs/train/checkpoints")
    _, returned, meta = load_checkpoint_weights("back")
    assert meta["weights_only"] is True
    assert original.keys() == returned.keys()
    for name in original:
        assert torch.equal(original[name], returned[name]), name


def test_sharded_bf16_output_loads(in_trained):
    convert_to_hf("runs/train/checkpoints", "hf_sharded", load_tokens_tokenizer("data/tokens"), dtype="bfloat16", max_shard_bytes=20_000)
    assert (Path("hf_sharded") / "model.safetensors.index.json").is_file()
    assert len(list(Path("hf_sharded").glob("model-*.safetensors"))) > 1
    hf = transformers.AutoModelForCausalLM.from_pretrained("hf_sharded")
    assert hf.dtype == torch.bfloat16
    convert_from_hf("hf_sharded", "back_sharded")


def test_continue_training_from_a_converted_hf_model(in_trained, monkeypatch):
    from moe.config import ExperimentConfig
    from moe.train.trainer import Trainer

    convert_to_hf("runs/train/checkpoints", "hf_c", load_tokens_tokenizer("data/tokens"))
    model_cfg = convert_from_hf("hf_c", "init_ckpt")
    cfg = ExperimentConfig.load(
        {
            "model": model_cfg.to_dict(),
            "data": {"paths": ["data/tokens/train"], "seq_len": 32},
            "train": {"global_batch_size": 4, "micro_batch_size": 4, "max_steps": 1},
            "schedule": {"warmup_steps": 0},
            "checkpoint": {"dir": "cont", "init_from": "init_ckpt"},
        }
    )
    trainer = Trainer(cfg)
    trainer.maybe_resume()
    _, weights, _ = load_checkpoint_weights("runs/train/checkpoints")
    assert torch.equal(trainer.model.layers["0"].mlp.experts.gate_up, weights["layers.0.mlp.experts.gate_up"])


def test_inexpressible_model_is_refused_by_option_name(tmp_path):
    from moe.config import ExperimentConfig
    from moe.model import Transformer
    from moe.train.checkpoint import CheckpointManager

    cfg = ExperimentConfig.load({"model": {"preset": "tiny", "moe": {"num_shared_experts": 1}}})
    model = Transformer(cfg.model)
    from moe.config import OptimizerConfig
    from moe.optim import MasterWeightAdamW
    from moe.train.state import save_entries

    entries = save_entries(model, MasterWeightAdamW(model, OptimizerConfig(), master_weights=False))
    CheckpointManager(tmp_path / "ck").save(1, entries, {"config": cfg.to_dict()}, {})
    with pytest.raises(ConversionError, match="model.moe.num_shared_experts: cannot convert"):
        convert_to_hf(tmp_path / "ck", tmp_path / "hf", None)
    assert not (tmp_path / "hf").exists()


def test_non_olmoe_or_broken_hf_dirs_are_refused(tmp_path):
    d = tmp_path / "llama"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConversionError, match="model_type is 'llama', not 'olmoe'"):
        convert_from_hf(d, tmp_path / "out")
    with pytest.raises(PipelineError, match="no config.json"):
        convert_from_hf(tmp_path, tmp_path / "out")
    e = tmp_path / "olmoe"
    e.mkdir()
    (e / "config.json").write_text(
        json.dumps(
            {
                "model_type": "olmoe",
                "vocab_size": 64,
                "hidden_size": 16,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "num_experts": 2,
                "num_experts_per_tok": 1,
                "intermediate_size": 8,
            }
        )
    )
    save_file({"model.embed_tokens.weight": torch.zeros(64, 16)}, str(e / "model.safetensors"))
    with pytest.raises(ConversionError, match="is missing"):
        convert_from_hf(e, tmp_path / "out2")
    assert not (tmp_path / "out2").exists()


# ----------------------------------------------------------- the HF directory validator


def transformers_dir(path: Path, dtype=torch.float32, **over) -> Path:
    """An OLMoE directory written by transformers itself (its own names, layout and config.json)."""
    config = transformers.OlmoeConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=8,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        eos_token_id=0,
        **over,
    )
    transformers.OlmoeForCausalLM(config).to(dtype).save_pretrained(path)
    return path


def rewrite(path: Path, change) -> None:
    from safetensors.torch import load_file

    state = load_file(path)
    change(state)
    save_file(state, str(path), metadata={"format": "pt"})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_transformers_own_directories_pass_and_convert(tmp_path, dtype):
    d = transformers_dir(tmp_path / "hf", dtype)
    assert check_hf_dir(d).moe.num_experts == 4
    convert_from_hf(d, tmp_path / "ck")
    assert (tmp_path / "ck/latest").is_file()


@pytest.mark.parametrize(
    "change, words",
    [
        (lambda s: s["model.norm.weight"].fill_(float("inf")), "tensor model.norm.weight holds NaN or infinite values"),
        (lambda s: s.update({"model.norm.weight": s["model.norm.weight"].double()}), "tensor model.norm.weight is float64"),
        (lambda s: s.update({"model.norm.weight": s["model.norm.weight"].to(torch.int64)}), "tensor model.norm.weight is int64"),
        (lambda s: s.pop("model.layers.1.post_attention_layernorm.weight"), "tensor model.layers.1.post_attention_layernorm.weight is missing"),
        (lambda s: s.update({"model.layers.0.mlp.experts.9.up_proj.weight": torch.zeros(8, 16)}), "expert 9 does not exist"),
    ],
)
def test_hostile_weights_are_refused_by_tensor_name(tmp_path, change, words):
    d = transformers_dir(tmp_path / "hf")
    rewrite(d / "model.safetensors", change)
    with pytest.raises(ConversionError, match=re.escape(words)):
        check_hf_dir(d)
    with pytest.raises(ConversionError, match=re.escape(words)):
        convert_from_hf(d, tmp_path / "ck")
    assert not (tmp_path / "ck").exists()


def test_a_tied_lm_head_must_be_the_embedding(tmp_path):
    d = transformers_dir(tmp_path / "hf")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    with pytest.raises(ConversionError, match="lm_head.weight differs from model.embed_tokens.weight"):
        check_hf_dir(d)
    rewrite(d / "model.safetensors", lambda s: s.update({"lm_head.weight": s["model.embed_tokens.weight"].clone()}))
    assert check_hf_dir(d).tie_embeddings


def shard_with_index(d: Path, shard: str, target: Path | None = None) -> None:
    """model.safetensors moved to `target` (default: d/shard), and an index naming `shard` for every tensor."""
    from safetensors import safe_open

    with safe_open(d / "model.safetensors", framework="pt") as f:
        names = list(f.keys())
    (d / "model.safetensors").rename(target or d / shard)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": dict.fromkeys(names, shard)}))


def test_every_shard_is_a_file_inside_the_directory(tmp_path):
    d = transformers_dir(tmp_path / "hf")
    shard_with_index(d, "../outside.safetensors", tmp_path / "outside.safetensors")
    with pytest.raises(PipelineError, match=re.escape("'../outside.safetensors' is not a relative path inside")):
        check_hf_dir(d)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": dict.fromkeys(index["weight_map"], "shard.safetensors")}))
    (d / "shard.safetensors").symlink_to(tmp_path / "outside.safetensors")
    with pytest.raises(PipelineError, match="a symlink pointing outside"):
        check_hf_dir(d)
    (d / "shard.safetensors").unlink()
    (tmp_path / "outside.safetensors").rename(d / "real.safetensors")
    (d / "shard.safetensors").symlink_to("real.safetensors")  # a link within the directory is fine
    check_hf_dir(d)


def test_the_index_must_match_the_shards(tmp_path):
    d = transformers_dir(tmp_path / "hf")
    shard_with_index(d, "a.safetensors")
    index_path = d / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index_path.write_text(json.dumps({"weight_map": {**index["weight_map"], "model.norm.weight": "b.safetensors"}}))
    save_file({"x": torch.zeros(1)}, str(d / "b.safetensors"))
    with pytest.raises(PipelineError, match="puts tensor model.norm.weight in b.safetensors, but a.safetensors holds it"):
        check_hf_dir(d)
    index_path.write_text(json.dumps({"weight_map": {**index["weight_map"], "model.ghost.weight": "a.safetensors"}}))
    with pytest.raises(PipelineError, match="weight_map names tensor model.ghost.weight, which no shard holds"):
        check_hf_dir(d)
    (d / "model.safetensors").write_bytes(b"")
    with pytest.raises(PipelineError, match="holds both model.safetensors and model.safetensors.index.json"):
        check_hf_dir(d)
    (d / "model.safetensors").unlink()
    index_path.write_text(json.dumps({"weight_map": index["weight_map"]}))
    (d / "a.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(PipelineError, match="a.safetensors: unreadable safetensors file"):
        check_hf_dir(d)


def test_a_deeply_nested_config_json_is_one_clear_error(tmp_path):
    d = transformers_dir(tmp_path / "hf")
    (d / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(PipelineError, match="config.json: (nested too deeply|not valid JSON)"):
        check_hf_dir(d)


def test_convert_refuses_another_tokenizer_naming_both_hashes(in_trained, tmp_path):
    from tokenizers import Tokenizer

    from pipeline.tokenizer import describe

    tok = load_tokens_tokenizer("data/tokens")
    other = Tokenizer.from_str(tok.json_text)
    other.add_tokens(["<another>"])
    other = describe(other)
    meta = json.loads(next(Path("runs/train/checkpoints").glob("step_*/meta.json")).read_text())
    with pytest.raises(PipelineError) as exc:
        convert_to_hf("runs/train/checkpoints", tmp_path / "hf", other, tokenizer_file="other/tokenizer.json")
    assert str(exc.value).startswith("other/tokenizer.json: tokenizer ")
    assert other.sha256[:12] in str(exc.value) and meta["config"]["data"]["tokenizer_hash"][:12] in str(exc.value)
    big = Tokenizer.from_str(tok.json_text)
    big.add_tokens([f"<t{i}>" for i in range(400)])
    with pytest.raises(PipelineError, match="tokens, more than the checkpoint's model.vocab_size=320"):
        convert_to_hf("runs/train/checkpoints", tmp_path / "hf", describe(big))
    assert not (tmp_path / "hf").exists()


def test_a_checkpoint_converted_from_hf_records_no_tokenizer_and_converts_with_one_that_fits(in_trained, tmp_path):
    tok = load_tokens_tokenizer("data/tokens")
    convert_to_hf("runs/train/checkpoints", tmp_path / "hf", tok)
    convert_from_hf(tmp_path / "hf", tmp_path / "ck")
    convert_to_hf(tmp_path / "ck", tmp_path / "hf2", tok)  # no data.tokenizer_hash to compare: only the vocabulary is


# ----------------------------------------------- issue 50: config.json and the index through moe.reader

OLMOE_CONFIG = {
    "model_type": "olmoe",
    "vocab_size": 64,
    "hidden_size": 16,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_experts": 2,
    "num_experts_per_tok": 1,
    "intermediate_size": 8,
}


@pytest.mark.parametrize(
    "text, field",
    [
        (json.dumps({**OLMOE_CONFIG, "hidden_size": "16"}), "config.json: hidden_size: expected an integer"),
        (json.dumps({**OLMOE_CONFIG, "num_experts": -2}), "config.json: num_experts: expected an integer in [0, "),
        (json.dumps({**OLMOE_CONFIG, "rope_scaling": "linear"}), "config.json: rope_scaling: expected a mapping"),
        (json.dumps(OLMOE_CONFIG)[:-1] + ', "rms_norm_eps": 1e999}', "config.json: rms_norm_eps: expected a finite number"),
        (json.dumps(OLMOE_CONFIG)[:-1] + ', "initializer_range": NaN}', "config.json: not valid JSON (NaN"),
        (json.dumps({**OLMOE_CONFIG, "task_specific_params": {"a": [[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]}}), "task_specific_params"),
    ],
)
def test_a_config_json_not_of_its_schema_is_one_error_naming_the_key(tmp_path, text, field):
    from pipeline.stages.convert import read_hf_config

    (tmp_path / "config.json").write_text(text)
    with pytest.raises(PipelineError) as exc:
        read_hf_config(tmp_path)
    assert field in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.parametrize(
    "index, field",
    [
        ({"weight_map": {"model.norm.weight": 7}}, "weight_map.model.norm.weight: expected a string"),
        ({"weight_map": {"model.norm.weight": "a.safetensors"}, "shards": 2}, "shards: unknown key"),
        ({"metadata": {"total_size": 8}}, "weight_map: missing"),
    ],
)
def test_an_index_not_of_its_schema_is_one_error_naming_the_field(tmp_path, index, field):
    from pipeline.stages.convert import INDEX, shard_names

    (tmp_path / INDEX).write_text(json.dumps(index))
    with pytest.raises(PipelineError, match=re.escape(f"{INDEX}: {field}")):
        shard_names(tmp_path)


def test_a_fifo_as_config_json_or_index_is_refused_at_once(tmp_path):
    from pipeline.hub import source_model_id
    from pipeline.stages.convert import INDEX, read_hf_config, shard_names
    from tests.pipeline.fifo import fifo_at, within

    fifo = fifo_at(tmp_path / "config.json")
    with pytest.raises(PipelineError, match="config.json: not found or not a file"):
        within(lambda: read_hf_config(tmp_path), fifo)
    assert within(lambda: source_model_id(tmp_path), fifo) is None
    fifo = fifo_at(tmp_path / INDEX)
    with pytest.raises(PipelineError, match=f"{INDEX}: not found or not a file"):
        within(lambda: shard_names(tmp_path), fifo)


def test_the_source_model_id_is_a_hub_id_of_a_config_json_of_its_schema(tmp_path):
    from pipeline.hub import source_model_id

    (tmp_path / "hf").mkdir()
    config = tmp_path / "hf/config.json"
    config.write_text(json.dumps({**OLMOE_CONFIG, "_name_or_path": "allenai/OLMoE-1B-7B-0924"}))
    assert source_model_id(tmp_path / "hf") == "allenai/OLMoE-1B-7B-0924"
    config.write_text(json.dumps({**OLMOE_CONFIG, "_name_or_path": "allenai/OLMoE-1B-7B-0924", "hidden_size": "16"}))
    assert source_model_id(tmp_path / "hf") is None  # not a config.json of its schema: no origin claimed
    config.write_text(json.dumps({**OLMOE_CONFIG, "_name_or_path": ["allenai/OLMoE-1B-7B-0924"]}))
    assert source_model_id(tmp_path / "hf") is None
