"""Pipeline parallelism with torch.distributed.pipelining (GPipe, 1F1B, interleaved 1F1B).

The model is pruned to the layers of this rank's stages (names unchanged, so checkpoints do
not care); each stage is a view over those shared modules. The micro-batches of one optimizer
step go through the pipeline together; the loss of each micro-batch is divided by their
number, so gradients are those of the step's mean loss. MoE auxiliary losses attach their
gradients inside each stage's own backward, so they need nothing from other stages.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from moe.model import Transformer, run_stack
from moe.nn.loss import lm_loss
from moe.parallel.mesh import Mesh


def stage_layers(n_layers: int, n_stages: int, stage: int) -> list[str]:
    per = n_layers // n_stages
    return [str(i) for i in range(stage * per, (stage + 1) * per)]


class StageView(nn.Module):
    """One pipeline stage: a slice of a (pruned) Transformer's modules, shared with it."""

    def __init__(self, model: Transformer, layer_keys: list[str], first: bool, last: bool, head: bool = True) -> None:
        super().__init__()
        self.head = head  # False: the last stage returns normed hidden states for a chunked loss
        self.embed = model.embed if first else None
        self.layers = nn.ModuleDict({k: model.layers[k] for k in layer_keys})
        self.norm = model.norm if last else None
        self.lm_head = model.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return run_stack(self, x, head=self.head)


def stage_indices(mesh: Mesh, virtual: int) -> list[int]:
    return [mesh.stage + v * mesh.pp for v in range(virtual)]


def prune_for_stages(model: Transformer, mesh: Mesh, virtual: int, head: bool = True) -> tuple[Transformer, list[StageView]]:
    """Drop what this rank's stages do not run; return the model and its stage views."""
    n_stages = mesh.pp * virtual
    mine = stage_indices(mesh, virtual)
    keep = [k for s in mine for k in stage_layers(model.cfg.n_layers, n_stages, s)]
    for key in list(model.layers.keys()):
        if key not in keep:
            del model.layers[key]
    first, last = 0 in mine, (n_stages - 1) in mine
    views = [StageView(model, stage_layers(model.cfg.n_layers, n_stages, s), s == 0, s == n_stages - 1, head) for s in mine]
    if not first:
        model.embed = None
    if not last:
        model.norm = None
        model.lm_head = None
    return model, views


class PipelineRunner:
    """Runs one optimizer step's micro-batches through the pipeline schedule."""

    def __init__(
        self,
        views: list[StageView],
        mesh: Mesh,
        schedule: str,
        n_microbatches: int,
        device: torch.device,
        virtual: int,
        chunk: int = 0,
        z_weight: float = 0.0,
        fused: bool = False,
    ) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        self.n_microbatches = n_microbatches
        # chunk > 0: the last stage outputs normed hidden states and the loss applies lm_head
        self.chunk, self.z_weight, self.fused = chunk, z_weight, fused
        self.head_weight = views[-1].lm_head.weight if chunk and views[-1].lm_head is not None else None
        n_stages = mesh.pp * virtual
        self.indices = stage_indices(mesh, virtual)
        self.first, self.last = 0 in self.indices, (n_stages - 1) in self.indices
        stages = [PipelineStage(v, i, n_stages, device, group=mesh.pp_group) for v, i in zip(views, self.indices, strict=True)]
        cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}[schedule]
        kwargs = {"loss_fn": self._loss}
        if "scale_grads" in inspect.signature(cls.__init__).parameters:
            kwargs["scale_grads"] = False  # the loss is divided by n_microbatches instead
        self.schedule = cls(stages if schedule == "interleaved_1f1b" else stages[0], n_microbatches, **kwargs)

    def _loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # with a chunk, "logits" are the last stage's normed hidden states
        # the schedule may hand the last stage's outputs back: the fused loss writes a copy
        return lm_loss(logits, target, self.head_weight, self.chunk, self.z_weight, fused=self.fused) / self.n_microbatches

    def step(self, batch: torch.Tensor, device: torch.device) -> torch.Tensor:
        """batch: [n_microbatches * micro, seq + 1] tokens -> sum of the scaled micro losses
        on the last stage (the step's mean loss), zero elsewhere."""
        inputs, labels = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()  # stages check strides
        losses: list[torch.Tensor] = []
        if self.first and self.last:
            self.schedule.step(inputs, target=labels, losses=losses)
        elif self.first:
            self.schedule.step(inputs)
        elif self.last:
            self.schedule.step(target=labels, losses=losses)
        else:
            self.schedule.step()
        if losses:
            return torch.stack([loss.detach() for loss in losses]).sum()
        return torch.zeros((), device=device)
