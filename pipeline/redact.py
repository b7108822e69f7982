"""Credentials never leave in clear text: the password of any ``scheme://user:password@host``
URI, and the value of every credential-like query parameter (``?token=...``, ``access_token``,
``key``, ``sig``, ``password`` ...), are replaced by ``***`` wherever a URI is logged, stored,
printed or raised."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

MASK = "***"
_USERINFO = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.\-]*://[^:/@\s]*:)(?P<password>[^\s/]+)(?P<at>@)")


# query parameters that carry a credential (presigned URLs, token auth, SAS signatures)
_SECRET_PARAMS = (
    "token|access_token|refresh_token|id_token|auth|auth_token|authorization|api_key|apikey|key|secret|client_secret|"
    "password|passwd|pwd|sig|signature|credential|x-amz-signature|x-amz-credential|x-amz-security-token|"
    "x-goog-signature|x-goog-credential|sv|se|sp"
)
_QUERY_SECRET = re.compile(rf"(?P<head>[?&;](?:{_SECRET_PARAMS})=)(?P<value>[^&#;\s'\"]+)", re.IGNORECASE)


def redact(text: str) -> str:
    """``text`` with the password of every URI in it, and every credential query value, masked."""
    text = _USERINFO.sub(lambda m: m["head"] + MASK + m["at"], text)
    return _QUERY_SECRET.sub(lambda m: m["head"] + MASK, text)


def has_password(uri: str) -> bool:
    """Whether ``uri`` holds a credential (a password, or a credential query parameter)."""
    m = _USERINFO.search(uri)
    if m and m["password"] != MASK:
        return True
    return any(q["value"] != MASK for q in _QUERY_SECRET.finditer(uri))


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


def install_log_redaction() -> None:
    """Every log record of this process (urllib3's retry warnings and MLflow's included, which
    print the URLs they request) is redacted as it is made, whichever handler prints it."""
    make = logging.getLogRecordFactory()
    if getattr(make, "redacts", False):
        return

    def factory(*args, **kwargs) -> logging.LogRecord:
        record = make(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # a malformed record: leave it to logging's own error path
            return record
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, ()
        if record.exc_info and record.exc_info[1] is not None and not record.exc_text:
            import traceback

            text = "".join(traceback.format_exception(*record.exc_info)).rstrip("\n")
            if redact(text) != text:  # a traceback naming a URL: the formatter prints this text instead
                record.exc_text = redact(text)
        return record

    factory.redacts = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(factory)
