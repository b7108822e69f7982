"""One bounded reader for every file the project did not just write.

A file someone hands us (a record, a ledger, a job spec, a result, a config) is read here and
nowhere else: it must be a regular file (a FIFO or a device is refused without blocking on it),
no larger than its kind allows, valid UTF-8, and JSON without NaN or Infinity; its content is
then checked against a typed schema (types, ranges, lengths, finite numbers, unknown keys
refused). What comes back is the validated value, or one :class:`FileFormatError` whose message
names the file, the row (for JSON lines) and the field: ``error: <file>: line 3: steps[2].loss:
expected a finite number, got 'x'``. Torch-free and dependency-free, so the library and the
pipeline both read through it (tests/test_readers.py walks every module for reads that bypass it).
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe.errors import MoeError

MIB = 2**20
DEFAULT_MAX_BYTES = 16 * MIB  # records, ledgers, specs, results: far larger is not ours


class FileFormatError(MoeError, ValueError):
    """A file we did not write that is missing, not a regular file, too large, or not of its format."""


# ------------------------------------------------------------------------------------- bytes


def read_arrow_stream(path: str | os.PathLike, max_bytes: int = 1024 * MIB) -> Any:
    """An Arrow IPC stream file as a pyarrow Table, validated in full (offsets, buffer sizes,
    UTF-8) before anything touches its values: a crafted buffer is an error, not a crash."""
    import pyarrow as pa

    raw = read_bytes(path, max_bytes)
    try:
        table = pa.ipc.open_stream(pa.BufferReader(raw)).read_all()
        table.validate(full=True)
    except (pa.ArrowException, ValueError, OSError) as exc:
        raise FileFormatError(f"{path}: truncated or damaged Arrow data ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
    return table


def read_bytes(path: str | os.PathLike, max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
    """The bytes of a regular file of at most ``max_bytes``. Opened non-blocking, so a FIFO put
    where a file belongs is refused at once instead of hanging the command."""
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise FileFormatError(f"{p}: no such file") from None
    except OSError as exc:
        raise FileFormatError(f"{p}: cannot be opened ({exc.strerror})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise FileFormatError(f"{p}: not a regular file")
        if info.st_size > max_bytes:
            raise FileFormatError(f"{p}: {info.st_size} bytes, more than the {max_bytes} such a file may have")
        chunks, size = [], 0
        while chunk := os.read(fd, min(MIB, max_bytes + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
            if size > max_bytes:  # it grew while we read
                raise FileFormatError(f"{p}: more than the {max_bytes} bytes such a file may have")
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_text(path: str | os.PathLike, max_bytes: int = DEFAULT_MAX_BYTES) -> str:
    raw = read_bytes(path, max_bytes)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FileFormatError(f"{path}: not UTF-8 text (byte {exc.start})") from None


# ---------------------------------------------------------------------------------- gzip


def gzip_chunks(raw: bytes, where: str | os.PathLike, max_bytes: int) -> Iterator[bytes]:
    """The inflated bytes of gzip data (every member, as gzip allows), a chunk at a time and at
    most ``max_bytes`` in all: a gzip bomb stops there, truncated data and bytes that are not a
    next member are errors naming ``where``."""
    inflate, data, total = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS), raw, 0
    while True:
        try:
            chunk = inflate.decompress(data, MIB)
        except zlib.error as exc:
            raise FileFormatError(f"{where}: not gzip data ({exc})") from None
        data = inflate.unconsumed_tail
        total += len(chunk)
        if total > max_bytes:
            raise FileFormatError(f"{where}: more than {max_bytes:,} bytes once decompressed")
        if chunk:
            yield chunk
        if inflate.eof:
            data = inflate.unused_data
            if not data.strip(b"\0"):  # (zero padding after the last member, as gzip allows)
                return
            inflate = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)  # the next member
        elif not chunk and not data:
            raise FileFormatError(f"{where}: truncated gzip data")


def gunzip_text(raw: bytes, where: str | os.PathLike, max_bytes: int) -> str:
    """gzip data inflated (gzip_chunks) and decoded as UTF-8."""
    data = b"".join(gzip_chunks(raw, where, max_bytes))
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FileFormatError(f"{where}: not UTF-8 text once decompressed (byte {exc.start})") from None


def gzip_lines(raw: bytes, where: str | os.PathLike, max_bytes: int, max_line: int) -> Iterator[bytes]:
    """The lines (without their newline) of gzip data; a line longer than ``max_line`` is yielded
    as soon as it is that long (the caller names it), never held whole."""
    pending = b""
    for chunk in gzip_chunks(raw, where, max_bytes):
        *lines, pending = (pending + chunk).split(b"\n")
        yield from lines
        if len(pending) > max_line:
            yield pending
            return
    if pending:
        yield pending


# -------------------------------------------------------------------------------- formats


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def parse_json(text: str, where: str) -> Any:
    try:
        return json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise FileFormatError(f"{where}: nested too deeply") from None
    except ValueError as exc:
        raise FileFormatError(f"{where}: not valid JSON ({str(exc).splitlines()[0]})") from None


def read_json(path: str | os.PathLike, schema: Spec, max_bytes: int = DEFAULT_MAX_BYTES) -> Any:
    """A JSON file checked against ``schema``."""
    return schema.check(parse_json(read_text(path, max_bytes), str(path)), f"{path}: ")


def parse_json_object(text: str, where: str) -> dict[str, Any]:
    """JSON text whose top level is an object, before its schema is checked; FileFormatError
    reads "<where>: the file is not JSON (...)" or "<where>: the top level is a list, not an object"."""
    try:
        value = parse_json(text, where)
    except FileFormatError as exc:
        raise FileFormatError(f"{where}: the file is not JSON" + str(exc).removeprefix(f"{where}: not valid JSON")) from None
    if not isinstance(value, dict):
        raise FileFormatError(f"{where}: the top level is a {type(value).__name__}, not an object")
    return value


def read_json_object(path: str | os.PathLike, max_bytes: int = DEFAULT_MAX_BYTES) -> dict[str, Any]:
    """parse_json_object of a file read through read_text (whose own errors pass unchanged)."""
    return parse_json_object(read_text(path, max_bytes), str(path))


def read_jsonl(path: str | os.PathLike, row: Spec, max_bytes: int = DEFAULT_MAX_BYTES, max_rows: int = 10_000_000) -> list[Any]:
    """The rows of a JSON-lines file, each checked against ``row`` (blank lines skipped)."""
    return list(iter_jsonl(read_text(path, max_bytes), row, str(path), max_rows))


def iter_jsonl(text: str, row: Spec, where: str, max_rows: int = 10_000_000) -> Iterator[Any]:
    count = 0
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        count += 1
        if count > max_rows:
            raise FileFormatError(f"{where}: more than {max_rows} rows")
        yield row.check(parse_json(line, f"{where}: line {lineno}"), f"{where}: line {lineno}: ")


def read_yaml(path: str | os.PathLike, schema: Spec, max_bytes: int = DEFAULT_MAX_BYTES) -> Any:
    """A YAML file (safe loader: plain data only) checked against ``schema``."""
    import yaml

    text = read_text(path, max_bytes)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise FileFormatError(f"{path}: not valid YAML{at} ({getattr(exc, 'problem', None) or type(exc).__name__})") from None
    return schema.check(data, f"{path}: ")


# --------------------------------------------------------------------------------- schemas


class Spec:
    """A typed schema node: ``check(value, where)`` returns the value (normalised where said) or
    raises FileFormatError naming ``where`` and the field path."""

    def check(self, value: Any, where: str = "", path: str = "") -> Any:
        raise NotImplementedError

    @staticmethod
    def fail(where: str, path: str, expected: str, value: Any) -> FileFormatError:
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        return FileFormatError(f"{where}{path or 'the file'}: expected {expected}, got {shown}")


@dataclass(frozen=True)
class Num(Spec):
    """A finite number in [lo, hi] (an integer when ``integer``; booleans are not numbers)."""

    lo: float = -math.inf
    hi: float = math.inf
    integer: bool = False

    def check(self, value: Any, where: str = "", path: str = "") -> Any:
        kind = "an integer" if self.integer else "a finite number"
        ok_type = isinstance(value, int) if self.integer else isinstance(value, (int, float))
        if isinstance(value, bool) or not ok_type or (isinstance(value, float) and not math.isfinite(value)):
            raise self.fail(where, path, kind, value)
        if not self.lo <= value <= self.hi:
            raise self.fail(where, path, f"{kind} in [{self.lo:g}, {self.hi:g}]", value)
        return value


def Int(lo: float = -math.inf, hi: float = math.inf) -> Num:  # noqa: N802 (reads as a type)
    return Num(lo, hi, integer=True)


@dataclass(frozen=True)
class Str(Spec):
    """A string of at most ``max_len`` characters, matching ``pattern`` / one of ``choices``."""

    max_len: int = 4096
    pattern: str | None = None
    choices: tuple[str, ...] | None = None

    def check(self, value: Any, where: str = "", path: str = "") -> Any:
        if not isinstance(value, str):
            raise self.fail(where, path, "a string", value)
        if len(value) > self.max_len:
            raise self.fail(where, path, f"a string of at most {self.max_len} characters", value)
        if self.choices is not None and value not in self.choices:
            raise self.fail(where, path, "one of " + ", ".join(self.choices), value)
        if self.pattern is not None and not re.fullmatch(self.pattern, value):
            raise self.fail(where, path, f"a string matching {self.pattern}", value)
        return value


@dataclass(frozen=True)
class Bool(Spec):
    def check(self, value: Any, where: str = "", path: str = "") -> Any:
        if not isinstance(value, bool):
            raise self.fail(where, path, "true or false", value)
        return value


@dataclass(frozen=True)
class Nullable(Spec):
    """``inner`` or null."""

    inner: Spec

    def check(self, value: Any, where: str = "", path: str = "") -> Any:
        return None if value is None else self.inner.check(value, where, path)


@dataclass(frozen=True)
class AnyOf(Spec):
    """The first of ``options`` that accepts the value."""

    options: tuple[Spec, ...]
    what: str

    def check(self, value: Any, where: str = "", path: str = "") -> Any:
        for option in self.options:
            try:
                return option.check(value, where, path)
            except FileFormatError:
                continue
        raise self.fail(where, path, self.what, value)


@dataclass(frozen=True)
class List(Spec):
    item: Spec
    max_len: int = 100_000
    min_len: int = 0

    def check(self, value: Any, where: str = "", path: str = "") -> Any:
        if not isinstance(value, list):
            raise self.fail(where, path, "a list", value)
        if not self.min_len <= len(value) <= self.max_len:
            raise self.fail(where, path, f"a list of {self.min_len} to {self.max_len} items", f"{len(value)} items")
        return [self.item.check(v, where, f"{path}[{i}]") for i, v in enumerate(value)]


@dataclass(frozen=True)
class Map(Spec):
    """A mapping with the ``required`` and ``optional`` fields; any other key is refused, unless
    ``other`` (a schema for the values of free-form keys, named by ``keys``) is given."""

    required: Mapping[str, Spec] = field(default_factory=dict)
    optional: Mapping[str, Spec] = field(default_factory=dict)
    other: Spec | None = None
    keys: Str = Str(max_len=256)
    max_keys: int = 100_000

    def check(self, value: Any, where: str = "", path: str = "") -> Any:
        if not isinstance(value, dict):
            raise self.fail(where, path, "a mapping", value)
        if len(value) > self.max_keys:
            raise self.fail(where, path, f"at most {self.max_keys} keys", f"{len(value)} keys")
        missing = [k for k in self.required if k not in value]
        if missing:
            raise FileFormatError(f"{where}{_join(path, missing[0])}: missing")
        out = {}
        for key, v in value.items():
            sub = _join(path, str(key))
            spec = self.required.get(key) or self.optional.get(key)
            if spec is None:
                if self.other is None:
                    raise FileFormatError(f"{where}{sub}: unknown key")
                self.keys.check(key, where, f"{path or 'the file'} key")
                spec = self.other
            out[key] = spec.check(v, where, sub)
        return out


@dataclass(frozen=True)
class Plain(Spec):
    """Any JSON value, bounded in depth and size: data we pass on without interpreting
    (a stored config that its own loader validates next)."""

    max_depth: int = 32

    def check(self, value: Any, where: str = "", path: str = "") -> Any:
        _bounded(value, self.max_depth, where, path)
        return value


def _bounded(value: Any, depth: int, where: str, path: str) -> None:
    if depth < 0:
        raise FileFormatError(f"{where}{path or 'the file'}: nested too deeply")
    if isinstance(value, float) and not math.isfinite(value):
        raise Spec.fail(where, path, "a finite number", value)
    if isinstance(value, dict):
        for k, v in value.items():
            _bounded(v, depth - 1, where, _join(path, str(k)))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _bounded(v, depth - 1, where, f"{path}[{i}]")


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key
