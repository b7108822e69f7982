"""Activation recompute against no recompute: bitwise-equal losses and gradients (CPU, fp32),
for every mode, on one process and composed with pp=2, ep=2 + ZeRO-1 and FSDP2 (gloo)."""

from pathlib import Path

import pytest
import torch

from moe.config import ConfigError
from moe.parallel.recompute import RECOMPUTE_MODES, apply_recompute
from moe.train.trainer import Trainer
from tests.helpers import tiny_config
from tests.parallel.dist_utils import run_ranks

MODES = [m for m in RECOMPUTE_MODES if m != "none"]


def config(corpus, ckpt, mode, parallel=None, moe=None, micro=2):
    return tiny_config(
        corpus,
        ckpt,
        model={"n_layers": 4, "moe": {"lb_loss_weight": 0.01, "z_loss_weight": 0.001, **(moe or {})}},
        parallel=parallel or {},
        train={"global_batch_size": 4, "micro_batch_size": micro, "max_steps": 2, "log_every": 1, "recompute": mode},
        schedule={"warmup_steps": 1},
    )


def step_grads_and_losses(trainer: Trainer) -> tuple[dict[str, torch.Tensor], dict[int, float], dict[str, torch.Tensor]]:
    """This rank's gradients after one forward/backward (before any sync), then two optimizer steps' losses."""
    micro = trainer.loader.next_batch()
    trainer.loader.load_state_dict({"epoch": 0, "batch_in_epoch": 0})
    trainer.model.train()
    trainer.layout.forward_backward(trainer.model, micro, lambda: trainer.recipe.autocast(trainer.device))
    grads = {}
    for p in trainer.opt.params:
        g = p.grad
        if g is not None:
            grads[p.name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).clone()
    trainer.opt.zero_grad()
    buffers = {n: b.clone() for n, b in trainer.model.named_buffers() if "pending_load" in n or "expert_bias" in n}
    for n, b in trainer.model.named_buffers():
        if "pending_load" in n:
            b.zero_()
    losses = {}
    for step in range(2):  # whole optimizer steps (no checkpoint I/O)
        trainer.train_step()
        losses[step] = float(trainer._pending.pop()[1])
    buffers.update({f"final.{n}": b.clone() for n, b in trainer.model.named_buffers() if "expert_bias" in n})
    return grads, losses, buffers


def assert_same(ref, got, label):
    ref_grads, ref_losses, ref_buf = ref
    grads, losses, buf = got
    assert grads.keys() == ref_grads.keys(), label
    for k in ref_grads:
        assert torch.equal(grads[k], ref_grads[k]), f"{label}: gradient of {k} differs"
    assert losses == ref_losses, label
    for k in ref_buf:
        assert torch.equal(buf[k], ref_buf[k]), f"{label}: {k} differs"


@pytest.mark.parametrize(
    "moe",
    [{}, {"routing": "random"}, {"bias_update_rate": 0.01, "num_shared_experts": 1}],
    ids=["learned", "random-routing", "bias-balancing-shared"],
)
def test_every_mode_is_bitwise_equal_to_no_recompute(tmp_path, corpus, moe):
    ref = step_grads_and_losses(Trainer(config(corpus, tmp_path / "none", "none", moe=moe)))
    for mode in MODES:
        torch.manual_seed(0)
        got = step_grads_and_losses(Trainer(config(corpus, tmp_path / mode, mode, moe=moe)))
        assert_same(ref, got, mode)


def test_recompute_really_recomputes(tmp_path, corpus):
    """Autograd keeps only the blocks' inputs (and the head) outside the checkpointed regions;
    how much each mode keeps inside them is measured on the GPU (bench/memory.py)."""
    kept = {}
    for mode in RECOMPUTE_MODES:
        torch.manual_seed(0)
        trainer = Trainer(config(corpus, tmp_path / mode, mode))
        batch = trainer.loader.next_batch()[0]
        storages: dict[int, int] = {}

        def pack(t, storages=storages):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            trainer.model.train()
            trainer.model(batch[:, :-1])
        kept[mode] = sum(storages.values())
    assert all(kept[m] < kept["none"] / 10 for m in MODES), kept


def test_modes_switch_in_place_and_unknown_mode_fails(tmp_path, corpus):
    trainer = Trainer(config(corpus, tmp_path / "a", "full"))
    block = trainer.model.layers["0"]
    assert "forward" in block.__dict__
    apply_recompute(trainer.model, "none")
    assert "forward" not in block.__dict__
    with pytest.raises(ValueError, match="train.recompute: unknown mode 'some'"):
        apply_recompute(trainer.model, "some")
    with pytest.raises(ConfigError, match="train.recompute"):
        config(corpus, tmp_path / "b", "some")


def rank_modes(rank, world, corpus, ckpt, parallel, moe, micro):
    out = {}
    for mode in RECOMPUTE_MODES:
        torch.manual_seed(0)
        trainer = Trainer(config(Path(corpus), Path(ckpt) / mode, mode, parallel, moe, micro))
        out[mode] = step_grads_and_losses(trainer)
    return out


DIST = [
    ("pp2-1f1b", {"pp": 2}, {}, 1),
    ("ep2-zero1", {"ep": 2, "shard_optimizer": True}, {"bias_update_rate": 0.01}, 1),
    ("fsdp2", {"data_parallel": "fsdp"}, {}, 1),
]


@pytest.mark.distributed
@pytest.mark.parametrize("name, parallel, moe, micro", DIST, ids=[d[0] for d in DIST])
def test_composes_with_layouts(tmp_path, corpus, name, parallel, moe, micro):
    results = run_ranks(rank_modes, 2, str(corpus), str(tmp_path), parallel, moe, micro)
    for rank, per_mode in enumerate(results):
        for mode in MODES:
            assert_same(per_mode["none"], per_mode[mode], f"{name} rank {rank} {mode}")


@pytest.mark.parametrize("mode", MODES)
def test_fp8_experts_recompute_bitwise_like_no_recompute(tmp_path, corpus, mode):
    """FP8 expert GEMMs (emulated on the CPU) whose bf16 weights are released to their FP8
    copies: under recompute the saved weight comes back as another tensor over the parameter's
    storage, and its copies must still be found (the one-element stand-in was quantised once)."""
    fp8 = {"recipe": "fp8_rowwise", "emulate": True, "fp8_min_dim": 0}
    losses = {}
    for m in ("none", mode):
        cfg = tiny_config(corpus, tmp_path / m, precision=fp8, train={"recompute": m, "max_steps": 3}, checkpoint={"save": False})
        trainer = Trainer(cfg)
        losses[m] = trainer.fit().losses
        cache = next(mod.gemm.cache for mod in trainer.model.modules() if hasattr(getattr(mod, "gemm", None), "cache"))
        assert len(cache._cols) <= 2 * len(cache._sources)  # one copy per weight, none stale per backward
    assert losses[mode] == losses["none"]
