"""A tokenised in-context-learning request: one (document, continuation) pair to score.

Ranked classification (OLMo's in-loop formulation): a document has a context and several
continuations (or, WinoGrande, several contexts and one continuation); the model's summed
log-probability of each continuation's tokens given its context ranks them. The lengths in
characters and UTF-8 bytes, with and without the leading space, turn the sums into the
length-normalised and per-byte metrics.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
from collections.abc import Sequence
from pathlib import Path

from moe.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Request:
    doc_id: int
    cont_id: int
    ctx: tuple[int, ...]  # context token ids (never empty)
    cont: tuple[int, ...]  # continuation token ids (never empty)
    label: int  # the gold continuation of the document
    cont_chars: int  # len(continuation string), its leading space included
    cont_bytes: int  # len(continuation string in UTF-8)
    cont_chars_no_space: int  # the same without the first character (OLMo's "v1" normalisation)
    cont_bytes_no_space: int

    def cut(self, max_len: int) -> int:
        """Context tokens ``query`` drops to fit ``max_len`` (0: the whole context is read)."""
        return max(0, len(self.ctx) + len(self.cont) - 1 - max_len)

    def query(self, max_len: int) -> tuple[tuple[int, ...], int]:
        """(input ids, index of the first continuation token's prediction): ``ctx + cont[:-1]``
        cut from the left to ``max_len`` tokens, as OLMo's evaluator does."""
        ids = (self.ctx + self.cont[:-1])[-max_len:]
        return ids, len(ids) - len(self.cont)


@dataclasses.dataclass(frozen=True)
class TaskRequests:
    name: str
    metric: str  # the primary metric (acc, len_norm, bpb, ce_loss)
    requests: tuple[Request, ...]
    docs_total: int  # documents of the task before any limit
    # the documents a limit sampled (None: every document), and those of them left out because
    # their context would have been cut (evaluate.truncation=drop) or their continuation does not fit
    sample: tuple[int, ...] | None = None
    dropped: tuple[int, ...] = ()


def truncation(requests: Sequence[Request], max_len: int) -> dict[str, float]:
    """How much context the model's window cuts (from the left, as OLMo's evaluator does):
    documents and requests cut, and the tokens lost, at most and in all. A cut context can
    change a task's numbers without any error, so the evaluation counts and reports it."""
    cuts = [(r.doc_id, r.cut(max_len)) for r in requests]
    cut = [(d, c) for d, c in cuts if c > 0]
    return {
        "truncated_docs": float(len({d for d, _ in cut})),
        "truncated_requests": float(len(cut)),
        "truncated_tokens_max": float(max((c for _, c in cut), default=0)),
        "truncated_tokens_total": float(sum(c for _, c in cut)),
    }


FORMAT = "moe-eval-requests/1"
_FIELDS = [f.name for f in dataclasses.fields(Request)]


def dump_task_requests(tasks: list[TaskRequests], meta: dict) -> bytes:
    """Tokenised tasks (moe.eval.suite.TaskRequests) as gzip'd JSON: what `moe tasks --export`
    writes and a benchmark reads without the task data or the tokenizer (no pickle anywhere)."""
    body = {
        "format": FORMAT,
        **meta,
        "fields": _FIELDS,
        "tasks": [
            {
                "name": t.name,
                "metric": t.metric,
                "docs_total": t.docs_total,
                "sample": None if t.sample is None else list(t.sample),
                "dropped": list(t.dropped),
                "requests": [[getattr(r, f) for f in _FIELDS] for r in t.requests],
            }
            for t in tasks
        ],
    }
    return gzip.compress(json.dumps(body, separators=(",", ":")).encode(), mtime=0)


def load_task_requests(path: str | os.PathLike) -> tuple[list[TaskRequests], dict]:
    """(tasks, meta) from a file dump_task_requests wrote; anything else is one clear error."""
    try:
        body = json.loads(gzip.decompress(Path(path).read_bytes()))
    except (OSError, EOFError, ValueError) as exc:
        raise ConfigError(f"{path}: not a tokenised-requests file (`moe tasks --export`): {exc}") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT or body.get("fields") != _FIELDS:
        raise ConfigError(f"{path}: not a {FORMAT} file (`moe tasks --export` writes one)")
    tasks = []
    try:
        for t in body["tasks"]:
            requests = []
            for row in t["requests"]:
                values = dict(zip(_FIELDS, row, strict=True))
                values["ctx"], values["cont"] = tuple(values["ctx"]), tuple(values["cont"])
                if not (values["ctx"] and values["cont"]) or not all(isinstance(i, int) and i >= 0 for i in values["ctx"] + values["cont"]):
                    raise ValueError(f"task {t['name']}: a request with empty or non-integer token ids")
                requests.append(Request(**values))
            sample = t.get("sample")  # absent from files written before the sampled limit
            tasks.append(
                TaskRequests(
                    str(t["name"]),
                    str(t["metric"]),
                    tuple(requests),
                    int(t["docs_total"]),
                    None if sample is None else tuple(int(d) for d in sample),
                    tuple(int(d) for d in t.get("dropped", ())),
                )
            )
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{path}: damaged tokenised-requests file ({exc})") from None
    return tasks, {k: v for k, v in body.items() if k not in ("tasks", "fields")}
