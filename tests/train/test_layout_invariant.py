"""train.layout_invariant on real gloo processes: the same bits at dp = 4, 2 and 1 for DDP,
ZeRO-1 and FSDP over 20 steps, resumes from dp=4 at dp=2 and dp=1, and a control run of the
default mode that differs.

One spawn of four processes runs everything: dp=4 on all of them, then dp=2 on ranks {0, 1}
and dp=1 on rank 0, each in a process group of its own (the previous one destroyed), so the
suite pays for one start of four interpreters."""

import json
import math
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from moe.config import ConfigError
from moe.parallel.spawn import run_ranks
from moe.train.trainer import Trainer
from tests.helpers import TagSink, make_corpus, read_checkpoint, tiny_config

pytestmark = pytest.mark.distributed

STEPS, RESUME_AT = 20, 10
CONTROL_STEPS = 5  # the default mode differs from the first steps on
FLAVOURS = {"ddp": {}, "zero1": {"shard_optimizer": True}, "fsdp": {"data_parallel": "fsdp"}}
CONTROL_LAYOUT: dict = {}  # the control runs DDP
# logged figures that measure the machine, not the trajectory
TIMINGS = ("step_time_s", "tokens_per_s", "tflops", "mfu", "eta_s", "peak_", "mem_at_rest", "checkpoint/")


def config(corpus: Path, ckpt: Path, parallel: dict, invariant: bool = True, steps: int = STEPS, every: int = 0):
    return tiny_config(
        corpus,
        ckpt,
        parallel=parallel,
        train={"global_batch_size": 8, "micro_batch_size": 2, "max_steps": steps, "log_every": 1, "layout_invariant": invariant},
        checkpoint={"every": every, "asynchronous": False},
    )


def train(corpus: Path, ckpt: Path, parallel: dict, invariant: bool = True, resume_from: Path | None = None, **kw) -> dict:
    """One run; on the logging rank its per-step figures (timings dropped). The final step's
    checkpoint holds its weights and optimizer state."""
    sink = TagSink()
    trainer = Trainer(config(corpus, ckpt, parallel, invariant, **kw), sinks=[sink])
    if resume_from is not None:
        trainer.load_checkpoint(resume_from)
    trainer.fit()
    return {str(step): {k: v for k, v in row.items() if not k.startswith(TIMINGS)} for step, row in sink.rows}


def phase(root: Path, corpus: Path, dp: int) -> dict:
    """Every flavour at this data-parallel size (resumed from dp=4's step 10 below dp=4)."""
    out = {}
    for name, parallel in FLAVOURS.items():
        out[f"{name}/{dp}"] = train(corpus, root / f"{name}-{dp}", parallel, every=RESUME_AT if dp == 4 else 0)
        if dp < 4:
            source = root / f"{name}-4" / f"step_{RESUME_AT:08d}"
            out[f"{name}/4->{dp}"] = train(corpus, root / f"{name}-4to{dp}", parallel, resume_from=source)
    if dp in (4, 1):
        out[f"control/{dp}"] = train(corpus, root / f"control-{dp}", CONTROL_LAYOUT, invariant=False, steps=CONTROL_STEPS)
    return out


def ranks(rank: int, world: int, root: str, corpus: str) -> None:
    torch.set_num_threads(1)
    root, corpus = Path(root), Path(corpus)
    out = {}
    dist.init_process_group("gloo")
    out.update(phase(root, corpus, 4))
    dist.destroy_process_group()
    if rank < 2:
        dist.init_process_group("gloo", init_method=f"file://{root}/group-dp2", rank=rank, world_size=2)
        out.update(phase(root, corpus, 2))
        dist.destroy_process_group()
    if rank == 0:
        os.environ.update(WORLD_SIZE="1", RANK="0")
        out.update(phase(root, corpus, 1))
        (root / "figures.json").write_text(json.dumps(out))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("layout-invariant")
    corpus = root / "tokens"
    corpus.mkdir()
    make_corpus(corpus)
    run_ranks(ranks, 4, str(root), str(corpus), timeout=600)
    return root, json.loads((root / "figures.json").read_text())


