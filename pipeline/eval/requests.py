"""Tasks -> tokenised requests, with every check made before any model runs: the task names,
the data, the tokenizer's ability to encode the text (no unknown-token fallbacks, no empty
encodings) and the model's context length.

A limit takes a seeded random sample of each task's documents, stratified by the task's own
source/subject field (Doc.group), not the first documents in file order: those are often one
subject or one source (MMLU's rows run subject by subject), so a prefix measures a different
task. Every document is equally likely to be drawn, so a sample's plain mean estimates the
task's without bias. Contexts the model's window would cut are counted, warned about, and
either cut from the left (OLMo's evaluator does) or, with ``truncation="drop"``, left out.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import random
from fractions import Fraction
from pathlib import Path

from moe.eval.requests import Request, TaskRequests, truncation
from pipeline.errors import PipelineError
from pipeline.eval.data import data_root
from pipeline.eval.tasks import Doc, Task, resolve_tasks
from pipeline.tokenizer import TokenizerInfo

log = logging.getLogger("pipeline.eval")
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|bos|>", "<|startoftext|>", "<|beginoftext|>")


def _encoder(info: TokenizerInfo):
    tok = info.build()
    unk = None
    model = tok.get_vocab()
    for name in ("[UNK]", "<unk>", "<|unk|>"):
        if name in model:
            unk = model[name]
    return tok, unk


def bos_id(tok) -> int | None:
    """The tokenizer's beginning-of-sequence token, or None: the special token its post-processor
    puts before the text, else a special token under a BOS name (a vocabulary entry that merely
    spells ``<s>`` does not count)."""
    plain = tok.encode("a", add_special_tokens=False).ids
    full = tok.encode("a", add_special_tokens=True).ids
    if len(full) > len(plain) and full[1 : 1 + len(plain)] == plain:
        return full[0]
    special = {t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    return next((special[name] for name in _BOS_NAMES if name in special), None)


def tokenize_task(task: Task, docs: list[Doc], info: TokenizerInfo, key: str) -> list[Request]:
    """Context and continuation are tokenised separately (OLMo's evaluator), without special
    tokens; the tokenizer's BOS token, where it has one, starts every context (as OLMo's
    evaluator prepends it: a model trained with it expects it first)."""
    tok, unk = _encoder(info)
    bos = bos_id(tok)
    texts: list[str] = []
    for d in docs:
        texts += list(d.contexts) + list(d.continuations)
    unique = list(dict.fromkeys(texts))
    ids = {t: tuple(e.ids) for t, e in zip(unique, tok.encode_batch(unique, add_special_tokens=False), strict=True)}
    requests = []
    for d in docs:
        for cont_id, cont in enumerate(d.continuations):
            ctx_ids, cont_ids = ids[d.context(cont_id)], ids[cont]
            if not ctx_ids or not cont_ids:
                raise PipelineError(f"{key}: task {task.name}, document {d.doc_id}: the tokenizer ({info.sha256[:12]}) encodes its text to nothing")
            if bos is not None and ctx_ids[0] != bos:
                ctx_ids = (bos, *ctx_ids)
            if unk is not None and (unk in ctx_ids or unk in cont_ids):
                raise PipelineError(
                    f"{key}: task {task.name}, document {d.doc_id}: the tokenizer ({info.sha256[:12]}) cannot "
                    "encode its text (it falls back to the unknown token); use a byte-level tokenizer"
                )
            requests.append(
                Request(
                    d.doc_id, cont_id, ctx_ids, cont_ids, d.label, len(cont), len(cont.encode("utf-8")), len(cont) - 1, len(cont[1:].encode("utf-8"))
                )
            )
    return requests


def _rng(seed: int, task: str) -> random.Random:
    """One generator per (seed, task), from sha256: the same sample in every process and run
    (never Python's salted hash), and different tasks not sampled in lockstep."""
    return random.Random(int.from_bytes(hashlib.sha256(f"{seed}/{task}".encode()).digest()[:8], "big"))


def stratum_takes(sizes: dict[str, int], limit: int) -> dict[str, tuple[int, Fraction]]:
    """Each stratum's draw in a ``limit``-document sample of ``sum(sizes)``: (its proportional
    share rounded down, the chance it gets one more), the chance being the share's fraction, so
    its expected draw is exactly its share and every document's chance of being drawn is
    limit / sum(sizes), whatever the strata's sizes (the plain mean of a sample is then an
    unbiased estimate of the task's). Rounding to the largest remainders instead, as this
    once did, gave a stratum whose fraction never comes out on top no document under any seed."""
    total = sum(sizes.values())
    return {g: (limit * n // total, Fraction(limit * n % total, total)) for g, n in sizes.items()}


def _round_systematically(takes: dict[str, tuple[int, Fraction]], order: list[str], rng: random.Random) -> dict[str, int]:
    """The strata's counts: each gets its one more with exactly its chance, and the counts sum to
    the limit (systematic sampling of the fractions laid end to end in ``order``: one random
    start, points a whole unit apart, so a fraction below 1 holds at most one)."""
    denominator = math.lcm(*(p.denominator for _, p in takes.values()))
    start, end, counts = rng.randrange(denominator), 0, {}
    for g in order:
        floor, p = takes[g]
        begin, end = end, end + int(p * denominator)
        # a point start + j * denominator (j = 0, 1, ...) falls in [begin, end)
        counts[g] = floor + int(-((begin - start) // -denominator) * denominator + start < end)
    return counts


def sample_documents(docs: list[Doc], limit: int | None, seed: int, task: str) -> list[Doc]:
    """``limit`` documents drawn at random (all of them: None or more than there are), in file
    order. Stratified by Doc.group, so a sample keeps the task's mix of subjects: each group
    gives its proportional share, rounded down or up at random (stratum_takes), and within a
    group a uniform draw without replacement; every document has the same chance,
    limit / len(docs), of being drawn."""
    if limit is None or limit >= len(docs):
        return docs
    rng = _rng(seed, task)
    strata: dict[str, list[int]] = {}
    for i, d in enumerate(docs):
        strata.setdefault(d.group or "", []).append(i)
    names = sorted(strata)
    rng.shuffle(names)  # the strata in a random order: which of them share a rounding is not fixed
    counts = _round_systematically(stratum_takes({g: len(strata[g]) for g in names}, limit), names, rng)
    chosen: list[int] = []
    for g in sorted(names):
        chosen += rng.sample(strata[g], counts[g])
    return [docs[i] for i in sorted(chosen)]


def prepare_tasks(
    names: list[str],
    info: TokenizerInfo,
    *,
    limit: int | None,
    data_dir: str | None,
    key: str,
    max_len: int,
    seed: int = 0,
    truncation_mode: str = "cut",
    truncation_key: str = "evaluate.truncation",
) -> list[TaskRequests]:
    """Every named task (or suite) built and tokenised; ``limit``: a seeded, stratified sample of
    each (sample_documents). Documents whose context does not fit ``max_len`` get one warning
    line (for all the tasks), and are cut (``truncation_mode="cut"``) or left out (``"drop"``)."""
    if truncation_mode not in ("cut", "drop"):
        raise PipelineError(f"{truncation_key}: must be cut or drop, got {truncation_mode!r}")
    tasks = resolve_tasks(names, key)
    if not tasks:
        return []
    root: Path = data_root(data_dir)
    out, cuts = [], []
    for task in tasks:
        docs = task.build(root)
        if not docs:
            raise PipelineError(f"{key}: task {task.name} has no documents in {root}")
        kept = sample_documents(docs, limit, seed, task.name)
        requests = tokenize_task(task, kept, info, key)
        # A continuation longer than the model's window cannot be scored (only a context can be
        # cut): such documents are left out of this sample, said in one line and recorded.
        unfit = sorted({r.doc_id for r in requests if len(r.cont) > max_len})
        if len(unfit) == len(kept):
            raise PipelineError(
                f"{key}: every sampled document of task {task.name} has a continuation longer than model.max_seq_len={max_len}; "
                "nothing could be scored (a longer context, or another task)"
            )
        if unfit:
            longest = max(len(r.cont) for r in requests if r.doc_id in set(unfit))
            line = "task %s: %d of %d documents have a continuation longer than model.max_seq_len=%d (up to %d tokens): "
            log.warning(line + "left out (a continuation cannot be cut)", task.name, len(unfit), len(kept), max_len, longest)
            requests = [r for r in requests if r.doc_id not in set(unfit)]
        sample = tuple(d.doc_id for d in kept) if len(kept) < len(docs) else None
        subjects = tuple((d.doc_id, d.group) for d in kept if d.group is not None) if task.subject_mean else ()
        task_requests = TaskRequests(task.name, task.metric, tuple(requests), len(docs), sample, tuple(unfit), subjects)
        cut = truncation(requests, max_len)
        if cut["truncated_docs"]:
            cuts.append((task.name, cut, len(kept)))
            task_requests = _drop_cut(task_requests, len(kept), max_len, truncation_mode, truncation_key)
        out.append(task_requests)
    if cuts:
        log.warning("%s", cut_line(cuts, max_len, truncation_mode, truncation_key))
    return out


def cut_line(cuts: list[tuple[str, dict[str, float], int]], max_len: int, mode: str, key: str) -> str:
    """The one warning line for the tasks whose contexts do not fit ((name, truncation(), documents)
    each): the figures of one task, or each task's count of several."""
    what = "those documents are left out" if mode == "drop" else "their context is cut from the left"
    hint = f"{key}=cut cuts them instead" if mode == "drop" else f"{key}=drop leaves them out"
    if len(cuts) == 1:
        name, cut, docs = cuts[0]
        over = f"by up to {cut['truncated_tokens_max']:.0f} tokens ({cut['truncated_tokens_total']:.0f} in all)"
        return (
            f"task {name}: {cut['truncated_docs']:.0f} of {docs} documents ({cut['truncated_requests']:.0f} requests) do not fit "
            f"model.max_seq_len={max_len} {over}: {what}; {hint}"
        )
    each = ", ".join(f"{name} {cut['truncated_docs']:.0f} of {docs}" for name, cut, docs in cuts)
    longest = max(cut["truncated_tokens_max"] for _, cut, _ in cuts)
    return f"{len(cuts)} tasks have documents that do not fit model.max_seq_len={max_len} by up to {longest:.0f} tokens ({each}): {what}; {hint}"


def _drop_cut(t: TaskRequests, docs: int, max_len: int, mode: str, key: str) -> TaskRequests:
    """With ``mode="drop"``, the task without the documents that do not fit (refused when none
    would be left)."""
    if mode != "drop":
        return t
    dropped = sorted({r.doc_id for r in t.requests if r.cut(max_len)})
    if len(dropped) + len(t.dropped) >= docs:
        raise PipelineError(f"{key}=drop: every document of task {t.name} is longer than model.max_seq_len={max_len}; nothing would be left")
    gone = set(dropped)
    return dataclasses.replace(t, requests=tuple(r for r in t.requests if r.doc_id not in gone), dropped=tuple(sorted(gone | set(t.dropped))))
