"""train.cuda_graph (moe.train.cuda_graph): the captured step against the eager one.

On a GPU (run on the accelerator machine): in the deterministic mode a run whose steps are
replayed from one CUDA graph gives the eager run's losses and weights bitwise, under a schedule
whose learning rate changes every step; a graphed run stopped and resumed from its checkpoint
gives the uninterrupted run's losses bitwise; replays make no host sync. Everywhere: what the
option cannot run with is refused by name."""

import pytest
import torch

from moe.config import ConfigError
from moe.train.trainer import Trainer
from tests.helpers import steps_without_host_sync, tiny_config

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _config(corpus, ckpt, graph: bool, **train):
    return tiny_config(
        corpus,
        ckpt,
        train={"max_steps": 8, "log_every": 1, "device": "cuda", "deterministic": True, "cuda_graph": graph, **train},
        schedule={"warmup_steps": 2, "decay": "cosine"},
        model={"d_model": 128, "n_heads": 4, "moe": {"expert_hidden": 64}},
    )


def _weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


@cuda
@pytest.mark.cuda
def test_graph_replays_give_the_eager_runs_bits(tmp_path, corpus):
    runs = {}
    for graph in (False, True):
        trainer = Trainer(_config(corpus, tmp_path / f"ck{graph}", graph))
        summary = trainer.fit()
        runs[graph] = (summary.losses, _weights(trainer), trainer.captured)
    (eager, eager_w, _), (graphed, graphed_w, captured) = runs[False], runs[True]
    assert captured is not None and captured.graph is not None, "the run's later steps were replayed"
    assert len(set(eager.values())) == len(eager) == 8
    assert graphed == eager
    for name, value in eager_w.items():
        assert torch.equal(graphed_w[name], value), name


@cuda
@pytest.mark.cuda
def test_a_graphed_run_resumes_exactly(tmp_path, corpus):
    whole = Trainer(_config(corpus, tmp_path / "whole", True)).fit()
    first = Trainer(_config(corpus, tmp_path / "parts", True)).fit(stop_at=4)
    assert first.steps == 4
    rest = Trainer(_config(corpus, tmp_path / "parts", True)).fit()
    assert rest.start_step == 4
    assert {s: rest.losses[s] for s in range(5, 9)} == {s: whole.losses[s] for s in range(5, 9)}


@cuda
@pytest.mark.cuda
def test_replays_make_no_host_sync(tmp_path, corpus):
    trainer = Trainer(_config(corpus, tmp_path / "ck", True, deterministic=False))
    for _ in range(3):  # two eager steps, then the capture
        trainer.train_step()
        trainer.step += 1
    steps_without_host_sync(trainer, 3)
    losses = torch.stack([v for _, v in trainer._pending]).tolist()
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"train": {"device": "cpu"}}, "needs a CUDA GPU"),
        ({"precision": {"recipe": "fp8_rowwise"}}, "precision.recipe bf16"),
        ({"train": {"recompute": "selective"}}, "train.recompute=selective"),
        ({"optim": {"step_kernel": "torch"}}, "optim.step_kernel=triton"),
        ({"train": {"layout_invariant": True}}, "layout_invariant"),
        ({"parallel": {"ep": 2}}, "one GPU"),
    ],
)
def test_what_a_captured_step_cannot_run_with_is_refused(tmp_path, corpus, overrides, message):
    sections = {"train": {"cuda_graph": True, "device": "cuda"}}
    for key, value in overrides.items():
        sections.setdefault(key, {}).update(value)
    with pytest.raises(ConfigError, match=f"train.cuda_graph.*{message}"):
        tiny_config(corpus, tmp_path / "ck", **sections)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a GPU")
def test_on_a_machine_without_a_gpu_the_trainer_says_so(tmp_path, corpus):
    cfg = tiny_config(corpus, tmp_path / "ck", train={"cuda_graph": True})  # device auto: the CPU here
    with pytest.raises(ConfigError, match="train.cuda_graph: needs a CUDA GPU; this run's device is cpu"):
        Trainer(cfg)
