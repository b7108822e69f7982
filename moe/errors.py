"""The errors every module raises, each carrying the exit code the commands end with.

Torch-free, so the command line, the pipeline and a worker process can map any of them to
one ``error:`` line and a code without importing what raised it. Anything that is not a
MoeError is a bug: a traceback and exit code 1.
"""

from __future__ import annotations

import errno

EXIT_CODES = {
    "ok": 0,
    "unexpected": 1,
    "bad_input": 2,
    "nonfinite_loss": 3,
    "checkpoint": 4,
    "job_failed": 5,
}


class MoeError(Exception):
    """An expected failure; the message names the key, file or job at fault."""

    exit_code = EXIT_CODES["bad_input"]


class ConfigError(MoeError, ValueError):
    """A config problem; the message names the dotted key at fault."""


class PlanError(ConfigError):
    """Bad input to the memory plan (unknown GPU, GPU count or MFU; a recipe the GPU cannot run)."""


class TokenDataError(MoeError, ValueError):
    """A token file or its sidecar is missing, damaged or does not fit the run."""


class CheckpointError(MoeError, RuntimeError):
    """A checkpoint that cannot be written, is damaged, or would not be safe to load."""

    exit_code = EXIT_CODES["checkpoint"]


class NonFiniteLossError(MoeError, RuntimeError):
    """A loss or gradient norm that is not finite where the run must stop."""

    exit_code = EXIT_CODES["nonfinite_loss"]


def one_line(text: str) -> str:
    """``text`` as one printable line: a line break, a control character or an invisible
    formatting one (bidi overrides) inside a value is shown as its escape, so a file name or a
    key can never start a forged line of a log or an error message."""
    import unicodedata

    def shown(ch: str) -> str:
        if ch.isprintable() or ch == " ":
            return ch
        if unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp") or not ch.isprintable():
            code = ord(ch)
            return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"
        return ch

    return text if text.isprintable() else "".join(shown(ch) for ch in text)


def error_line(message: str) -> str:
    """The one form of an expected failure on a terminal: ``error: <message>`` on one line."""
    return f"error: {one_line(message)}"


class OutputError(MoeError, OSError):
    """An output that cannot be written (a full disk, a quota, a read-only file system); the
    message names the file."""


# What the machine says about where a run writes, never a bug of ours: one line, not a traceback.
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG})


def exit_code_of(exc: BaseException) -> int | None:
    """The exit code of an expected failure (None: a bug). The one place the policy lives:
    the command line, a worker process and ``python -m moe.train`` all ask it."""
    if isinstance(exc, MoeError):
        return exc.exit_code
    if isinstance(exc, FileNotFoundError) or (isinstance(exc, OSError) and exc.errno in DISK_ERRNOS):
        return EXIT_CODES["bad_input"]
    return None
