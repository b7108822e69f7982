"""Gradient reduction overlapped with the backward (parallel.overlap_grad_reduce) against the
reduction after it: the same first-step gradients and ten-step losses on real gloo ranks,
with gradient accumulation (reduced only on the last micro-batch), expert groups and ZeRO-1;
and the fused, chunked loss (train.loss_chunk_tokens) through the layouts, pp=2 included."""

from pathlib import Path

import pytest
import torch

from moe.parallel.grad_sync import OverlappedGradSync
from moe.train.trainer import Trainer
from tests.helpers import make_corpus, tiny_config
from tests.parallel.dist_utils import run_ranks
from tests.parallel.layout_runs import first_step_grads

pytestmark = pytest.mark.distributed


def config(corpus, ckpt, parallel, train, steps=10, recipe="auto", optim=None):
    return tiny_config(
        corpus,
        ckpt,
        precision={"recipe": recipe},
        optim=optim or {},
        model={"n_layers": 4, "moe": {"lb_loss_weight": 0.01, "lb_loss_scope": "global_batch", "z_loss_weight": 0.001}},
        parallel=parallel,
        train={"global_batch_size": 8, "max_steps": steps, "log_every": 1, **train},
        schedule={"warmup_steps": 2},
    )


def train_rank(rank, world, corpus, ckpt, parallel, train, bucket_bytes=None, recipe="auto", optim=None):
    if bucket_bytes is not None:  # small buckets: many of them, most reduced during backward
        parallel = {**parallel, "grad_bucket_mb": bucket_bytes / 2**20}
    trainer = Trainer(config(Path(corpus), Path(ckpt), parallel, train, recipe=recipe, optim=optim))
    sync = getattr(trainer.layout, "sync", None)
    overlapped = isinstance(sync, OverlappedGradSync)
    grads = first_step_grads(trainer)
    early = (sync.launched_in_backward, len(sync.buckets)) if overlapped else None
    units = len(sync.units) if overlapped else 0  # forward units whose weight broadcasts overlap (ZeRO-1)
    deferred = len(trainer.opt.deferred)  # expert weights on the bf16 accumulation path
    broadcasts = trainer.layout.broadcasts_expert_weights  # (FP8 recipes then keep the bf16 expert weights)
    return {
        "grads": grads,
        "losses": trainer.fit().losses,
        "overlapped": overlapped,
        "early": early,
        "units": units,
        "deferred": deferred,
        "broadcasts": broadcasts,
    }


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("tokens")
    make_corpus(d, files=2, tokens=6000)
    return d


def _assert_same(results, ref_results):
    for r, ref in zip(results, ref_results, strict=True):
        assert r["grads"].keys() == ref["grads"].keys()
        for k in ref["grads"]:
            torch.testing.assert_close(r["grads"][k], ref["grads"][k], rtol=1e-5, atol=1e-7, msg=lambda m, k=k: f"{k}: {m}")
        for step in ref["losses"]:
            assert r["losses"][step] == pytest.approx(ref["losses"][step], rel=1e-4), step


CASES = [
    # (id, world, parallel, micro batch, precision): micro 2 on dp2 = two accumulated micro-batches
    ("dp2-accum2", 2, {}, 2, "fp32"),
    # bf16 weights: the optimizer's hook fills the fp32 master gradient before ours reads it
    pytest.param("dp2-zero1-bf16-accum2", 2, {"shard_optimizer": True}, 2, "bf16", marks=pytest.mark.slow),
    pytest.param("dp4-ep2-zero1", 4, {"ep": 2, "shard_optimizer": True}, 2, "fp32", marks=pytest.mark.slow),
    # gradients travel in bf16: each element is cast, summed and cast back the same way in
    # whichever bucket it sits, so overlapped and after-backward agree exactly
    ("dp2-bf16-reduce-accum2", 2, {"grad_reduce_dtype": "bf16"}, 2, "bf16"),
]


