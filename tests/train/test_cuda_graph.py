"""train.cuda_graph (moe.train.cuda_graph): the captured step against the eager one.

On a GPU (run on the accelerator machine), in bf16 and in FP8 (every expert GEMM and dense
projection): in the deterministic mode a run whose steps are replayed from one CUDA graph gives
the eager run's losses, weights and later eager forward bitwise, under a schedule
whose learning rate changes every step; a graphed run stopped and resumed from its checkpoint
gives the uninterrupted run's losses bitwise; replays make no host sync. Everywhere: what the
option cannot run with is refused by name."""

import pytest
import torch

from moe.config import ConfigError
from moe.train.trainer import Trainer
from tests.helpers import steps_without_host_sync, tiny_config

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# fp8_rowwise with every expert GEMM and dense projection in FP8: the weight copies, made from
# the masters once per step, are remade inside the replayed graph
FP8 = {"recipe": "fp8_rowwise", "fp8_min_dim": 0, "fp8_dense": True, "fp8_dense_min_dim": 0}


def _config(corpus, ckpt, graph: bool, precision=None, **train):
    return tiny_config(
        corpus,
        ckpt,
        train={"max_steps": 8, "log_every": 1, "device": "cuda", "deterministic": True, "cuda_graph": graph, **train},
        schedule={"warmup_steps": 2, "decay": "cosine"},
        model={"d_model": 128, "n_heads": 4, "moe": {"expert_hidden": 64}},
        precision=precision or {"recipe": "bf16"},
    )


def _weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The weights and fp32 masters (under FP8 the expert weights live only in their masters),
    and the logits of an eager forward after the run: what reads the weights outside the graph
    (evaluation, a checkpoint's model) sees the last replay's."""
    weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    weights |= {f"master:{k}": v.detach().clone() for k, v in trainer.opt.named_masters().items()}
    tokens = torch.arange(64, device=trainer.device).view(2, 32) % 256
    with torch.no_grad(), trainer.recipe.autocast(trainer.device):
        weights["logits"] = trainer.model(tokens).float()
    return weights


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("precision", [None, FP8], ids=["bf16", "fp8"])
def test_graph_replays_give_the_eager_runs_bits(tmp_path, corpus, precision):
    runs = {}
    for graph in (False, True):
        trainer = Trainer(_config(corpus, tmp_path / f"ck{graph}", graph, precision))
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
@pytest.mark.parametrize("precision", [None, FP8], ids=["bf16", "fp8"])
def test_a_graphed_run_resumes_exactly(tmp_path, corpus, precision):
    whole = Trainer(_config(corpus, tmp_path / "whole", True, precision)).fit()
    first = Trainer(_config(corpus, tmp_path / "parts", True, precision)).fit(stop_at=4)
    assert first.steps == 4
    rest = Trainer(_config(corpus, tmp_path / "parts", True, precision)).fit()
    assert rest.start_step == 4
    assert {s: rest.losses[s] for s in range(5, 9)} == {s: whole.losses[s] for s in range(5, 9)}


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("precision", [None, FP8], ids=["bf16", "fp8"])
def test_replays_make_no_host_sync(tmp_path, corpus, precision):
    trainer = Trainer(_config(corpus, tmp_path / "ck", True, precision, deterministic=False))
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
        ({"precision": {"recipe": "mxfp8"}}, "precision.recipe bf16 or fp8_rowwise"),
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
