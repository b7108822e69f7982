"""Every parallel layout against a single-process run: one step's gradients, ten steps' losses,
optimizer-shard partitioning, and checkpoints moved between layouts.

Tolerances (fp32, gloo on CPU): gradients 1e-5 relative; losses after ten AdamW steps 1e-4
relative (the reduction order differs between layouts and Adam carries it forward)."""

from pathlib import Path

import pytest
import torch

from moe.config import ConfigError
from moe.train.trainer import Trainer
from tests.helpers import make_corpus
from tests.parallel.dist_utils import run_ranks
from tests.parallel.layout_runs import GLOBAL_BATCH, config, first_step_grads, reference, train_rank  # noqa: F401

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("tokens")
    make_corpus(d, files=2, tokens=6000)
    return d


LAYOUTS = [
    # (id, world, parallel section, micro batch, lb weight)
    ("dp2", 2, {}, 4, 0.01),
    ("dp2-ep2", 2, {"ep": 2}, 4, 0.01),
    ("dp2-zero1", 2, {"shard_optimizer": True}, 4, 0.01),
    ("dp4-ep2-zero1", 4, {"ep": 2, "shard_optimizer": True}, 2, 0.01),
    ("pp2-1f1b", 2, {"pp": 2}, 4, 0.01),
    ("pp2-gpipe", 2, {"pp": 2, "pp_schedule": "gpipe"}, 2, 0.01),
    ("pp2-interleaved", 2, {"pp": 2, "pp_schedule": "interleaved_1f1b", "pp_virtual_stages": 2}, 2, 0.01),
    ("pp2-dp2-ep2", 4, {"pp": 2, "ep": 2}, 2, 0.0),
    ("fsdp2", 2, {"data_parallel": "fsdp"}, 4, 0.01),
]


@pytest.mark.parametrize("name, world, parallel, micro, lb", LAYOUTS, ids=[layout[0] for layout in LAYOUTS])
def test_layout_matches_single_process(tmp_path, corpus, name, world, parallel, micro, lb):
    # the reference processes the same micro-batch sequence: dp ranks' micro-batches united
    dp = world // parallel.get("pp", 1)
    ref_grads, ref_losses = reference(tmp_path, corpus, micro * dp if dp > 1 else micro, lb)
    results = run_ranks(train_rank, world, str(corpus), str(tmp_path / "run"), parallel, micro, 10, lb, None)
    got = {}
    for r in results:
        for k, g in r["grads"].items():
            assert k not in got, f"{k} counted twice"
            got[k] = g
    assert got.keys() == ref_grads.keys()
    for k in ref_grads:
        torch.testing.assert_close(got[k], ref_grads[k], rtol=1e-5, atol=1e-7, msg=lambda m, k=k: f"{k}: {m}")
    losses = results[0]["losses"]
    assert losses.keys() == ref_losses.keys()
    for step in ref_losses:
        assert losses[step] == pytest.approx(ref_losses[step], rel=1e-4), step


def test_zero1_optimizer_shards_partition_the_parameters(tmp_path, corpus):
    results = run_ranks(train_rank, 4, str(corpus), str(tmp_path / "z"), {"ep": 2, "shard_optimizer": True}, 2, 2, 0.01, None)
    # dense parameters: partitioned over all four dp ranks
    dense = [set(n for n in r["owned"] if ".experts." not in n) for r in results]
    everything = set(n for n in results[0]["names"] if ".experts." not in n)
    assert set().union(*dense) == everything and sum(map(len, dense)) == len(everything)
    # expert slices: ranks 0 and 2 hold the same experts (ep index 0) and split their ownership
    for a, b in ((0, 2), (1, 3)):
        ea = set(n for n in results[a]["owned"] if ".experts." in n)
        eb = set(n for n in results[b]["owned"] if ".experts." in n)
        assert not ea & eb and ea | eb == set(n for n in results[a]["names"] if ".experts." in n)


MOVES = [
    ("pp2-ep2 -> single", {"pp": 2, "ep": 2}, 4, {}, 1),
    ("single -> pp2-dp2-ep2-zero1", {}, 1, {"pp": 2, "ep": 2, "shard_optimizer": True}, 4),
    ("dp2-zero1 -> ep2", {"shard_optimizer": True}, 2, {"ep": 2}, 2),
    # the weight broadcasts overlap the next forward: the checkpoint waits for them first
    ("dp2-zero1-overlapped -> single", {"shard_optimizer": True, "overlap_grad_reduce": True}, 2, {}, 1),
    # FSDP's DTensor shards are staged in host memory as DTensors (an asynchronous save)
    ("fsdp2 -> single", {"data_parallel": "fsdp"}, 2, {}, 1),
]


