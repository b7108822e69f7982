"""The metrics OLMo logs for a ranked-classification task, from summed log-likelihoods.

Per document, with S_c the summed log-probability (natural log) of continuation c:

- acc: 1 when argmax_c S_c is the gold continuation (ties to the lowest index);
- len_norm: the same with S_c divided by the continuation's length in characters (its leading
  space counted);
- ce_loss: -S_gold per character, nats; bpb: -S_gold per UTF-8 byte, in bits (log2 e / byte);
- soft / soft_log: softmax over the document's scores (normalised as its metric type ranks
  them), at the gold continuation.

Each is a mean over documents. ``_v2`` counts the continuation's leading space in the
lengths, ``_v1`` does not (``acc``/``len_norm`` v1 and v2 are the same number, as in
ai2-olmo-eval's ICLMetric, whose definitions these are: tests/eval checks them against it).
A ``bpb`` or ``ce_loss`` task scores the gold continuation only. A document missing any of its
continuations is left out, as ICLMetric does.

Beside every mean, ``<key>/stderr``: how far it would move on another draw of as many
documents. Accuracies (0/1 per document) get the binomial sqrt(p(1 - p) / n); the continuous
per-document values (bpb, ce_loss, soft) the sample standard error std / sqrt(n) (ddof 1).
Either is 0 below two documents (nothing to estimate it from).

Beside a ranked task's accuracy, two baselines: ``chance`` (a uniform guess) and ``majority``
(always the most frequent gold position: a model that always answers BoolQ's "no" scores one
minus it, whatever chance says). A task of subjects (MMLU) also gets its mean over subjects,
each counted once (``macro_mean``), as OLMES reports MMLU; the document mean stays beside it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from moe.eval.requests import Request

LOG2_E = 1.0 / math.log(2.0)
RANKED = ("acc", "len_norm")
METRIC_TYPES = ("acc", "len_norm", "bpb", "ce_loss")


def _documents(requests: Sequence[Request], scores: Mapping[int, float]) -> dict[int, list[tuple[Request, float]]]:
    docs: dict[int, list[tuple[Request, float]]] = {}
    for i, r in enumerate(requests):
        if i in scores:
            docs.setdefault(r.doc_id, []).append((r, scores[i]))
    complete = {}
    for doc_id, items in docs.items():
        ids = sorted(r.cont_id for r, _ in items)
        if ids == list(range(len(ids))):
            complete[doc_id] = sorted(items, key=lambda item: item[0].cont_id)
    return complete


def _rank_scores(items: list[tuple[Request, float]], metric_type: str, no_space: bool) -> torch.Tensor:
    if metric_type == "len_norm":
        return torch.tensor([s / max(1, r.cont_chars_no_space if no_space else r.cont_chars) for r, s in items], dtype=torch.float64)
    return torch.tensor([s for _, s in items], dtype=torch.float64)


def task_metrics(requests: Sequence[Request], scores: Mapping[int, float], metric_type: str) -> dict[str, float]:
    """ICLMetric's numbers for ``metric_type`` (acc, len_norm, bpb, ce_loss), plus ``docs``."""
    if metric_type not in METRIC_TYPES:
        raise ValueError(f"unknown metric type {metric_type!r}")
    docs = _documents(requests, scores)
    out: dict[str, list[float]] = {}

    def add(key: str, value: float) -> None:
        out.setdefault(key, []).append(value)

    for items in docs.values():
        gold_req, gold = next(((r, s) for r, s in items if r.cont_id == r.label), items[0])
        if metric_type in ("bpb", "ce_loss"):
            r, s = items[0]
            if metric_type == "bpb":
                add("bpb_v1", -s / max(1, r.cont_bytes_no_space) * LOG2_E)
                add("bpb_v2", -s / r.cont_bytes * LOG2_E)
            else:
                add("ce_loss_v1", -s / max(1, r.cont_chars_no_space))
                add("ce_loss_v2", -s / r.cont_chars)
            continue
        label = items[0][0].label
        for suffix, no_space in (("v1", True), ("v2", False)):
            ranked = _rank_scores(items, metric_type, no_space)
            add(f"soft_{suffix}", float(torch.softmax(ranked, 0)[label]))
            add(f"soft_log_{suffix}", float(torch.log_softmax(ranked, 0)[label]))
        correct = float(int(torch.argmax(_rank_scores(items, metric_type, False))) == label)
        add(f"{metric_type}_v1", correct)
        add(f"{metric_type}_v2", correct)
        add("ce_loss_v1", -gold / max(1, gold_req.cont_chars_no_space))
        add("ce_loss_v2", -gold / gold_req.cont_chars)
        add("bpb_v1", -gold / max(1, gold_req.cont_bytes_no_space) * LOG2_E)
        add("bpb_v2", -gold / gold_req.cont_bytes * LOG2_E)
    result: dict[str, float] = {}
    for k, v in out.items():
        result[k] = sum(v) / len(v)
        result[f"{k}/stderr"] = stderr(v, binary=k.startswith(RANKED))
    result["docs"] = float(len(docs))
    return result


