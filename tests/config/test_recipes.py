"""Training recipes beside the model presets (issue 28): explicit keys win, every value's
source is known, and a model preset the recipe was not made for gets one warning line."""

import pytest

from moe.config import ConfigError, ExperimentConfig
from moe.config.recipes import recipe_names
from moe.config.sources import recipe_mismatch, value_sources


def test_the_olmoe_recipe_is_olmo_core_s_script():
    cfg = ExperimentConfig.load({"recipe": "olmoe-1b-7b", "train": {"max_steps": 5000}})
    assert cfg.model.preset == "olmoe-1b-7b" and cfg.model.d_model == 2048
    assert (cfg.optim.lr, cfg.optim.betas, cfg.optim.eps, cfg.optim.weight_decay, cfg.optim.decay_embeddings) == (4e-4, [0.9, 0.95], 1e-8, 0.1, False)
    assert (cfg.schedule.warmup_steps, cfg.schedule.decay, cfg.schedule.min_lr_ratio) == (2000, "cosine", 0.1)
    assert (cfg.train.global_batch_size, cfg.train.micro_batch_size, cfg.data.seq_len) == (1024, 2, 4096)
    assert (cfg.train.grad_clip, cfg.train.logit_z_loss_weight) == (1.0, 1e-5)
    assert (cfg.model.moe.lb_loss_weight, cfg.model.moe.z_loss_weight) == (0.01, 0.001)
    assert set(recipe_names()) >= {"tiny", "olmoe-1b-7b", "paper-8l"}


def test_explicit_keys_win_and_each_value_names_its_source():
    raw = {"recipe": "olmoe-1b-7b", "optim": {"lr": 1e-4}, "model": {"n_layers": 4}, "train": {"max_steps": 3000}}
    cfg = ExperimentConfig.load(raw)
    assert cfg.optim.lr == 1e-4 and cfg.model.n_layers == 4 and cfg.optim.weight_decay == 0.1
    sources = value_sources(raw)
    assert sources["optim.lr"] == "params" and sources["optim.weight_decay"] == "recipe olmoe-1b-7b"
    assert sources["model.n_layers"] == "params" and sources["model.d_model"] == "preset olmoe-1b-7b"
    assert "model.init_std" not in sources  # the dataclass default


def test_a_big_preset_on_the_tiny_recipe_warns_once_naming_the_keys():
    raw = {"recipe": "tiny", "model": {"preset": "olmoe-1b-7b"}}
    line = recipe_mismatch(raw)
    assert line.startswith("model.preset=olmoe-1b-7b trains with recipe tiny's optim.lr=0.003, schedule.warmup_steps=20, ")
    assert "set recipe=olmoe-1b-7b" in line and "\n" not in line
    # the keys set by hand are the user's choice: no warning for them
    assert (
        recipe_mismatch(
            {
                "recipe": "tiny",
                "model": {"preset": "olmoe-1b-7b"},
                "optim": {"lr": 4e-4},
                "schedule": {"warmup_steps": 100},
                "train": {"global_batch_size": 64},
                "data": {"seq_len": 4096},
            }
        )
        is None
    )
    assert recipe_mismatch({"recipe": "olmoe-1b-7b"}) is None
    assert recipe_mismatch({"recipe": "paper-8l", "model": {"preset": "paper-8l-e128"}}) is None
    assert recipe_mismatch({"model": {"preset": "olmoe-1b-7b"}}) is None  # no recipe: the library's defaults


def test_an_unknown_recipe_is_one_error_with_a_hint():
    with pytest.raises(ConfigError, match=r"recipe: unknown recipe 'olmoe' \(did you mean 'olmoe-1b-7b'\?\); known: olmoe-1b-7b"):
        ExperimentConfig.load({"recipe": "olmoe"})


def test_the_cli_prints_sources_and_the_warning(workspace):
    from pathlib import Path

    import yaml

    from tests.helpers import moe

    params = yaml.safe_load(Path("params.yaml").read_text())
    params["recipe"] = "tiny"
    params.pop("optim", None)
    Path("params.yaml").write_text(yaml.safe_dump(params))
    r = moe("params", "--set", "model.preset=olmoe-1b-7b", "--set", "model.n_layers=2")
    assert r.returncode == 0, r.stderr
    warnings = [line for line in r.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "recipe tiny's optim.lr=0.003, made for tiny" in warnings[0]
    assert "optim.lr = 0.003  # recipe tiny" in r.stdout and "model.n_layers = 2  # --set" in r.stdout
    assert "model.n_heads = 2  # params.yaml" in r.stdout and "model.rope_theta = 10000.0  # preset olmoe-1b-7b" in r.stdout
    assert "train.max_steps = 8  # params.yaml" in r.stdout and "model.init_std = 0.02  # default" in r.stdout
