"""train.cuda_graph (moe.train.cuda_graph): the captured step against the eager one.

On a GPU (run on the accelerator machine): in the deterministic mode a run whose steps are
replayed from one CUDA graph gives the eager run's losses, weights and later eager forward
bitwise, under a schedule whose learning rate changes every step; a graphed run stopped and
resumed from its checkpoint gives the uninterrupted run's losses bitwise. In FP8 (every expert
GEMM and dense projection; no deterministic mode) the graphed run follows the eager one within
run-to-run noise and each replay quantises that step's weights. Replays make no host sync. Everywhere: what the
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


def _runs(corpus, tmp_path, precision, **train):
    runs = {}
    for graph in (False, True):
        trainer = Trainer(_config(corpus, tmp_path / f"ck{graph}", graph, precision, **train))
        summary = trainer.fit()
        runs[graph] = (summary.losses, _weights(trainer), trainer.captured)
    (eager, eager_w, _), (graphed, graphed_w, captured) = runs[False], runs[True]
    assert captured is not None and captured.graph is not None, "the run's later steps were replayed"
    assert len(set(eager.values())) == len(eager) == 8
    return eager, eager_w, graphed, graphed_w


@cuda
@pytest.mark.cuda
def test_graph_replays_give_the_eager_runs_bits(tmp_path, corpus):
    eager, eager_w, graphed, graphed_w = _runs(corpus, tmp_path, None)
    assert graphed == eager
    for name, value in eager_w.items():
        assert torch.equal(graphed_w[name], value), name


@cuda
@pytest.mark.cuda
def test_fp8_graph_replays_follow_the_eager_run(tmp_path, corpus):
    """FP8 has no deterministic mode (its GEMMs have no deterministic variant): the graphed run
    follows the eager one within run-to-run noise, and so does an eager forward after it."""
    eager, eager_w, graphed, graphed_w = _runs(corpus, tmp_path, FP8, deterministic=False)
    for step, loss in eager.items():
        assert abs(graphed[step] - loss) < 1e-2 * loss, (step, graphed[step], loss)
    for name, value in eager_w.items():
        if value.is_floating_point() and value.numel() > 1:
            assert (graphed_w[name] - value).float().norm() <= 2e-2 * value.float().norm() + 1e-6, name


@cuda
@pytest.mark.cuda
def test_fp8_replays_remake_the_weight_copies_every_step(tmp_path, corpus):
    """Inside a replay the FP8 expert copies are made from that step's masters (the graph
    captured their quantisation, not a copy kept from the capture)."""
    from moe.kernels.fp8 import quantize_rows
    from moe.layers.gemm_fp8 import Fp8GroupedGemm

    trainer = Trainer(_config(corpus, tmp_path / "ck", True, FP8, deterministic=False))
    for _ in range(4):  # two eager steps, the capture, a replay
        trainer.train_step()
        trainer.step += 1
    caches = [g.cache for m in trainer.model.modules() if isinstance(g := getattr(m, "gemm", None), Fp8GroupedGemm)]
    before = {id(src): src.to(torch.bfloat16) for c in caches for src in c._sources.values()}
    trainer.train_step()  # a replay: the copies of the weights it started from, then the update
    torch.cuda.synchronize()
    checked = 0
    for cache in caches:
        for ident, (_, q, scale) in cache._rows.items():
            weights = before[id(cache._sources[ident])]
            want_q, want_s = quantize_rows(weights.reshape(-1, weights.shape[-1]))
            assert torch.equal(q.reshape(-1, q.shape[-1]).view(torch.uint8), want_q.view(torch.uint8))
            assert torch.equal(scale.reshape(-1), want_s.reshape(-1))
            checked += 1
    assert checked, "the expert GEMMs ran in FP8"


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
