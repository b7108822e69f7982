"""Conversion against transformers' own OlmoeForCausalLM, both directions."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from moe.interop import ConversionError
from pipeline.errors import PipelineError
from pipeline.stages.convert import convert_from_hf, convert_to_hf, load_checkpoint_weights, load_tokens_tokenizer

transformers = pytest.importorskip("transformers")


def test_round_trip_dcp_hf_dcp_is_exact_and_logits_match(in_trained):
    tok = load_tokens_tokenizer("data/tokens")
    convert_to_hf("runs/train/checkpoints", "hf_a", tok)
    hf = transformers.AutoModelForCausalLM.from_pretrained("hf_a", dtype=torch.float32).eval()
    assert type(hf).__name__ == "OlmoeForCausalLM"
    assert transformers.AutoTokenizer.from_pretrained("hf_a").eos_token == tok.eos_token

    from pipeline.stages.evaluate import load_our_model

    ours = load_our_model("runs/train/checkpoints", torch.device("cpu"))
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
    cfg = ExperimentConfig.load({
        "model": model_cfg.to_dict(),
        "data": {"paths": ["data/tokens/train"], "seq_len": 32},
        "train": {"global_batch_size": 4, "micro_batch_size": 4, "max_steps": 1},
        "schedule": {"warmup_steps": 0},
        "checkpoint": {"dir": "cont", "init_from": "init_ckpt"},
    })
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
    from moe.train.optim import MasterWeightAdamW
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
    (e / "config.json").write_text(json.dumps({
        "model_type": "olmoe", "vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_experts": 2, "num_experts_per_tok": 1, "intermediate_size": 8}))
    save_file({"model.embed_tokens.weight": torch.zeros(64, 16)}, str(e / "model.safetensors"))
    with pytest.raises(ConversionError, match="is missing"):
        convert_from_hf(e, tmp_path / "out2")
    assert not (tmp_path / "out2").exists()