def final_state(root: Path, run: str) -> dict[str, torch.Tensor]:
    return read_checkpoint(root / run / f"step_{STEPS:08d}")


@pytest.mark.parametrize("flavour", list(FLAVOURS))
def test_every_data_parallel_size_gives_the_same_bits(runs, flavour):
    root, figures = runs
    reference = figures[f"{flavour}/4"]
    assert sorted(map(int, reference)) == list(range(1, STEPS + 1))
    assert {"loss", "grad_norm", "lr", "lb_loss", "z_loss", "expert_load_cv", "expert_load/layer_0/expert_0"} <= set(reference[str(STEPS)])
    for dp in (2, 1):
        assert figures[f"{flavour}/{dp}"] == reference, f"{flavour} at dp={dp}"
    weights = final_state(root, f"{flavour}-4")
    assert any(k.startswith("optim.") for k in weights)
    for dp in (2, 1):
        other = final_state(root, f"{flavour}-{dp}")
        assert other.keys() == weights.keys()
        for key in weights:
            assert torch.equal(other[key], weights[key]), f"{flavour} at dp={dp}: {key}"


@pytest.mark.parametrize("flavour", list(FLAVOURS))
def test_a_dp4_checkpoint_resumes_at_dp2_and_dp1_with_the_same_bits(runs, flavour):
    root, figures = runs
    uninterrupted = figures[f"{flavour}/4"]
    weights = final_state(root, f"{flavour}-4")
    for dp in (2, 1):
        resumed = figures[f"{flavour}/4->{dp}"]
        assert sorted(map(int, resumed)) == list(range(RESUME_AT + 1, STEPS + 1))
        for step, row in resumed.items():
            assert row == uninterrupted[step], f"{flavour} 4 -> {dp}, step {step}"
        other = final_state(root, f"{flavour}-4to{dp}")
        for key in weights:
            assert torch.equal(other[key], weights[key]), f"{flavour} 4 -> {dp}: {key}"


def test_the_default_mode_differs_at_dp4(runs):
    """The control: without the mode the reduction order shows in the losses (so the tests above
    can fail); the two runs stay close."""
    _, figures = runs
    a, b = figures["control/4"], figures["control/1"]
    assert a.keys() == b.keys() and any(a[s] != b[s] for s in a)
    assert all(math.isclose(a[s]["loss"], b[s]["loss"], rel_tol=1e-4) for s in a)


@pytest.mark.parametrize(
    "parallel, model, optim, message",
    [
        ({"ep": 2}, {}, {}, "train.layout_invariant: not with parallel.ep=2"),
        ({"pp": 2}, {"n_layers": 2}, {}, "train.layout_invariant: not with parallel.pp=2"),
        ({"overlap_grad_reduce": True}, {}, {}, "train.layout_invariant: not with parallel.overlap_grad_reduce"),
        ({"grad_reduce_dtype": "bf16"}, {}, {}, "train.layout_invariant: not with parallel.grad_reduce_dtype=bf16"),
        ({}, {"moe": {"lb_loss_scope": "global_batch"}}, {}, "train.layout_invariant: not with model.moe.lb_loss_scope=global_batch"),
        ({}, {}, {"expert_grad_accum": "bf16"}, "train.layout_invariant: not with optim.expert_grad_accum=bf16"),
        ({}, {}, {"expert_wgrad": "paired"}, "train.layout_invariant: not with optim.expert_wgrad=paired"),
    ],
)
def test_what_the_mode_cannot_make_invariant_is_refused_in_one_line(tmp_path, parallel, model, optim, message):
    with pytest.raises(ConfigError) as info:
        tiny_config(tmp_path, tmp_path / "ck", parallel=parallel, model=model, optim=optim, train={"layout_invariant": True})
    assert str(info.value).startswith(message) and "\n" not in str(info.value)