@pytest.mark.parametrize("label, first, first_world, second, second_world", MOVES, ids=[m[0] for m in MOVES])
def test_checkpoint_moves_between_layouts(tmp_path, corpus, label, first, first_world, second, second_world):
    _, ref_losses = reference(tmp_path, corpus, 2, 0.0)
    ck = tmp_path / "moved"
    if first_world == 1:
        trainer = Trainer(config(corpus, ck, first, 2, 10, 0.0))
        trainer.fit(stop_at=5)
    else:
        run_ranks(stop_rank, first_world, str(corpus), str(ck), first, 2, 0.0)
    if second_world == 1:
        resumed = Trainer(config(corpus, ck, second, 2, 10, 0.0)).fit()
        losses, start = resumed.losses, resumed.start_step
    else:
        r = run_ranks(resume_rank, second_world, str(corpus), str(ck), second, 2, 0.0)[0]
        losses, start = r["losses"], r["start"]
    assert start == 5
    for step in range(6, 11):
        assert losses[step] == pytest.approx(ref_losses[step], rel=1e-4), step


def stop_rank(rank, world, corpus, ckpt, parallel, micro, lb):
    Trainer(config(Path(corpus), Path(ckpt), parallel, micro, 10, lb)).fit(stop_at=5)


def resume_rank(rank, world, corpus, ckpt, parallel, micro, lb):
    s = Trainer(config(Path(corpus), Path(ckpt), parallel, micro, 10, lb)).fit()
    return {"losses": s.losses, "start": s.start_step}


@pytest.mark.parametrize(
    "parallel, world, message",
    [
        ({"pp": 3}, 3, "parallel.pp: model.n_layers=4 is not divisible by parallel.pp=3"),
        ({"ep": 3}, 3, "parallel.ep: model.moe.num_experts=8 is not divisible by parallel.ep=3"),
        ({"ep": 4}, 2, "parallel.ep: data-parallel size 2 (world 2 / pp 1) is not divisible by ep=4"),
        ({"dp": 3}, 2, "parallel.dp: 3 does not match world size 2 / pp=1 = 2"),
        ({"pp": 2, "pp_schedule": "interleaved_1f1b", "pp_virtual_stages": 3}, 2, "parallel.pp_virtual_stages: model.n_layers=4 is not divisible"),
        ({"data_parallel": "fsdp", "ep": 2}, 2, "parallel.data_parallel: fsdp is the baseline layout"),
        ({"data_parallel": "fsdp", "grad_reduce_dtype": "bf16"}, 2, "parallel.grad_reduce_dtype: fsdp reduces its fp32 shards"),
        ({"grad_reduce_dtype": "fp16"}, 2, "parallel.grad_reduce_dtype"),
    ],
)
def test_invalid_layouts_fail_clearly(tmp_path, corpus, parallel, world, message):
    with pytest.raises(ConfigError) as info:
        cfg = config(corpus, tmp_path / "x", parallel, 2)
        cfg.resolve(world)
    assert message in str(info.value)


def reload_rank(rank, world, corpus, ckpt, parallel, micro, lb):
    trainer = Trainer(config(Path(corpus), Path(ckpt), parallel, micro, 10, lb))
    trainer.fit(stop_at=5)  # checkpoint at step 5
    saved = trainer.last_checkpoint
    for _ in range(2):  # two more steps: the last one's weight broadcasts are still in flight
        trainer.train_step()
        trainer.step += 1
    trainer.load_checkpoint(saved)  # must not be overwritten by them
    s = trainer.fit()
    return {"losses": s.losses}


def test_loading_a_checkpoint_waits_for_weight_broadcasts_in_flight(tmp_path, corpus):
    """Overlapped ZeRO-1 leaves the last step's broadcasts to the next forward; a checkpoint
    loaded before that forward must not be overwritten when they land."""
    _, ref_losses = reference(tmp_path, corpus, 4, 0.0)
    parallel = {"shard_optimizer": True, "overlap_grad_reduce": True}
    losses = run_ranks(reload_rank, 2, str(corpus), str(tmp_path / "reload"), parallel, 2, 0.0)[0]["losses"]
    for step in range(6, 11):
        assert losses[step] == pytest.approx(ref_losses[step], rel=1e-4), step
