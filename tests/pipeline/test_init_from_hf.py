"""Continuing a published OLMoE model as the README says (issue 28): a freshly initialised
transformers OLMoE saved with save_pretrained, `moe convert --from-hf`, then `moe train` from
params written by hand with its shape only; the first step's loss is the one transformers
computes for the same batch. init_from compares the architecture, never bookkeeping or the
training losses' weights."""

import json
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers import moe

SHAPE = {"vocab_size": 320, "d_model": 64, "n_layers": 2, "n_heads": 4, "moe": {"num_experts": 8, "top_k": 2, "expert_hidden": 32}}


def _save_hf_model(directory: Path) -> None:
    from transformers import OlmoeConfig, OlmoeForCausalLM

    torch.manual_seed(0)
    config = OlmoeConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=512,
        pad_token_id=1,
        eos_token_id=0,
        bos_token_id=None,
    )
    OlmoeForCausalLM(config).save_pretrained(directory)


def _first_batch(cfg) -> torch.Tensor:
    from moe.data import BatchLoader, TokenDataset

    data = TokenDataset(["data/tokens/train"], cfg.data.seq_len)
    loader = BatchLoader(data, global_batch_size=cfg.train.global_batch_size, micro_batch_size=cfg.train.micro_batch_size, seed=cfg.data.seed)
    return torch.cat(loader.next_batch())


def test_a_save_pretrained_olmoe_continues_with_transformers_first_loss(workspace):
    from transformers import AutoModelForCausalLM

    from pipeline.params import load_params

    _save_hf_model(workspace / "olmoe-hf")
    r = moe("convert", "--from-hf", "olmoe-hf", "--out", "init_ckpt")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "preset" not in r.stdout  # the printed section holds the model, not how a config was written
    params = yaml.safe_load(Path("params.yaml").read_text())
    params["model"] = SHAPE  # written by hand, in the obvious way: no preset, no loss weights
    params["optim"] = {"lr": 1e-3}
    params["train"].update({"max_steps": 2, "log_every": 1, "eval_every": 0})
    params["checkpoint"] = {"dir": "runs/cont/ck", "init_from": "init_ckpt"}
    params["executor"] = {"run_dir": "runs/cont"}
    Path("params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    assert moe("tokenize", "--no-mlflow").returncode == 0
    r = moe("train", "--no-mlflow")
    assert r.returncode == 0, r.stderr[-3000:]
    first = json.loads(Path("runs/cont/metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1

    batch = _first_batch(load_params("params.yaml"))
    hf = AutoModelForCausalLM.from_pretrained("olmoe-hf", dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(input_ids=batch, labels=batch).loss.item()
    assert first["loss"] == pytest.approx(expected, rel=1e-5, abs=1e-5)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"d_model": 128, "n_heads": 4}, "model.d_model=64 there, 128 here"),
        ({"moe": {"top_k": 4}}, "model.moe.top_k=2 there, 4 here"),
        ({"tie_embeddings": True}, "model.tie_embeddings=False there, True here"),
    ],
)
def test_init_from_refuses_another_architecture_only(workspace, change, named):
    from moe.config import ExperimentConfig
    from moe.errors import CheckpointError
    from moe.train.trainer import Trainer
    from pipeline.stages.convert import convert_from_hf

    _save_hf_model(workspace / "olmoe-hf")
    convert_from_hf(workspace / "olmoe-hf", workspace / "init_ckpt")

    def trainer(model: dict) -> Trainer:
        from tests.helpers import make_corpus

        corpus = make_corpus(workspace / "tok", vocab=320)
        cfg = ExperimentConfig.load(
            {
                "recipe": "tiny",
                "model": model,
                "data": {"paths": [str(p) for p in corpus], "seq_len": 16},
                "train": {"global_batch_size": 2, "micro_batch_size": 2, "max_steps": 1},
                "schedule": {"warmup_steps": 0},
                "checkpoint": {"dir": str(workspace / "c"), "init_from": str(workspace / "init_ckpt")},
            }
        )
        return Trainer(cfg)

    # bookkeeping and loss weights differ from what the converter wrote: accepted
    accepted = {**SHAPE, "preset": "tiny", "init_std": 0.01, "moe": {**SHAPE["moe"], "z_loss_weight": 0.0, "lb_loss_weight": 0.1}}
    trainer(accepted).maybe_resume()
    merged = {**SHAPE, **change, "moe": {**SHAPE["moe"], **change.get("moe", {})}}
    with pytest.raises(CheckpointError, match=f"written for a different model \\({named}\\)"):
        trainer(merged).maybe_resume()
