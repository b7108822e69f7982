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


def test_the_recipe_chooses_the_expert_gemm_once_at_model_build():
    cfg = ExperimentConfig.load({"model": {"preset": "tiny"}}).model
    for name, kind in [("fp8_rowwise", Fp8GroupedGemm), ("mxfp8", MxFp8GroupedGemm), ("bf16", GroupedMM), ("fp32", GroupedMM)]:
        recipe = resolve_recipe(name, CPU, emulate=True, fp8_min_dim=0)
        model = recipe.prepare(Transformer(cfg, expert_gemm=recipe.expert_gemm))
        experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
        assert experts and all(type(m.gemm) is kind for m in experts)
        assert all(p.dtype == recipe.param_dtype for p in model.parameters())
    recipe = resolve_recipe("fp8_rowwise", CPU, emulate=True, fp8_min_dim=0, fp8_sink_wgrad_min_dim=2048)
    gemm = next(m for m in Transformer(cfg, expert_gemm=recipe.expert_gemm).modules() if isinstance(m, GroupedExperts)).gemm
    assert gemm.emulate and gemm.rule.min_dim == 0 and gemm.rule.sink_wgrad_min_dim == 2048
    with pytest.raises(ValueError, match=r"layers.0.mlp.experts.gemm is GroupedMM, but precision.recipe fp8_rowwise builds Fp8GroupedGemm"):
        recipe.prepare(Transformer(cfg))  # built without the recipe's GEMM: refused, not swapped


def _train_losses(release: bool, min_dim: int, steps: int = 3) -> tuple[list[float], Transformer]:
    from moe.config import OptimizerConfig
    from moe.optim import MasterWeightAdamW

    cfg = ExperimentConfig.load({"model": {"preset": "tiny"}}).model
    torch.manual_seed(0)
    recipe = resolve_recipe("fp8_rowwise", CPU, emulate=True, fp8_min_dim=min_dim)
    model = recipe.prepare(Transformer(cfg, expert_gemm=recipe.expert_gemm))
    opt = MasterWeightAdamW(model, OptimizerConfig(lr=1e-2), recipe.master_weights)
    if release:
        assert recipe.attach_optimizer(model, opt, broadcasts_expert_weights=False) == 2 * cfg.n_layers
    tokens = torch.randint(0, cfg.vocab_size, (2, 33), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(steps):
        for _ in range(2):  # two micro-batches: the second reads the copies the first made
            with recipe.autocast(CPU):
                logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model


@pytest.mark.parametrize("min_dim", [0, 1 << 20], ids=["every-gemm-fp8", "rule-keeps-bf16"])
def test_fp8_expert_weights_are_made_from_the_masters_without_a_bf16_copy(min_dim):
    """Issue 39: under fp8_rowwise the expert weights' bf16 values are dropped and their FP8 (or,
    where the rule keeps bf16, bf16) copies made from the fp32 masters: the same bits as the
    copies of the bf16 weights the optimizer used to write, and the bf16 weights hold nothing."""
    kept, _ = _train_losses(release=False, min_dim=min_dim)
    released, model = _train_losses(release=True, min_dim=min_dim)
    assert released == kept
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            for param in (module.gate_up, module.down):
                assert param.untyped_storage().nbytes() == param.element_size()


def test_zero1_keeps_the_bf16_expert_weights():
    from moe.config import OptimizerConfig
    from moe.optim import MasterWeightAdamW

    cfg = ExperimentConfig.load({"model": {"preset": "tiny"}}).model
    for name, broadcasts in (("fp8_rowwise", True), ("bf16", False)):
        recipe = resolve_recipe(name, CPU, emulate=True, fp8_min_dim=0)
        model = recipe.prepare(Transformer(cfg, expert_gemm=recipe.expert_gemm))
        opt = MasterWeightAdamW(model, OptimizerConfig(), recipe.master_weights)
        assert recipe.attach_optimizer(model, opt, broadcasts_expert_weights=broadcasts) == 0
        assert not opt.released


def test_zero1_over_one_rank_shards_nothing_and_fp8_releases_the_expert_weights(tmp_path):
    """The paper's FP8 stage runs ZeRO-1 on one GPU: there no owner sends weights to anyone, so
    the FP8 recipe drops the bf16 expert weights as without ZeRO-1 (its peak was 5.6 GiB above
    bf16's while it kept them: bench/paper/h200x1/REPORT.md)."""
    from moe.parallel.env import DistEnv
    from moe.parallel.layout import build_layout

    cfg = ExperimentConfig.load({"model": {"preset": "tiny"}, "parallel": {"shard_optimizer": True}})
    layout = build_layout(cfg, DistEnv(rank=0, world_size=1, local_rank=0, device=CPU))
    recipe = resolve_recipe("fp8_rowwise", CPU, emulate=True, fp8_min_dim=0)
    model = layout.parallelize(recipe.prepare(Transformer(cfg.model, expert_gemm=recipe.expert_gemm)))
    opt = layout.optimizer(model, cfg.optim, recipe.master_weights)
    assert not layout.broadcasts_expert_weights
    assert recipe.attach_optimizer(model, opt, broadcasts_expert_weights=layout.broadcasts_expert_weights) == 2 * cfg.model.n_layers


def test_where_the_fp8_rule_runs_no_expert_gemm_in_fp8_the_layers_run_bf16s_step(tmp_path, corpus):
    """fp8_rowwise at a shape whose rule keeps every expert GEMM bf16 (the tiny model's, at the
    default fp8_min_dim): the trainer gives the layers the bf16 recipe's GEMM and releases
    nothing, so the run is the bf16 recipe's, bit for bit; with every GEMM FP8 it keeps FP8."""
    from moe.layers.gemm import GroupedMM
    from moe.layers.gemm_fp8 import Fp8GroupedGemm
    from moe.train.trainer import Trainer
    from tests.helpers import tiny_config

    runs = {}
    for name, precision in {
        "bf16": {"recipe": "bf16"},
        "fp8-kept-bf16": {"recipe": "fp8_rowwise", "emulate": True},
        "fp8": {"recipe": "fp8_rowwise", "emulate": True, "fp8_min_dim": 0},
    }.items():
        trainer = Trainer(tiny_config(corpus, tmp_path / name, train={"max_steps": 3}, checkpoint={"save": False}, precision=precision))
        gemms = {type(m.gemm) for m in trainer.model.modules() if isinstance(m, GroupedExperts)}
        runs[name] = (trainer.fit().losses, gemms, len(trainer.opt.released))
    assert runs["fp8-kept-bf16"][1:] == runs["bf16"][1:] == ({GroupedMM}, 0)
    assert runs["fp8-kept-bf16"][0] == runs["bf16"][0]
    assert runs["fp8"][1] == {Fp8GroupedGemm} and runs["fp8"][2] > 0
