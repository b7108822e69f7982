"""Every rank's parameter and optimizer bytes equal those of built models on every rank of
several layouts (gloo), ZeRO-1 sharding included."""

from pathlib import Path

import pytest
import torch

from moe.plan.accounting import param_counts
from moe.plan.ranks import rank_states
from moe.train.trainer import Trainer
from tests.helpers import tiny_config
from tests.parallel.dist_utils import run_ranks


def config(corpus, ckpt, parallel=None, model=None, recipe="bf16", micro=2):
    return tiny_config(
        corpus,
        ckpt,
        model={"n_layers": 4, **(model or {})},
        parallel=parallel or {},
        train={"global_batch_size": 4, "micro_batch_size": micro, "max_steps": 1},
        precision={"recipe": recipe},
        schedule={"warmup_steps": 1},
    )


def built_bytes(trainer: Trainer) -> dict[str, int]:
    """What the built model and optimizer of this rank hold (gradients after one forward/backward)."""
    opt = trainer.opt
    seen, weights = set(), 0
    for p in trainer.model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            weights += p.numel() * p.element_size()
    masters = sum(p.master.numel() * 4 for p in opt.params if p.owned and p.master is not p.param)
    state = opt.named_state()
    optimizer = sum(s["exp_avg"].numel() * 4 + s["exp_avg_sq"].numel() * 4 for s in state.values())
    trainer.model.train()
    trainer.layout.forward_backward(trainer.model, trainer.loader.next_batch(), lambda: trainer.recipe.autocast(trainer.device))
    grads = sum(p.param.numel() * 4 for p in opt.params)  # every parameter's fp32 gradient (zeros where unused)
    assert all(p.grad is None or p.grad.dtype == torch.float32 for p in opt.params)
    return {"weights": weights, "masters": masters, "optimizer": optimizer, "grads": grads}


def planned(state) -> dict[str, int]:
    return {"weights": state.weights, "masters": state.masters, "optimizer": state.optimizer, "grads": state.grads}


MODELS = [
    ("tiny-bf16", {}, "bf16"),
    ("dense-shared-tied-fp32", {"dense_layers": [0], "dense_hidden": 48, "tie_embeddings": True, "moe": {"num_shared_experts": 1}}, "fp32"),
]


@pytest.mark.parametrize("name, model, recipe", MODELS, ids=[m[0] for m in MODELS])
def test_single_process_bytes_equal_the_built_model(tmp_path, corpus, name, model, recipe):
    cfg = config(corpus, tmp_path / "ck", model=model, recipe=recipe)
    (state,) = rank_states(cfg, cfg.resolve(1))
    assert planned(state) == built_bytes(Trainer(cfg))


def rank_bytes(rank, world, corpus, ckpt, parallel, recipe, micro):
    cfg = config(Path(corpus), Path(ckpt), parallel, recipe=recipe, micro=micro)
    return built_bytes(Trainer(cfg))


LAYOUTS = [
    ("ep2-zero1-bf16", {"ep": 2, "shard_optimizer": True}, "bf16", 2),
    ("pp2-fp32", {"pp": 2}, "fp32", 1),
]


@pytest.mark.distributed
@pytest.mark.parametrize("name, parallel, recipe, micro", LAYOUTS, ids=[layout[0] for layout in LAYOUTS])
def test_every_rank_equals_the_built_model(tmp_path, corpus, name, parallel, recipe, micro):
    results = run_ranks(rank_bytes, 2, str(corpus), str(tmp_path / "ck"), parallel, recipe, micro)
    cfg = config(corpus, tmp_path / "ck", parallel, recipe=recipe, micro=micro)
    states = rank_states(cfg, cfg.resolve(2))
    assert [s.rank for s in states] == [0, 1]
    for state, built in zip(states, results, strict=True):
        assert planned(state) == built, state.rank


def test_zero1_shards_masters_and_moments_over_four_ranks(tmp_path, corpus):
    cfg = config(corpus, tmp_path, {"ep": 2, "shard_optimizer": True}, micro=1)
    base = config(corpus, tmp_path, {"ep": 2}, micro=1)
    plain = rank_states(base, base.resolve(4))
    sharded = rank_states(cfg, cfg.resolve(4))
    assert sum(s.optimizer for s in sharded) == 8 * param_counts(cfg.model).total  # every moment exactly once
    assert sum(s.masters for s in sharded) == 4 * param_counts(cfg.model).total
    assert max(s.optimizer for s in sharded) < min(s.optimizer for s in plain)
    assert all(s.weights == p.weights and s.grads == p.grads for s, p in zip(sharded, plain, strict=True))
