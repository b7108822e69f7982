"""A suite of tokenised tasks scored on one model: per task, OLMo's metrics with their standard
errors, the number of documents, chance and majority levels, a task of subjects' (MMLU's) mean
over its subjects, how much context the model's window cut (or how many documents were dropped
instead) and the time it took; sharded over data-parallel ranks when asked.

Torch only: the evaluate stage and the trainer's in-loop evaluation (moe.train.callbacks.in_loop_eval) share
it, with the requests built by pipeline.eval from the task data.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from moe.eval.metrics import RANKED, chance, macro_mean, majority, subject_metrics, task_metrics
from moe.eval.requests import TaskRequests, truncation
from moe.eval.scoring import Forward, score_requests


def _gather(scores: dict[int, float], group) -> dict[int, float]:
    """Every rank's scores merged (a collective: eval points only, never the training step)."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1):
        return scores
    parts: list[dict[int, float] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, scores, group=group)
    merged: dict[int, float] = {}
    for p in parts:
        merged.update(p or {})
    return merged


def _equal_calls(device: torch.device, group) -> Callable[[int], int] | None:
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1):
        return None

    def most(n: int) -> int:
        t = torch.tensor([n], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return int(t.item())

    return most


def evaluate_suite(
    forward: Forward,
    tasks: Sequence[TaskRequests],
    *,
    max_len: int,
    device: torch.device,
    batch_tokens: int = 16384,
    pad_id: int = 0,
    shard: int = 0,
    num_shards: int = 1,
    group=None,
    progress: Callable[[str], None] | None = None,
) -> tuple[dict[str, dict[str, float]], dict[str, dict[int, float]]]:
    """(task -> metrics, task -> request index -> summed log-likelihood). Metrics hold the
    primary type's numbers (``primary`` names it) and, for ranked tasks, both acc and len_norm.
    ``progress`` gets one line per finished task: documents/s and the time the rest will take."""
    results: dict[str, dict[str, float]] = {}
    all_scores: dict[str, dict[int, float]] = {}
    began = time.perf_counter()
    for i, t in enumerate(tasks):
        start = time.perf_counter()
        scores = score_requests(
            forward,
            t.requests,
            max_len=max_len,
            device=device,
            batch_tokens=batch_tokens,
            pad_id=pad_id,
            shard=shard,
            num_shards=num_shards,
            equal_calls=_equal_calls(device, group),
        )
        scores = _gather(scores, group)
        metrics = task_metrics(t.requests, scores, t.metric)
        if t.metric in RANKED:
            other = "len_norm" if t.metric == "acc" else "acc"
            extra = task_metrics(t.requests, scores, other)
            metrics.update({k: v for k, v in extra.items() if k.startswith(other)})
            metrics["chance"] = chance(t.requests)
            metrics["majority"] = majority(t.requests)
        if t.subjects:
            metrics.update(subject_means(t, scores))
        metrics["docs_total"] = float(t.docs_total)
        metrics["requests"] = float(len(t.requests))
        metrics.update(truncation(t.requests, max_len))
        metrics["dropped_docs"] = float(len(t.dropped))
        metrics["seconds"] = time.perf_counter() - start
        results[t.name] = metrics
        all_scores[t.name] = scores
        if progress is not None:
            docs, took = len({r.doc_id for r in t.requests}), metrics["seconds"]
            left = len(tasks) - i - 1
            eta = (time.perf_counter() - began) / (i + 1) * left
            progress(f"{t.name}: {docs} documents in {took:.1f} s ({docs / max(took, 1e-9):.0f}/s); {left} tasks left, about {eta:.0f} s")
    return results, all_scores


def subject_means(t: TaskRequests, scores: dict[int, float]) -> dict[str, float]:
    """A task of subjects' primary metric and bpb as means over its subjects (``<key>_macro``,
    with its standard error) and how many subjects were scored, beside the document means."""
    per_subject = subject_metrics(t.requests, scores, t.metric, dict(t.subjects))
    out = {"subjects": float(len(per_subject))}
    for key in dict.fromkeys((f"{t.metric}_v2", "bpb_v2")):
        if not per_subject or not all(key in m for m in per_subject.values()):
            continue  # (a ce_loss task has no bpb)
        out[f"{key}_macro"], out[f"{key}_macro/stderr"] = macro_mean(per_subject, key)
    return out


def headline(metrics: dict[str, float], metric: str) -> dict[str, float]:
    """The few numbers a curve or a table shows: the primary metric, accuracy, bpb (and a task of
    subjects' primary metric over its subjects); each with its standard error beside it
    (``<name>/stderr``, where the metrics carry one)."""
    names = {}
    if metric in RANKED:
        names.update({metric: f"{metric}_v2", "acc": "acc_v2", "len_norm": "len_norm_v2"})
    names["bpb"] = "bpb_v2"
    if "ce_loss_v2" in metrics:
        names["ce_loss"] = "ce_loss_v2"
    if f"{metric}_v2_macro" in metrics:  # a task of subjects: its mean over them too
        names[f"{metric}_macro"] = f"{metric}_v2_macro"
    out = {}
    for short, key in names.items():
        out[short] = metrics[key]
        if f"{key}/stderr" in metrics:
            out[f"{short}/stderr"] = metrics[f"{key}/stderr"]
    return out
