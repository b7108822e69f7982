"""Prove a lock installs from PyPI alone on every supported Python and platform (CI, network).

For each target, ``uv pip install --dry-run --no-config --require-hashes`` resolves the lock
against https://pypi.org/simple with this machine's pip/uv configuration ignored; then every
package it would install must have a file on PyPI for that target (a compatible wheel, or an
sdist where no wheel exists) whose sha256 the lock lists (uv's dry run does not check hashes).

    python scripts/resolve_lock.py [requirements/cpu.lock]
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from functools import cache
from pathlib import Path

from packaging.tags import compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_sdist_filename, parse_wheel_filename
from packaging.version import Version

sys.path.insert(0, str(Path(__file__).resolve().parent))
from install_lock import parse_lock  # noqa: E402

INDEX = "https://pypi.org/simple"
PYTHONS = ("3.11", "3.12", "3.13")
# uv's --python-platform name -> the wheel platform tags it accepts
PLATFORMS = {
    "x86_64-manylinux_2_28": [f"manylinux_2_{m}_x86_64" for m in range(28, 4, -1)]
    + ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64"],
    "aarch64-manylinux_2_28": [f"manylinux_2_{m}_aarch64" for m in range(28, 16, -1)] + ["manylinux2014_aarch64", "linux_aarch64"],
    "aarch64-apple-darwin": [f"macosx_{v}_0_{a}" for v in range(14, 10, -1) for a in ("arm64", "universal2")]
    + [f"macosx_10_{m}_universal2" for m in range(16, 8, -1)],
}
MACOSX_DEPLOYMENT_TARGET = "14.0"  # torch's macOS wheels are macosx_14_0_arm64


@cache
def pypi_files(name: str) -> list[dict]:
    req = urllib.request.Request(f"{INDEX}/{name}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)["files"]


def target_tags(python: str, platform: str) -> set:
    ver = tuple(int(x) for x in python.split("."))
    plats = PLATFORMS[platform]
    return set(cpython_tags(ver, platforms=plats)) | set(compatible_tags(ver, f"cp{ver[0]}{ver[1]}", plats))


def resolve(lock: Path, python: str, platform: str) -> list[tuple[str, str]]:
    """(name, version) uv would install for the target, from PyPI alone."""
    uv = shutil.which("uv") or str(Path(sys.executable).parent / "uv")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UV_", "PIP_"))}
    env["MACOSX_DEPLOYMENT_TARGET"] = MACOSX_DEPLOYMENT_TARGET
    with tempfile.TemporaryDirectory() as target:
        r = subprocess.run(
            [
                uv,
                "pip",
                "install",
                "--dry-run",
                "--no-config",
                "--require-hashes",
                "--index-url",
                INDEX,
                "--python-version",
                python,
                "--python-platform",
                platform,
                "--target",
                target,
                "-r",
                str(lock),
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
    if r.returncode != 0:
        raise RuntimeError(f"{lock} does not resolve for Python {python} on {platform}:\n{r.stderr[-3000:]}")
    return re.findall(r"^ \+ ([A-Za-z0-9_.\-]+)==(\S+)$", r.stderr + r.stdout, flags=re.M)


def problems(lock: Path, python: str, platform: str) -> list[str]:
    _, entries = parse_lock(lock.read_text())
    hashes: dict[tuple[str, Version], set[str]] = {}
    for e in entries:
        hashes.setdefault((e.name, Version(e.version)), set()).update(e.hashes)
    tags = target_tags(python, platform)
    out = []
    for name, version in resolve(lock, python, platform):
        name, version = canonicalize_name(name), Version(version)
        wheels, sdists = [], []
        for f in pypi_files(name):
            fn = f["filename"]
            if fn.endswith(".whl"):
                try:
                    _, v, _, ftags = parse_wheel_filename(fn)
                except ValueError:  # ancient non-standard names
                    continue
                if v == version and ftags & tags:
                    wheels.append(f)
            elif fn.endswith((".tar.gz", ".zip")):
                try:
                    if parse_sdist_filename(fn)[1] == version:
                        sdists.append(f)
                except ValueError:
                    pass
        usable = wheels or sdists
        if not usable:
            out.append(f"{name}=={version}: no file on PyPI for Python {python} on {platform}")
        elif not any(f["hashes"].get("sha256") in hashes.get((name, version), set()) for f in usable):
            out.append(f"{name}=={version}: the lock lists no hash of its PyPI files for Python {python} on {platform}")
    return out


def main(argv: list[str]) -> int:
    lock = Path(argv[0] if argv else "requirements/cpu.lock")
    bad = 0
    for python in PYTHONS:
        for platform in PLATFORMS:
            found = problems(lock, python, platform)
            bad += len(found)
            print(f"{lock} Python {python} {platform}: {'ok' if not found else f'{len(found)} problems'}")
            for line in found:
                print(f"  {line}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