@pytest.mark.parametrize(
    "name, world, parallel, micro, recipe", CASES, ids=["dp2-accum2", "dp2-zero1-bf16-accum2", "dp4-ep2-zero1", "dp2-bf16-reduce-accum2"]
)
def test_overlapped_reduction_matches_reduction_after_backward(tmp_path, corpus, name, world, parallel, micro, recipe):
    train = {"micro_batch_size": micro}
    ref = run_ranks(train_rank, world, str(corpus), str(tmp_path / "ref"), parallel, train, None, recipe)
    got = run_ranks(train_rank, world, str(corpus), str(tmp_path / "ovl"), {**parallel, "overlap_grad_reduce": True}, train, 64 * 1024, recipe)
    assert all(r["overlapped"] for r in got) and not any(r["overlapped"] for r in ref)
    for r in got:  # the reduction did start inside the backward
        early, total = r["early"]
        assert total > 2 and early >= 1, r["early"]
        # ZeRO-1: the weight broadcasts go by forward unit (embedding, 4 blocks, norm + head)
        assert r["units"] == (6 if parallel.get("shard_optimizer") else 0), r["units"]
        # expert weights go owner -> group under ZeRO-1 over two ranks (dp2; dp4-ep2: groups of 2)
        assert r["broadcasts"] == bool(parallel.get("shard_optimizer")), r
    _assert_same(got, ref)


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [{}, {"shard_optimizer": True}], ids=["dp2", "dp2-zero1"])
def test_bf16_expert_accumulation_is_folded_before_the_overlapped_reduction(tmp_path, corpus, parallel):
    """optim.expert_grad_accum bf16, two micro-batches per rank: buckets launched inside the last
    backward find the expert gradients already in their fp32 holders, so overlapped and
    after-backward reduction give the same gradients and losses."""
    train, optim = {"micro_batch_size": 2}, {"expert_grad_accum": "bf16"}
    ref = run_ranks(train_rank, 2, str(corpus), str(tmp_path / "ref"), parallel, train, None, "bf16", optim)
    got = run_ranks(train_rank, 2, str(corpus), str(tmp_path / "ovl"), {**parallel, "overlap_grad_reduce": True}, train, 64 * 1024, "bf16", optim)
    assert all(r["overlapped"] for r in got) and all(r["deferred"] == 8 for r in got + ref), [r["deferred"] for r in got]  # 4 layers x 2
    assert all(r["early"][1] > 2 and r["early"][0] >= 1 for r in got), [r["early"] for r in got]
    _assert_same(got, ref)


@pytest.mark.slow
def test_bf16_expert_accumulation_under_a_pipeline_schedule_is_folded_at_the_sync(tmp_path, corpus):
    """pp=2 runs its micro-batches inside the schedule (no last-micro-batch signal): the deferred
    bf16 sums reach the fp32 holders at the gradient sync, within bf16 rounding of fp32 accumulation."""
    parallel, train = {"pp": 2}, {"micro_batch_size": 2}
    fp32 = run_ranks(train_rank, 2, str(corpus), str(tmp_path / "fp32"), parallel, train, None, "bf16")
    bf16 = run_ranks(train_rank, 2, str(corpus), str(tmp_path / "bf16"), parallel, train, None, "bf16", {"expert_grad_accum": "bf16"})
    assert all(r["deferred"] > 0 for r in bf16) and all(r["deferred"] == 0 for r in fp32)
    checked = 0
    for r, f in zip(bf16, fp32, strict=True):
        for k, g in f["grads"].items():
            err = (r["grads"][k] - g).norm() / g.norm().clamp_min(1e-12)
            assert err <= 2**-7, (k, float(err))
            checked += ".experts." in k
        for step in f["losses"]:
            assert r["losses"][step] == pytest.approx(f["losses"][step], rel=1e-2), step
    assert checked == 64  # every expert (8 weights x 8 experts, both stages) compared


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [{}, {"shard_optimizer": True}], ids=["allreduce", "zero1"])
def test_bf16_reduction_is_the_fp32_one_within_bf16_rounding(tmp_path, corpus, parallel):
    train = {"micro_batch_size": 2}
    ref = run_ranks(train_rank, 2, str(corpus), str(tmp_path / "fp32"), parallel, train, None, "bf16")
    got = run_ranks(train_rank, 2, str(corpus), str(tmp_path / "bf16"), {**parallel, "grad_reduce_dtype": "bf16"}, train, None, "bf16")
    for r, f in zip(got, ref, strict=True):
        for k, g in f["grads"].items():
            # each rank's addend and the sum are rounded to bf16 (8 bits of mantissa); where the
            # addends cancel one element can be far off, the tensor as a whole cannot
            err = (r["grads"][k] - g).norm() / g.norm().clamp_min(1e-12)
            assert err <= 2**-7, (k, float(err))
        if f["grads"]:  # (a rank reports the gradients it owns; without ZeRO rank 0 all of them)
            assert any(not torch.equal(r["grads"][k], f["grads"][k]) for k in f["grads"])  # bf16 did travel
        for step in f["losses"]:
            assert r["losses"][step] == pytest.approx(f["losses"][step], rel=2e-2), step


