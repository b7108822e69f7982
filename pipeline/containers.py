"""Container helpers: a content digest for directory images, and bind mount points.

Charliecloud runs directory images without a registry, so there is no registry digest; the
content digest here (sha256 over every regular file's path, mode and bytes and every symlink's
target, in path order; empty directories and /dev ignored) identifies what a job ran in and is
recorded as the MLflow tag container.image_digest.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path


def directory_image_digest(root: str | os.PathLike) -> str:
    root = Path(root)
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        rel_dir = Path(dirpath).relative_to(root)
        if rel_dir.parts[:1] == ("dev",):
            dirnames.clear()
            continue
        for name in sorted(filenames):
            path = Path(dirpath) / name
            rel = (rel_dir / name).as_posix()
            st = path.lstat()
            if stat.S_ISLNK(st.st_mode):
                h.update(f"L {rel} {os.readlink(path)}\n".encode())
            elif stat.S_ISREG(st.st_mode):
                h.update(f"F {rel} {st.st_mode & 0o7777:o}\n".encode())
                with open(path, "rb") as f:
                    while block := f.read(1 << 22):
                        h.update(block)
    return "sha256:" + h.hexdigest()


def ensure_mount_points(image_dir: str | os.PathLike, destinations: list[str]) -> None:
    """Create bind-mount targets inside a directory image (ch-run cannot create them in a
    read-only image); a no-op for images that are not directories (by name, squashfs)."""
    image = Path(image_dir)
    if not image.is_dir():
        return
    for dst in destinations:
        (image / dst.lstrip("/")).mkdir(parents=True, exist_ok=True)
