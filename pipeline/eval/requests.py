"""Tasks -> tokenised requests, with every check made before any model runs: the task names,
the data, the tokenizer's ability to encode the text (no unknown-token fallbacks, no empty
encodings) and the model's context length."""

from __future__ import annotations

from pathlib import Path

from moe.eval.requests import Request, TaskRequests
from pipeline.errors import PipelineError
from pipeline.eval.data import data_root
from pipeline.eval.tasks import Doc, Task, resolve_tasks
from pipeline.tokenizer import TokenizerInfo


def _encoder(info: TokenizerInfo):
    tok = info.build()
    unk = None
    model = tok.get_vocab()
    for name in ("[UNK]", "<unk>", "<|unk|>"):
        if name in model:
            unk = model[name]
    return tok, unk


def tokenize_task(task: Task, docs: list[Doc], info: TokenizerInfo, key: str) -> list[Request]:
    """Context and continuation are tokenised separately (OLMo's evaluator), without special tokens."""
    tok, unk = _encoder(info)
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


def prepare_tasks(names: list[str], info: TokenizerInfo, *, limit: int | None, data_dir: str | None, key: str, max_len: int) -> list[TaskRequests]:
    """Every named task (or suite) built and tokenised; ``limit``: the first documents of each."""
    tasks = resolve_tasks(names, key)
    if not tasks:
        return []
    root: Path = data_root(data_dir)
    out = []
    for task in tasks:
        docs = task.build(root)
        if not docs:
            raise PipelineError(f"{key}: task {task.name} has no documents in {root}")
        kept = docs[:limit] if limit else docs
        requests = tokenize_task(task, kept, info, key)
        too_long = [r for r in requests if len(r.cont) > max_len]
        if too_long:
            r = too_long[0]
            raise PipelineError(
                f"{key}: task {task.name}, document {r.doc_id}: a continuation of {len(r.cont)} tokens does not fit model.max_seq_len={max_len}"
            )
        out.append(TaskRequests(task.name, task.metric, tuple(requests), len(docs)))
    return out