def stderr(values: Sequence[float], *, binary: bool) -> float:
    """The standard error of the mean of per-document ``values``: binomial for 0/1 outcomes
    (accuracy), the sample standard error otherwise; 0 for fewer than two values."""
    n = len(values)
    if n < 2:
        return 0.0
    mean = sum(values) / n
    if binary:
        return math.sqrt(max(0.0, mean * (1.0 - mean)) / n)
    return math.sqrt(sum((x - mean) ** 2 for x in values) / (n - 1) / n)


def combined_stderr(errors: Sequence[float]) -> float:
    """The standard error of an unweighted mean of independent estimates (a suite's mean over
    its tasks): sqrt(sum se_i^2) / k."""
    return math.sqrt(sum(e * e for e in errors)) / len(errors) if errors else 0.0


def chance(requests: Sequence[Request]) -> float:
    """Expected accuracy of a uniform guess: the mean over documents of 1 / continuations."""
    counts: dict[int, int] = {}
    for r in requests:
        counts[r.doc_id] = counts.get(r.doc_id, 0) + 1
    return sum(1.0 / n for n in counts.values()) / max(1, len(counts))


def majority(requests: Sequence[Request]) -> float:
    """Accuracy of always answering the most frequent gold position (BoolQ's " yes" or " no", a
    letter, an ending's place), over the documents: the best any one fixed answer scores."""
    labels: dict[int, int] = {r.doc_id: r.label for r in requests}
    counts: dict[int, int] = {}
    for label in labels.values():
        counts[label] = counts.get(label, 0) + 1
    return max(counts.values(), default=0) / max(1, len(labels))


def subject_metrics(
    requests: Sequence[Request], scores: Mapping[int, float], metric_type: str, subject_of: Mapping[int, str]
) -> dict[str, dict[str, float]]:
    """task_metrics of each subject's documents (``subject_of``: document -> subject); a subject
    with no scored document is left out."""
    by_subject: dict[str, list[int]] = {}
    for i, r in enumerate(requests):
        by_subject.setdefault(subject_of[r.doc_id], []).append(i)
    out = {}
    for subject, index in sorted(by_subject.items()):
        m = task_metrics([requests[i] for i in index], {j: scores[i] for j, i in enumerate(index) if i in scores}, metric_type)
        if m["docs"]:
            out[subject] = m
    return out


def macro_mean(per_subject: Mapping[str, Mapping[str, float]], key: str) -> tuple[float, float]:
    """(the unweighted mean over subjects of ``key``, its standard error): every subject counts
    once however many documents it has, as OLMES averages MMLU's 57."""
    values = [m[key] for m in per_subject.values()]
    return sum(values) / max(1, len(values)), combined_stderr([m.get(f"{key}/stderr", 0.0) for m in per_subject.values()])
