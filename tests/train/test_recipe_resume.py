"""Checkpoints do not depend on the precision recipe: a run saved under fp8_rowwise resumes
under bf16 and the reverse (FP8 emulated on CPU, every expert GEMM in FP8)."""

import pytest
import torch

from moe.train.trainer import Trainer
from tests.helpers import tiny_config

FP8 = {"emulate": True, "fp8_min_dim": 0}


def cfg(corpus, directory, recipe):
    return tiny_config(corpus, directory, train={"max_steps": 4}, precision={"recipe": recipe, **(FP8 if recipe != "bf16" else {})})


def masters(trainer):
    return {p.name: p.master.detach().clone() for p in trainer.opt.params}


def weights_in_use(trainer):
    """The model's bf16 weights; for FP8 expert weights (whose bf16 values the optimizer dropped:
    their copies are made from the masters) the master rounded to bf16."""
    released = {p.name: p.master for p in trainer.opt.params if id(p.param) in trainer.opt.released}
    return {n: released[n].to(p.dtype) if n in released else p.detach().clone() for n, p in trainer.model.named_parameters()}


@pytest.mark.slow  # bf16 grouped GEMMs are slow on CPU (~0.1 s each)
@pytest.mark.parametrize("first,second", [("fp8_rowwise", "bf16"), ("bf16", "fp8_rowwise")])
def test_a_checkpoint_resumes_under_another_recipe(tmp_path, corpus, first, second):
    a = Trainer(cfg(corpus, tmp_path / "a", first))
    a.fit(stop_at=2)
    saved, weights = masters(a), weights_in_use(a)
    # the reference continuation: the first recipe, from the same checkpoint
    reference = Trainer(cfg(corpus, tmp_path / "ref", first))
    reference.load_checkpoint(a.last_checkpoint)

    b = Trainer(cfg(corpus, tmp_path / "b", second))
    assert b.recipe.name == second
    b.load_checkpoint(a.last_checkpoint)
    assert b.start_step == 2
    loaded = masters(b)
    assert saved.keys() == loaded.keys()
    assert all(torch.equal(saved[n], loaded[n]) for n in saved), "fp32 master weights changed across recipes"
    assert weights.keys() == weights_in_use(b).keys()
    assert all(torch.equal(weights[n], w) for n, w in weights_in_use(b).items())
    assert bool(a.opt.released) == (first == "fp8_rowwise") and bool(b.opt.released) == (second == "fp8_rowwise")

    got, ref = b.fit(), reference.fit()
    assert got.start_step == ref.start_step == 2
    # the same training, up to FP8-vs-bf16 arithmetic
    for step in (3, 4):
        assert abs(got.losses[step] - ref.losses[step]) < 0.02 * ref.losses[step], (step, got.losses[step], ref.losses[step])
