"""CUDA-only checks of the training step (skipped without a GPU; run on the H200)."""

import pytest
import torch

from moe.train.trainer import Trainer
from tests.helpers import steps_without_host_sync, tiny_config

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_bf16_training_step_makes_no_host_sync_and_learns(tmp_path, corpus):
    cfg = tiny_config(
        corpus,
        tmp_path / "ck",
        train={"max_steps": 30, "log_every": 30, "device": "cuda"},
        optim={"lr": 3e-3},
        model={"d_model": 128, "n_heads": 4, "moe": {"expert_hidden": 64}},
    )
    trainer = Trainer(cfg)
    assert trainer.recipe.name == "bf16"
    trainer.train_step()  # warm-up: lazy CUDA init and allocator may sync
    trainer.step += 1
    steps_without_host_sync(trainer, 3)
    summary = trainer.fit()
    assert summary.losses[30] < summary.losses[5]
    assert summary.last_metrics["peak_mem_gib"] > 0
    assert "mfu" in summary.last_metrics
