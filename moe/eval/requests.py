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
from typing import Any

from moe.errors import ConfigError
from moe.reader import MIB, FileFormatError, Int, List, Map, Nullable, Spec, Str, gunzip_text, parse_json, read_bytes


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
    # (document, subject) of a task reported as a mean over its subjects (MMLU, as OLMES does);
    # empty: a mean over documents only
    subjects: tuple[tuple[int, str], ...] = ()


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
                **({"subjects": [list(pair) for pair in t.subjects]} if t.subjects else {}),
                "requests": [[getattr(r, f) for f in _FIELDS] for r in t.requests],
            }
            for t in tasks
        ],
    }
    return gzip.compress(json.dumps(body, separators=(",", ":")).encode(), mtime=0)


MAX_COMPRESSED_BYTES = 512 * MIB  # the whole core suite, unlimited, exports to far less
MAX_JSON_BYTES = 2048 * MIB  # its JSON once decompressed: a gzip bomb stops here
_ID = Int(0, 2**32 - 1)  # a token id, a document's index, a length in characters or bytes


@dataclasses.dataclass(frozen=True)
class _RequestRow(Spec):
    """A request as dump_task_requests writes it: one value per field of Request, in order
    (a fixed-length list, which moe.reader's List, of one item type, does not describe)."""

    def check(self, value: Any, where: str = "", path: str = "") -> Any:
        if not isinstance(value, list) or len(value) != len(_FIELDS):
            raise self.fail(where, path, f"a list of the {len(_FIELDS)} fields {', '.join(_FIELDS)}", value)
        return [_check_field(name, v, where, f"{path}.{name}") for name, v in zip(_FIELDS, value, strict=True)]


_TOKENS = List(_ID, max_len=1_000_000, min_len=1)  # never empty


def _check_field(name: str, value: Any, where: str, path: str) -> Any:
    if name not in ("ctx", "cont"):
        return _ID.check(value, where, path)
    # millions of ids in an export: List.check (a path per item) only to name a bad one
    if isinstance(value, list) and 1 <= len(value) <= _TOKENS.max_len and all(type(i) is int and 0 <= i <= _ID.hi for i in value):
        return value
    return _TOKENS.check(value, where, path)


@dataclasses.dataclass(frozen=True)
class _SubjectPair(Spec):
    """A (document, subject) pair of a task reported as a mean over its subjects."""

    def check(self, value: Any, where: str = "", path: str = "") -> Any:
        if not isinstance(value, list) or len(value) != 2:
            raise self.fail(where, path, "a [document, subject] pair", value)
        return [_ID.check(value[0], where, f"{path}[0]"), Str(256).check(value[1], where, f"{path}[1]")]


_SUBJECT = _SubjectPair()

# The file dump_task_requests writes, with the meta `moe tasks --export` gives it.
REQUESTS_SCHEMA = Map(
    required={
        "format": Str(64, choices=(FORMAT,)),
        "fields": List(Str(64), max_len=len(_FIELDS)),  # equal to _FIELDS: checked before the schema
        "tasks": List(
            Map(
                required={
                    "name": Str(256, r"[A-Za-z0-9_.:\-]+"),
                    "metric": Str(32, r"[a-z_]+"),  # moe.eval.metrics.METRIC_TYPES (which imports this module)
                    "docs_total": Int(0, 10**9),
                    "requests": List(_RequestRow(), max_len=10_000_000),
                },
                optional={
                    "sample": Nullable(List(_ID, max_len=10**9)),
                    "dropped": List(_ID, max_len=10**9),
                    "subjects": List(_SUBJECT, max_len=10**9),
                },
            ),
            max_len=10_000,
        ),
    },
    optional={
        "tokenizer_sha256": Str(64, r"[0-9a-f]{64}"),
        "vocab_size": Int(1, 2**32),
        "pad_id": _ID,
        "max_len": Int(1, 2**31),
        "limit": Nullable(Int(1, 10**9)),
        "seed": Int(0, 2**63 - 1),
        "task_names": List(Str(256), max_len=10_000),  # the task and suite names as asked for (train.eval_tasks)
        "truncation": Str(8, choices=("cut", "drop")),
    },
)


def load_task_requests(path: str | os.PathLike) -> tuple[list[TaskRequests], dict]:
    """(tasks, meta) from a file dump_task_requests wrote; anything else is one clear error."""
    try:
        body = parse_json(gunzip_text(read_bytes(path, MAX_COMPRESSED_BYTES), path, MAX_JSON_BYTES), str(path))
    except FileFormatError as exc:
        detail = str(exc).removeprefix(f"{path}: ")
        raise ConfigError(f"{path}: not a tokenised-requests file (`moe tasks --export` writes one): {detail}") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT or body.get("fields") != _FIELDS:
        raise ConfigError(f"{path}: not a {FORMAT} file (`moe tasks --export` writes one)")
    try:
        body = REQUESTS_SCHEMA.check(body, f"{path}: ")
    except FileFormatError as exc:
        raise ConfigError(str(exc)) from None
    tasks = [
        TaskRequests(
            t["name"],
            t["metric"],
            tuple(_request(row) for row in t["requests"]),
            t["docs_total"],
            None if t.get("sample") is None else tuple(t["sample"]),  # absent from files written before the sampled limit
            tuple(t.get("dropped", ())),
            tuple((doc, subject) for doc, subject in t.get("subjects", ())),  # absent: a mean over documents only
        )
        for t in body["tasks"]
    ]
    return tasks, {k: v for k, v in body.items() if k not in ("tasks", "fields")}


def is_requests_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a file dump_task_requests wrote (a recogniser: never overwrite anything else)."""
    try:
        load_task_requests(path)
    except ConfigError:
        return False
    return True


def _request(row: list) -> Request:
    values = dict(zip(_FIELDS, row, strict=True))
    return Request(**values | {"ctx": tuple(values["ctx"]), "cont": tuple(values["cont"])})
