"""Credentials never leave in clear text: the password of any ``scheme://user:password@host``
URI (whatever characters it holds: ``/``, ``@``, ``?``), and the value of every query or fragment
parameter whose name says it is a credential (``?token=``, ``private_token``, ``api-key``,
``#access_token=``, ``X-Amz-Signature``, ``sig`` ...), are replaced by ``***`` wherever a URI is
logged, stored, printed or raised.

Text is scanned, never backtracked over: every character is looked at a bounded number of
times, so a megabyte of log text costs milliseconds (a regular expression anchored on the
scheme was quadratic in runs of letters, issue 50)."""

from __future__ import annotations

import functools
import logging
import os
import re
from pathlib import Path
from urllib.parse import unquote_plus

from moe.errors import one_line

MASK = "***"
SCHEME_SEP = "://"
_AUTHORITY = re.compile(re.escape(SCHEME_SEP))
# where a userinfo with a password starts: a user name (no ':', '/', '@', IPv6 bracket) and ':'
_USER_AND_COLON = re.compile(r"://[^:/?#@\s'\"<>`\[\]]*:")
URI_END = re.compile(r"[\s'\"<>`]")  # where a URI written in text stops
_NAME_CHAR = r"[^=&;#?\s'\"<>`]"
# a parameter as it stands in a query, a fragment or a request line (``?name=``, ``&``, ``;``,
# ``#``), searched for in lower-cased text, whose name may be a credential's: it holds a fragment
# of one or is percent-encoded. The regex engine passes over every other parameter, so only these
# reach ``is_secret_name``; a name is bounded, so a long run of text after a separator costs a
# bounded look.
_CANDIDATE = r"token|key|secret|pass|pwd|auth|cred|sig|session|jwt|bearer|cookie|otp|%|\+"
_PARAM = re.compile(rf"[?&;#](?P<name>(?={_NAME_CHAR}{{0,128}}?(?:{_CANDIDATE})){_NAME_CHAR}{{1,128}}|s[vep])=")
_VALUE_END = re.compile(r"[&;#\s'\"<>`]")

# a parameter name holding one of these words (split at - _ . and camelCase) carries a credential
SECRET_WORDS = frozenset(
    {
        *("token", "key", "secret", "password", "passwd", "pwd", "pass", "passphrase", "auth", "authorization"),
        *("credential", "credentials", "signature", "sig", "session", "sessionid", "apikey", "jwt", "bearer"),
        *("cookie", "otp"),
    }
)
# ... and so does one whose letters end with one of these (accesstoken, xamzsecuritytoken, apikey)
SECRET_ENDINGS = (
    "token",
    "secret",
    "password",
    "passwd",
    "pwd",
    "apikey",
    "accesskey",
    "secretkey",
    "privatekey",
    "signature",
    "credential",
    "credentials",
    "sessionid",
    "auth",
)
# names that are credentials only as a whole: the fields of an Azure SAS token
SECRET_NAMES = frozenset({"sv", "se", "sp"})
_WORD_BREAK = re.compile(r"[^A-Za-z0-9]+|(?<=[a-z0-9])(?=[A-Z])")


@functools.lru_cache(maxsize=4096)
def is_secret_name(name: str) -> bool:
    """Whether a query/fragment parameter called ``name`` carries a credential (case-insensitive;
    ``api-key``, ``api_key``, ``apiKey`` and ``APIKEY`` alike; ``keyboard`` or ``monkey`` not)."""
    name = unquote_plus(name)
    words = {w.lower() for w in _WORD_BREAK.split(name) if w}
    letters = re.sub(r"[^a-z0-9]", "", name.lower())
    return bool(words & SECRET_WORDS) or letters in SECRET_NAMES or letters.endswith(SECRET_ENDINGS)


def redact(text: str) -> str:
    """``text`` with the password of every URI in it, and every credential parameter value, masked."""
    return _mask_params(_mask_passwords(text))


def _mask_passwords(text: str) -> str:
    """Every ``user:password@`` after a ``://`` with its password masked."""
    if "@" not in text:
        return text
    out: list[str] = []
    done = 0
    for start, end in _uri_spans(text, _USER_AND_COLON):
        found = password_span(text[start:end])
        if found is not None:
            out += [text[done : start + found[0]], MASK]
            done = start + found[1]
    return "".join(out) + text[done:] if out else text


