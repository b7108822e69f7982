"""In-loop evaluation (``train.eval_every``, moe.config.in_loop_eval): validation loss and
downstream tasks on the training processes, every N steps, logged with that step.

The tasks come tokenised, in a requests file (moe.eval.requests: the pipeline writes the run's
into its run directory at launch, `moe tasks --export` writes one for ``python -m moe.train``),
read by every rank; nothing is tokenised here.

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
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from moe.config import ExperimentConfig
from moe.config.in_loop_eval import InLoopEvalConfig
from moe.data import TokenDataset
from moe.errors import ConfigError
from moe.eval.requests import TaskRequests, load_task_requests, truncation
from moe.eval.suite import evaluate_suite, headline
from moe.train.callbacks.callback import Callback


class InLoopEvalCallback(Callback):
    def __init__(
        self,
        cfg: InLoopEvalConfig,
        tasks: Sequence[TaskRequests],
        val_batches: Sequence[torch.Tensor],
        *,
        max_len: int,
        pad_id: int = 0,
        final_step: int | None = None,
    ) -> None:
        self.every, self.tasks, self.val_batches = cfg.every, list(tasks), list(val_batches)
        self.final_step = final_step  # evaluated too, so the last checkpoint has its numbers
        self.max_len, self.batch_tokens, self.pad_id = max_len, cfg.batch_tokens, pad_id
        self.eval_s = 0.0
        self.started = time.perf_counter()
        # What the model's window cuts of each task (documents cut, documents left out), counted
        # once: logged beside every evaluation where nonzero, as the evaluate stage logs its own
        # (a cut context moves a score without any error).
        self.cut = {t.name: (truncation(t.requests, max_len)["truncated_docs"], float(len(t.dropped))) for t in self.tasks}

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
            for key, count in zip(("truncated_docs", "dropped_docs"), self.cut[task.name], strict=True):
                if count:
                    metrics[f"eval/{task.name}/{key}"] = count
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


def in_loop_eval_callback(cfg: ExperimentConfig, requests: str | os.PathLike | None, val_dir: str | os.PathLike | None) -> InLoopEvalCallback:
    """The callback of a run whose ``train.eval_every`` is set: its tasks read from ``requests``
    (a tokenised-requests file, checked against the config that asks for them; None: no tasks)
    and its validation batches from the token files in ``val_dir`` (None: no validation loss)."""
    ev = cfg.train.in_loop_eval
    # the data first: a wrong data.tokenizer_hash is then named against the data, as training names it
    val = validation_batches(cfg, val_dir) if val_dir is not None and ev.val_batches else []
    tasks, meta = load_in_loop_requests(cfg, requests) if requests is not None else ([], {})
    return InLoopEvalCallback(ev, tasks, val, max_len=cfg.model.max_seq_len, pad_id=meta.get("pad_id", 0), final_step=cfg.train.max_steps)


def load_in_loop_requests(cfg: ExperimentConfig, path: str | os.PathLike) -> tuple[list[TaskRequests], dict]:
    """(tasks, meta) of a requests file, refused (one error naming the key and the file) where the
    file states a tokenisation other than the config's: another tokenizer, context length,
    task list, sample or truncation."""
    tasks, meta = load_task_requests(path)
    ev = cfg.train.in_loop_eval
    wanted = {
        "data.tokenizer_hash": ("tokenizer_sha256", cfg.data.tokenizer_hash),
        "model.max_seq_len": ("max_len", cfg.model.max_seq_len),
        "train.eval_tasks": ("task_names", ev.tasks),
        "train.eval_limit": ("limit", ev.limit),
        "train.eval_seed": ("seed", ev.seed),
        "train.eval_truncation": ("truncation", ev.truncation),
    }
    for key, (field, value) in wanted.items():
        if field in meta and value is not None and meta[field] != value:
            raise ConfigError(f"{key}: {value!r}, but {path} holds the tasks tokenised with {field} {meta[field]!r}")
    return tasks, meta


def validation_batches(cfg: ExperimentConfig, val_dir: str | os.PathLike) -> list[torch.Tensor]:
    """The first ``train.eval_val_batches`` micro-batches of the validation split, in file order."""
    val = TokenDataset([str(Path(val_dir))], cfg.data.seq_len, tokenizer_hash=cfg.data.tokenizer_hash)
    micro = cfg.train.micro_batch_size
    n = min(len(val), cfg.train.eval_val_batches * micro)
    index = np.arange(n)
    return [val.batch(index[i : i + micro]) for i in range(0, n, micro)]
