"""In-loop evaluation (``train.eval_every``): validation loss and downstream tasks on the
training processes, every N steps, logged with that step.

The work is sharded over the data-parallel ranks (each scores every ``dp``-th batch, with the
same number of forward calls, as expert parallelism and FSDP need), and the scores gathered;
the model runs in eval mode under the run's precision recipe. Metrics: ``eval/val_loss``,
``eval/<task>/<metric>`` (the primary metric, acc and len_norm for ranked tasks, bpb) with
``eval/<task>/<metric>/stderr`` beside each (its standard error over the documents: a
difference between two evaluations smaller than that is noise), and ``eval/seconds`` with
``eval/time_fraction``, the share of the run's wall time spent here.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from moe.eval.requests import TaskRequests
from moe.eval.suite import evaluate_suite, headline
from moe.train.callbacks import Callback


class EvalCallback(Callback):
    def __init__(
        self,
        every: int,
        tasks: Sequence[TaskRequests],
        val_batches: Sequence[torch.Tensor],
        *,
        max_len: int,
        batch_tokens: int = 16384,
        pad_id: int = 0,
        final_step: int | None = None,
    ) -> None:
        self.every, self.tasks, self.val_batches = every, list(tasks), list(val_batches)
        self.final_step = final_step  # evaluated too, so the last checkpoint has its numbers
        self.max_len, self.batch_tokens, self.pad_id = max_len, batch_tokens, pad_id
        self.eval_s = 0.0
        self.started = time.perf_counter()

    def due(self, step: int) -> bool:
        return step % self.every == 0 or step == self.final_step

    def after_step(self, trainer: Any, step: int) -> dict[str, float] | None:
        if not self.due(step):
            return None
        start = time.perf_counter()
        model, device = trainer.model, trainer.device
        group = trainer.layout.mesh.dp_group
        shard, shards = trainer.layout.dp_rank, trainer.layout.dp_size
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad(), trainer.recipe.autocast(device):
                metrics = {"eval/val_loss": self._val_loss(model, device, shard, shards, group)} if self.val_batches else {}
                results, _ = evaluate_suite(
                    lambda ids: model(ids),
                    self.tasks,
                    max_len=self.max_len,
                    device=device,
                    batch_tokens=self.batch_tokens,
                    pad_id=self.pad_id,
                    shard=shard,
                    num_shards=shards,
                    group=group,
                )
        finally:
            model.train(was_training)
        for task in self.tasks:
            for k, v in headline(results[task.name], task.metric).items():
                metrics[f"eval/{task.name}/{k}"] = v
        took = time.perf_counter() - start
        self.eval_s += took
        metrics["eval/seconds"] = took
        metrics["eval/time_fraction"] = self.eval_s / max(1e-9, time.perf_counter() - self.started)
        return metrics

    def _val_loss(self, model, device: torch.device, shard: int, shards: int, group) -> float:
        """Mean token loss over the validation batches (each rank its share, equal calls)."""
        mine = self.val_batches[shard::shards]
        most = math.ceil(len(self.val_batches) / shards)
        total = torch.zeros((), dtype=torch.float64, device=device)
        count = torch.zeros((), dtype=torch.float64, device=device)
        for i in range(most):
            batch = (mine[i] if i < len(mine) else self.val_batches[0]).to(device, non_blocking=True)
            logits = model(batch[:, :-1]).float()
            if i >= len(mine):
                continue  # a padding call: every rank forwards as often as the busiest
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].reshape(-1), reduction="sum")
            total += loss.double()
            count += batch[:, 1:].numel()
        if dist.is_available() and dist.is_initialized() and shards > 1:
            both = torch.stack([total, count])
            dist.all_reduce(both, group=group)
            total, count = both[0], both[1]
        return float(total / count.clamp_min(1))