CHUNKED = [
    (2, {}, 2),
    pytest.param(2, {"pp": 2}, 2, marks=pytest.mark.slow),
    pytest.param(2, {"pp": 2, "pp_schedule": "interleaved_1f1b", "pp_virtual_stages": 2}, 2, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("world, parallel, micro", CHUNKED, ids=["dp2", "pp2-1f1b", "pp2-interleaved"])
def test_chunked_loss_matches_unfused_through_layouts(tmp_path, corpus, world, parallel, micro):
    train = {"micro_batch_size": micro}
    ref = run_ranks(train_rank, world, str(corpus), str(tmp_path / "ref"), parallel, train)
    got = run_ranks(train_rank, world, str(corpus), str(tmp_path / "chunk"), parallel, {**train, "loss_chunk_tokens": 24})
    _assert_same(got, ref)


def test_a_lone_contiguous_gradient_is_reduced_in_place():
    from moe.parallel.grad_sync import _copy_back, _flat

    g = torch.randn(4, 3)
    flat = _flat([g])
    assert flat.data_ptr() == g.data_ptr()  # no copy out
    flat.mul_(2)  # what the collective does to it
    before = g.clone()
    _copy_back([g], flat)  # and none back
    assert torch.equal(g, before)
    t = torch.randn(3, 4).t()  # not contiguous: packed, then copied back
    pair = [torch.randn(5), torch.randn(2, 2)]
    for bucket in ([t], pair):
        flat = _flat(bucket)
        assert all(flat.data_ptr() != b.data_ptr() for b in bucket)
        flat.fill_(7.0)
        _copy_back(bucket, flat)
        assert all(torch.equal(b, torch.full_like(b, 7.0)) for b in bucket)


def test_a_bucket_is_cast_into_the_reduction_dtype_and_back():
    from moe.parallel.grad_sync import _copy_back, _flat

    bucket = [torch.randn(3, 4).t(), torch.randn(5)]  # fp32 gradients, one not contiguous
    flat = _flat(bucket, torch.bfloat16)
    assert flat.dtype == torch.bfloat16 and flat.numel() == 17
    assert torch.equal(flat[:12].view(4, 3), bucket[0].bfloat16()) and torch.equal(flat[12:], bucket[1].bfloat16())
    flat.div_(2)
    expect = [(b.bfloat16() / 2).float() for b in bucket]
    _copy_back(bucket, flat)
    assert all(b.dtype == torch.float32 and torch.equal(b, e) for b, e in zip(bucket, expect, strict=True))


def fp8_rank(rank, world, corpus, ckpt, parallel):
    cfg = tiny_config(
        Path(corpus),
        Path(ckpt),
        precision={"recipe": "fp8_rowwise", "emulate": True, "fp8_min_dim": 0},
        model={"n_layers": 2},
        parallel=parallel,
        checkpoint={"save": False},
        train={"global_batch_size": 4, "micro_batch_size": 2, "max_steps": 4, "log_every": 1},
    )
    trainer = Trainer(cfg)
    return trainer.fit().losses


@pytest.mark.slow
def test_zero1_receivers_refresh_their_fp8_weight_copies(tmp_path, corpus):
    """A ZeRO-1 receiver gets new weights by broadcast (through .data, or written by the
    collective): the FP8 weight cache, keyed on the parameter's version, must see them, or
    every later step computes with the first step's FP8 weights."""
    ref = run_ranks(fp8_rank, 2, str(corpus), str(tmp_path / "ddp"), {})
    for parallel in ({"shard_optimizer": True}, {"shard_optimizer": True, "overlap_grad_reduce": True}):
        got = run_ranks(fp8_rank, 2, str(corpus), str(tmp_path / str(len(parallel))), parallel)
        for r, f in zip(got, ref, strict=True):
            assert r == f, parallel
