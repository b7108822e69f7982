"""Raw-text inputs of the tokenise stage, read as documents in a deterministic order.

Formats by extension: ``.txt`` and ``.py`` (one document per file), ``.jsonl`` and
``.jsonl.gz`` (one ``{"text": ...}`` document per line, Dolma style), ``.parquet`` (one
document per row of the text column). ``stdlib`` names the ``.py`` files of this Python's
standard library (without its test suites): real text present on every machine.
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import hashlib
import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from pipeline.errors import PipelineError

SUFFIXES = (".txt", ".py", ".jsonl", ".jsonl.gz", ".parquet")
_STDLIB_SKIP = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "site-packages", "__pycache__", "ensurepip"}


@dataclasses.dataclass(frozen=True)
class Source:
    path: Path
    key: str  # stable name independent of the machine (e.g. "stdlib/json/decoder.py")

    @property
    def order(self) -> str:
        return hashlib.sha256(self.key.encode()).hexdigest()


@dataclasses.dataclass(frozen=True)
class Document:
    key: str
    text: str


def _suffix(path: Path) -> str | None:
    name = path.name.lower()
    for s in sorted(SUFFIXES, key=len, reverse=True):
        if name.endswith(s):
            return s
    return None


def stdlib_sources() -> list[Source]:
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for f in root.rglob("*.py"):
        rel = f.relative_to(root)
        if _STDLIB_SKIP.intersection(rel.parts):
            continue
        out.append(Source(f, f"stdlib/{rel.as_posix()}"))
    return out


def resolve_sources(inputs: list[str], key: str = "tokenize.inputs") -> list[Source]:
    """Every input file, ordered by a hash of its stable key (mixes directories; deterministic)."""
    sources: list[Source] = []
    for spec in inputs:
        if spec == "stdlib":
            sources += stdlib_sources()
            continue
        p = Path(spec)
        if any(ch in spec for ch in "*?["):
            matches = [Path(m) for m in sorted(glob.glob(spec, recursive=True)) if Path(m).is_file()]
            supported = [m for m in matches if _suffix(m)]
            if not supported:
                raise PipelineError(f"{key}: {spec} matches no .txt, .jsonl, .jsonl.gz, .parquet or .py file")
            sources += [Source(m, m.as_posix()) for m in supported]
        elif p.is_dir():
            files = [f for f in sorted(p.rglob("*")) if f.is_file() and _suffix(f)]
            if not files:
                raise PipelineError(f"{key}: directory {spec} holds no .txt, .jsonl, .jsonl.gz, .parquet or .py file")
            sources += [Source(f, f"{p.name}/{f.relative_to(p).as_posix()}") for f in files]
        elif p.is_file():
            if not _suffix(p):
                raise PipelineError(f"{key}: {spec} is not a .txt, .jsonl, .jsonl.gz, .parquet or .py file")
            sources.append(Source(p, p.name))
        else:
            raise PipelineError(f"{key}: {spec} not found")
    unique = {s.key: s for s in sources}
    return sorted(unique.values(), key=lambda s: s.order)


def is_text_source(source: Source) -> bool:
    """A .txt/.py input must be UTF-8 text without NUL bytes (a binary renamed .txt, or
    another encoding, would otherwise train as mojibake); other formats are checked as parsed."""
    if _suffix(source.path) not in (".txt", ".py"):
        return True
    try:
        data = source.path.read_bytes()
    except OSError as exc:
        raise PipelineError(f"{source.path}: cannot read ({exc.strerror})") from None
    if b"\0" in data:
        return False
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def read_documents(source: Source, text_field: str = "text") -> Iterator[Document]:
    suffix = _suffix(source.path)
    path = source.path
    try:
        if suffix in (".txt", ".py"):
            text = path.read_bytes().decode("utf-8", errors="replace")
            if text.strip():
                yield Document(source.key, text)
        elif suffix in (".jsonl", ".jsonl.gz"):
            opener = gzip.open if suffix == ".jsonl.gz" else open
            with opener(path, "rt", encoding="utf-8") as f:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise PipelineError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
                    if not isinstance(row, dict) or not isinstance(row.get(text_field), str):
                        raise PipelineError(f"{path}:{lineno}: no string field {text_field!r} (tokenize.text_field)")
                    if row[text_field].strip():
                        yield Document(f"{source.key}:{lineno}", row[text_field])
        elif suffix == ".parquet":
            import pyarrow.parquet as pq

            table = pq.read_table(path)
            if text_field not in table.column_names:
                raise PipelineError(f"{path}: no column {text_field!r} (tokenize.text_field); columns: {table.column_names}")
            for row, text in enumerate(table.column(text_field).to_pylist()):
                if isinstance(text, str) and text.strip():
                    yield Document(f"{source.key}:{row}", text)
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise PipelineError(f"{path}: cannot read ({exc})") from None
    except UnicodeDecodeError as exc:
        raise PipelineError(f"{path}: not UTF-8 text ({exc.reason})") from None
    except Exception as exc:
        if exc.__class__.__module__.startswith("pyarrow"):
            raise PipelineError(f"{path}: not a readable parquet file ({exc})") from None
        raise


def is_validation(doc_key: str, seed: int, fraction: float) -> bool:
    h = int(hashlib.sha256(f"{seed}:{doc_key}".encode()).hexdigest()[:12], 16)
    return h / 16**12 < fraction
