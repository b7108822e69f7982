"""Stage outputs replace only what a stage wrote before.

An output directory is replaced when it is absent, empty, or holds the marker file the
stage writes (``manifest.json`` of the tokenise stage, ``moe_conversion.json`` of a
conversion); anything else (a user's own folder, a file) is refused, naming the key, so a
wrong ``--out`` or ``tokenize.output`` never deletes files we did not create.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from pipeline.errors import PipelineError


def check_own_output(out: Path, marker: str, key: str) -> None:
    if not out.exists() and not out.is_symlink():
        return
    if out.is_symlink() or not out.is_dir():
        raise PipelineError(f"{key}: {out} exists and is not a directory this stage wrote; refusing to replace it")
    if not any(out.iterdir()):
        return
    if not (out / marker).is_file():
        raise PipelineError(
            f"{key}: {out} exists and holds files this stage did not write (no {marker}); "
            "refusing to replace it: choose another directory or move it away"
        )


def replace_own_output(tmp: Path, out: Path, marker: str, key: str) -> None:
    """Move the finished ``tmp`` to ``out``, removing only our own earlier output."""
    check_own_output(out, marker, key)  # again: it may have changed while we worked
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)
