"""Raw-text inputs of the tokenise stage, read as documents in a deterministic order.

Formats by extension: ``.txt`` and ``.py`` (one document per file), ``.jsonl`` and
``.jsonl.gz`` (one ``{"text": ...}`` document per line, Dolma style), ``.parquet`` (one
document per row of the text column). ``stdlib`` names the ``.py`` files of this Python's
standard library (without its test suites): real text present on every machine.

Hostile inputs: a .txt/.py file or a .jsonl line longer than ``max_document_bytes`` is
passed over without holding more than that bound of it in memory (a gzip bomb is inflated in
bounded chunks and dropped), and reported through ``on_skip``; so is a longer parquet value
(read one batch of rows at a time). Text that is not valid Unicode gets U+FFFD in place of
the bad parts, whatever the format.
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import hashlib
import json
import re
import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path

from pipeline.errors import PipelineError

SUFFIXES = (".txt", ".py", ".jsonl", ".jsonl.gz", ".parquet")
_STDLIB_SKIP = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "site-packages", "__pycache__", "ensurepip"}
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # json.loads pairs escaped surrogates; what is left is alone
_SKIP_CHUNK = 1 << 20  # the rest of an over-long line is read (and dropped) this many bytes at a time
OnSkip = Callable[[str, str], None]  # (where, reason) of a document passed over


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


def is_text_source(source: Source, max_document_bytes: int) -> bool:
    """A .txt/.py input must be UTF-8 text without NUL bytes (a binary renamed .txt, or
    another encoding, would otherwise train as mojibake); other formats are checked as parsed.
    A file over ``max_document_bytes`` is not read here: read_documents skips it as a document."""
    if _suffix(source.path) not in (".txt", ".py"):
        return True
    data = _read_whole_file(source.path, max_document_bytes)
    if data is None:
        return True
    if b"\0" in data:
        return False
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _read_whole_file(path: Path, limit: int) -> bytes | None:
    """The file's bytes, or None when it holds more than ``limit`` (never reading more than
    ``limit + 1``: the size is checked first, the bounded read covers a file that grows)."""
    try:
        if path.stat().st_size > limit:
            return None
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as exc:
        raise PipelineError(f"{path}: cannot read ({exc.strerror})") from None
    return None if len(data) > limit else data


def _bounded_lines(f, limit: int) -> Iterator[bytes | None]:
    """Each line of a binary file (without its newline), or None for a line longer than
    ``limit`` bytes, whose rest is read past in chunks and never held."""
    while line := f.readline(limit + 1):
        if len(line) > limit and not line.endswith(b"\n"):
            while (rest := f.readline(_SKIP_CHUNK)) and not rest.endswith(b"\n"):
                pass
            yield None
        else:
            yield line.rstrip(b"\n")


def valid_unicode(text: str) -> str:
    """A JSON escape can name half of a surrogate pair (``"\\ud800"``): not a character, and
    tokenizers refuses the string. Like undecodable bytes in a .txt (errors="replace"), it
    becomes U+FFFD and the rest of the document is kept, rather than dropping it all."""
    return _LONE_SURROGATE.sub("\ufffd", text) if _LONE_SURROGATE.search(text) else text


def read_documents(source: Source, text_field: str, max_document_bytes: int, on_skip: OnSkip | None = None) -> Iterator[Document]:
    """The source's non-blank documents in order; one over ``max_document_bytes`` is passed
    over and reported to ``on_skip(where, reason)``."""
    suffix = _suffix(source.path)
    path = source.path
    too_long = f"over tokenize.max_document_bytes ({max_document_bytes} bytes)"
    skip = on_skip or (lambda where, reason: None)
    try:
        if suffix in (".txt", ".py"):
            data = _read_whole_file(path, max_document_bytes)
            if data is None:
                skip(str(path), too_long)
                return
            text = data.decode("utf-8", errors="replace")
            if text.strip():
                yield Document(source.key, text)
        elif suffix in (".jsonl", ".jsonl.gz"):
            yield from _jsonl_documents(source, text_field, max_document_bytes, skip, too_long)
        elif suffix == ".parquet":
            yield from _parquet_documents(source, text_field, max_document_bytes, skip, too_long)
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise PipelineError(f"{path}: cannot read ({exc})") from None
    except UnicodeDecodeError as exc:
        raise PipelineError(f"{path}: not UTF-8 text ({exc.reason})") from None
    except Exception as exc:
        if exc.__class__.__module__.startswith("pyarrow"):
            raise PipelineError(f"{path}: not a readable parquet file ({exc})") from None
        raise


def _jsonl_documents(source: Source, text_field: str, limit: int, skip: OnSkip, too_long: str) -> Iterator[Document]:
    path = source.path
    opener = gzip.open if _suffix(path) == ".jsonl.gz" else open
    with opener(path, "rb") as f:
        for lineno, raw in enumerate(_bounded_lines(f, limit), 1):
            if raw is None:
                skip(f"{path}:{lineno}", too_long)
                continue
            line = raw.decode("utf-8")
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise PipelineError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(row, dict) or not isinstance(row.get(text_field), str):
                raise PipelineError(f"{path}:{lineno}: no string field {text_field!r} (tokenize.text_field)")
            if row[text_field].strip():
                yield Document(f"{source.key}:{lineno}", valid_unicode(row[text_field]))


def _parquet_documents(source: Source, text_field: str, limit: int, skip: OnSkip, too_long: str) -> Iterator[Document]:
    """Row groups are read one batch at a time (not the whole table); a value over the bound is
    held only as long as its batch."""
    import pyarrow.parquet as pq

    path = source.path
    with pq.ParquetFile(path) as table:
        columns = table.schema_arrow.names
        if text_field not in columns:
            raise PipelineError(f"{path}: no column {text_field!r} (tokenize.text_field); columns: {columns}")
        row = 0
        for batch in table.iter_batches(batch_size=1024, columns=[text_field]):
            for text in batch.column(0).to_pylist():
                # len(text) <= limit // 4 guarantees <= limit UTF-8 bytes without encoding it
                if isinstance(text, str) and len(text) > limit // 4 and len(text.encode("utf-8", errors="replace")) > limit:
                    skip(f"{path}:{row}", too_long)
                elif isinstance(text, str) and text.strip():
                    yield Document(f"{source.key}:{row}", valid_unicode(text))
                row += 1


def is_validation(doc_key: str, seed: int, fraction: float) -> bool:
    h = int(hashlib.sha256(f"{seed}:{doc_key}".encode()).hexdigest()[:12], 16)
    return h / 16**12 < fraction
