"""Runs shared by the layout suites: a layout's config, its first-step gradients (this
rank's share, by global name) and losses, and the single-process reference."""

from pathlib import Path

import torch

from moe.train.trainer import Trainer
from tests.helpers import tiny_config

GLOBAL_BATCH = 8


def config(corpus, ckpt, parallel, micro, steps=10, lb=0.01):
    return tiny_config(
        corpus,
        ckpt,
        model={"n_layers": 4, "moe": {"lb_loss_weight": lb, "lb_loss_scope": "global_batch", "z_loss_weight": 0.001}},
        parallel=parallel,
        train={"global_batch_size": GLOBAL_BATCH, "micro_batch_size": micro, "max_steps": steps, "log_every": 1},
        schedule={"warmup_steps": 2},
        checkpoint={"every": 5},
    )


def first_step_grads(trainer: Trainer) -> dict[str, torch.Tensor]:
    """This rank's share of the synchronised first-step gradients, by global name/expert row."""
    from moe.layers.experts import expert_param_layout

    layout = trainer.layout
    micro = trainer.loader.next_batch()
    trainer.loader.load_state_dict({"epoch": 0, "batch_in_epoch": 0})
    trainer.model.train()
    layout.forward_backward(trainer.model, micro, lambda: trainer.recipe.autocast(trainer.device))
    layout.sync_gradients(trainer.opt, None)
    experts = expert_param_layout(trainer.model)
    out = {}
    sync = getattr(layout, "sync", None)
    for p in trainer.opt.params:
        if sync is not None:
            spec = sync.specs[sync.kind_of(p.name)]
            mine = sync.owns(p.name, p.param) if sync.zero else spec.my_index == 0
        else:  # FSDP: gather the DTensor on every rank (a collective); rank 0 reports it
            mine = trainer.env.rank == 0
        g = p.grad
        if hasattr(g, "full_tensor"):
            g = g.full_tensor()
        if not mine:
            continue
        if p.name in experts:
            for i in range(g.shape[0]):
                out[f"{p.name}[{experts[p.name][0] + i}]"] = g[i].clone()
        else:
            out[p.name] = g.clone()
    trainer.opt.zero_grad()
    return out


def train_rank(rank, world, corpus, ckpt, parallel, micro, steps, lb, resume_from):
    cfg = config(Path(corpus), Path(ckpt), parallel, micro, steps, lb)
    trainer = Trainer(cfg)
    grads = first_step_grads(trainer) if resume_from is None else {}
    if resume_from is not None:
        trainer.load_checkpoint(resume_from)
    summary = trainer.fit() if resume_from is None else trainer.fit()
    owned = sorted(p.name for p in trainer.opt.params if p.owned)
    return {
        "grads": grads,
        "losses": summary.losses,
        "owned": owned,
        "start": summary.start_step,
        "names": sorted(p.name for p in trainer.opt.params),
    }


def reference(tmp_path, corpus, micro, lb, steps=10):
    trainer = Trainer(config(corpus, tmp_path / "ref", {}, micro, steps, lb))
    grads = first_step_grads(trainer)
    from moe.layers.experts import expert_param_layout

    experts = expert_param_layout(trainer.model)
    expanded = {}
    for name, g in grads.items():
        if name in experts:
            for i in range(g.shape[0]):
                expanded[f"{name}[{i}]"] = g[i]
        else:
            expanded[name] = g
    return expanded, trainer.fit().losses
