"""A FIFO where a file belongs (issue 50): whatever reads the file must answer at once (moe.reader
refuses a FIFO without blocking on it), with one clear error or a "not ours", instead of hanging."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any


def fifo_at(path: Path) -> Path:
    """``path`` replaced by a FIFO (its folder made where missing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() or path.is_symlink():
        path.unlink()
    os.mkfifo(path)
    return path


def within(fn: Callable[[], Any], fifo: Path, seconds: float = 10.0) -> Any:
    """``fn()``'s value, or the exception it raised, provided it came within ``seconds``; else the
    test fails (and the FIFO gets a writer that closes at once, so that the blocked reader ends)."""
    box: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            box.append((True, fn()))
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread as it was raised
            box.append((False, exc))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if not box:
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(seconds)
        raise AssertionError(f"reading {fifo} blocked for {seconds:g} s: a FIFO must be refused at once")
    ok, value = box[0]
    if not ok:
        raise value
    return value
