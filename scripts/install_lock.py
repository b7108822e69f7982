"""Install a hash-pinned lock, preferring local CPU builds of locked packages where they exist.

The lock (requirements/cpu.lock) pins PyPI's files for every platform, so it installs anywhere
from PyPI alone. Where a wheel directory (``$MOE_WHEELS``, default /opt/wheels) holds a build
of a locked version whose hash the lock also lists (our local ``torch-2.13.0+cpu`` wheel), pip
is pointed at it, and the CUDA libraries that only PyPI's Linux torch needs are left out.

    python scripts/install_lock.py install requirements/cpu.lock [pip args...]
    python scripts/install_lock.py add-hashes requirements/cpu.lock   # after `uv pip compile`

Runs before anything is installed, so it uses only the standard library and pip's vendored
``packaging``.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

try:
    from packaging.tags import sys_tags
    from packaging.utils import canonicalize_name, parse_wheel_filename
    from packaging.version import Version
except ImportError:  # a fresh venv: pip's copy
    from pip._vendor.packaging.tags import sys_tags
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename
    from pip._vendor.packaging.version import Version

CUDA_ONLY = re.compile(r"^(nvidia-|cuda-)")


@dataclass
class Entry:
    name: str
    version: str
    text: str
    hashes: set[str] = field(default_factory=set)
    via: set[str] = field(default_factory=set)


def parse_lock(text: str) -> tuple[str, list[Entry]]:
    """(header, entries) of a `uv pip compile --generate-hashes` file."""
    blocks = re.split(r"\n(?=[A-Za-z0-9])", text)
    header = "" if re.match(r"^[A-Za-z0-9]", blocks[0]) else blocks.pop(0) + "\n"
    entries = []
    for block in blocks:
        m = re.match(r"^([A-Za-z0-9_.\-]+)==([^\s\\;]+)", block)
        if not m:
            raise SystemExit(f"error: cannot parse lock entry {block.splitlines()[0]!r}")
        via = set(re.findall(r"#\s+(?:via\s+)?([A-Za-z0-9_.\-]+)\s*$", block, flags=re.M)) - {"via"}
        entries.append(
            Entry(
                canonicalize_name(m.group(1)),
                m.group(2),
                block.rstrip("\n") + "\n",
                set(re.findall(r"--hash=sha256:([0-9a-f]{64})", block)),
                {canonicalize_name(v) for v in via},
            )
        )
    return header, entries


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def local_wheels(entries: list[Entry], wheel_dir: Path, any_platform: bool = False) -> dict[str, tuple[Path, str]]:
    """name -> (wheel, sha256) for wheels in ``wheel_dir`` of a locked version (local label ignored)."""
    if not wheel_dir.is_dir():
        return {}
    pins = {e.name: Version(e.version) for e in entries}
    supported = set(sys_tags())
    found = {}
    for whl in sorted(wheel_dir.glob("*.whl")):
        name, version, _, tags = parse_wheel_filename(whl.name)
        if name in pins and Version(version.public) == pins[name] and (any_platform or tags & supported):
            found[name] = (whl, sha256(whl))
    return found


def add_hashes(lock: Path, wheel_dir: Path) -> list[str]:
    """Add the hashes of local wheels of locked versions to their entries (kept on relock by the Makefile)."""
    header, entries = parse_lock(lock.read_text())
    added = []
    for e in entries:
        whl = local_wheels(entries, wheel_dir, any_platform=True).get(e.name)
        if whl and whl[1] not in e.hashes:
            first, rest = e.text.split("\n", 1)
            e.text = f"{first}\n    --hash=sha256:{whl[1]} \\\n{rest}"
            e.hashes.add(whl[1])
            added.append(whl[0].name)
    lock.write_text(header + "".join(e.text for e in entries))
    return added


def local_lock(text: str, wheel_dir: Path) -> tuple[str, list[str]]:
    """The lock to install here: unchanged, or without the CUDA-only packages when a locked local
    CPU torch wheel (its hash in the lock) is present for this interpreter."""
    header, entries = parse_lock(text)
    local = {n: w for n, w in local_wheels(entries, wheel_dir).items() if w[1] in next(e.hashes for e in entries if e.name == n)}
    for e in entries:  # pin the local build's exact version: pip prefers index files whose hash it can see
        if e.name in local:
            version = str(parse_wheel_filename(local[e.name][0].name)[1])
            e.text = re.sub(r"^([A-Za-z0-9_.\-]+)==[^\s\\;]+", lambda m, v=version: f"{m.group(1)}=={v}", e.text)
    torch = local.get("torch")
    if not torch or "+cpu" not in torch[0].name:
        return header + "".join(e.text for e in entries), [w.name for w, _ in local.values()]
    dropped: set[str] = set()
    changed = True
    while changed:  # packages needed only by PyPI's CUDA torch (or by other such packages)
        changed = False
        for e in entries:
            if e.name not in dropped and CUDA_ONLY.match(e.name) and e.via and e.via <= {"torch", *dropped}:
                dropped.add(e.name)
                changed = True
    kept = [e for e in entries if e.name not in dropped]
    return header + "".join(e.text for e in kept), [w.name for w, _ in local.values()]


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in ("install", "add-hashes"):
        print(__doc__, file=sys.stderr)
        return 2
    mode, lock, pip_args = argv[0], Path(argv[1]), argv[2:]
    wheel_dir = Path(os.environ.get("MOE_WHEELS", "/opt/wheels"))
    if not lock.is_file():
        print(f"error: {lock}: not found", file=sys.stderr)
        return 2
    if mode == "add-hashes":
        for name in add_hashes(lock, wheel_dir):
            print(f"{lock}: added the hash of {wheel_dir / name}")
        return 0
    text, used = local_lock(lock.read_text(), wheel_dir)
    links = ["--find-links", str(wheel_dir)] if used else []
    for name in used:
        print(f"using the local wheel {wheel_dir / name}")
    with tempfile.NamedTemporaryFile("w", suffix=".lock", delete=False) as f:
        f.write(text)
    try:
        return subprocess.call([sys.executable, "-m", "pip", "install", "--require-hashes", *links, "-r", f.name, *pip_args])
    finally:
        os.unlink(f.name)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