def _uri_spans(text: str, starts: re.Pattern = _AUTHORITY):
    """(start, end) of what follows each ``://`` that ``starts`` finds, up to the URI's end or
    the next ``://`` (so no character is in two spans: linear in the text)."""
    for m in starts.finditer(text):
        start = m.start() + len(SCHEME_SEP)
        following = text.find(SCHEME_SEP, start)
        limit = len(text) if following < 0 else following
        stop = URI_END.search(text, start, limit)
        yield start, stop.start() if stop else limit


def password_span(rest: str) -> tuple[int, int] | None:
    """(start, end) of the password in ``rest`` (a URI after its ``://``), or None.

    The userinfo ends at the last ``@`` before the query or fragment (a password may hold ``@``
    and ``/``); when none is there but the URI starts ``user:...`` with an ``@`` further on, the
    password held a ``?`` or ``#`` and runs to that last ``@``. A host:port URI with an ``@`` in its
    path is then masked too: too much shown masked is better than a password shown."""
    query = min((i for i in (rest.find("?"), rest.find("#")) if i >= 0), default=len(rest))
    at = rest.rfind("@", 0, query)
    if at < 0:  # a password holding '?' or '#': user:pa?ss@host
        at, colon = rest.rfind("@"), rest.find(":")
        if at < 0 or not 0 <= colon < query or "/" in rest[colon:query]:
            return None
    userinfo = rest[:at]
    colon = userinfo.find(":")  # the user's end: a user name holds no ':'
    if colon < 0:
        return None  # a user and no password (postgresql://mlflow@host)
    if any(c in userinfo for c in "/?#") and any(c in userinfo[:colon] for c in "/?#[]"):
        return None  # a path or an IPv6 host before the '@', not a userinfo
    return colon + 1, at


def _mask_params(text: str) -> str:
    """Every credential parameter's value masked (``?name=value``, ``&``, ``;`` or ``#``)."""
    if "=" not in text:
        return text
    lower = text.lower()
    if len(lower) != len(text):  # a character that lower-cases to two: positions would differ
        lower = text.translate(_ASCII_LOWER)
    out: list[str] = []
    done = pos = 0
    while (m := _PARAM.search(lower, pos)) is not None:
        pos = m.end()
        if not is_secret_name(text[m.start("name") : pos - 1]):
            continue
        stop = _VALUE_END.search(text, pos)
        end = stop.start() if stop else len(text)
        if end > pos:
            out += [text[done:pos], MASK]
            done = pos = end
    return "".join(out) + text[done:] if out else text


_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


def has_password(uri: str) -> bool:
    """Whether ``uri`` holds a credential (a password, or a credential parameter) not yet masked."""
    return redact(uri) != uri


def without_userinfo(uri: str) -> str:
    """``uri`` with no ``user[:password]@`` at all and its credential parameters masked: the form
    of an address kept for others to follow (a git remote whose user name may be a token)."""
    out: list[str] = []
    done = 0
    for start, end in _uri_spans(uri):
        at = userinfo_end(uri[start:end])
        if at >= 0:
            out.append(uri[done:start])
            done = start + at + 1
    return redact("".join(out) + uri[done:])


def userinfo_end(rest: str) -> int:
    """The index of the ``@`` that ends the userinfo of ``rest`` (a URI after its ``://``), or -1."""
    found = password_span(rest)
    if found is not None:
        return found[1]
    return rest.rfind("@", 0, _authority_end(rest))


def _authority_end(rest: str) -> int:
    return min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))


def with_password(uri: str, password: str) -> str:
    """``uri`` with its password set (a URI with a user but no password gains one)."""
    sep = uri.find(SCHEME_SEP)
    if sep < 0:
        raise ValueError("the URI names no user to give the password to (scheme://user@host/...)")
    start = sep + len(SCHEME_SEP)
    found = password_span(uri[start:])
    if found is not None:
        return uri[: start + found[0]] + password + uri[start + found[1] :]
    at = uri.rfind("@", start, start + _authority_end(uri[start:]))
    if at <= start:
        raise ValueError("the URI names no user to give the password to (scheme://user@host/...)")
    return f"{uri[:at]}:{password}{uri[at:]}"


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
        clean = one_line(redact(message))  # a value's line break never forges a log line
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
