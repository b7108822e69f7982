"""Credentials never leave in clear text: the password of any ``scheme://user:password@host``
URI is replaced by ``***`` wherever a URI is logged, stored, printed or raised."""

from __future__ import annotations

import os
import re
from pathlib import Path

MASK = "***"
_USERINFO = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.\-]*://[^:/@\s]*:)(?P<password>[^\s/]+)(?P<at>@)")


def redact(text: str) -> str:
    """``text`` with the password of every URI in it masked."""
    return _USERINFO.sub(lambda m: m["head"] + MASK + m["at"], text)


def has_password(uri: str) -> bool:
    m = _USERINFO.search(uri)
    return bool(m) and m["password"] != MASK


def with_password(uri: str, password: str) -> str:
    """``uri`` with its password set (a URI with a user but no password gains one)."""
    if _USERINFO.search(uri):
        return _USERINFO.sub(lambda m: m["head"] + password + m["at"], uri, count=1)
    m = re.match(r"(?P<head>[A-Za-z][A-Za-z0-9+.\-]*://[^:/@\s]+)(?P<at>@)", uri)
    if not m:
        raise ValueError("the URI names no user to give the password to (scheme://user@host/...)")
    return f"{m['head']}:{password}{uri[m.end('head') :]}"


def read_password(env: str, file: Path | None) -> str | None:
    """A password from a file (first line) or an environment variable; never from argv."""
    if file is not None:
        return file.read_text().splitlines()[0].strip() if file.read_text().strip() else None
    return os.environ.get(env) or None


def unredact(uri: str | None, *candidates: str | None) -> str | None:
    """The full URI behind a redacted one, from candidates (environment values) that redact to it."""
    if not uri or MASK not in uri:
        return uri
    for c in candidates:
        if c and redact(c) == uri:
            return c
    return uri
