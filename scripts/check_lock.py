"""Check that the lock files match pyproject.toml: every dependency is pinned exactly, with
hashes, at a version its specifier accepts (run by the tests and `make lock-check`)."""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
GPU_PROVIDED = {"torch", "triton"}  # the NVIDIA base image provides these


def read_lock(path: Path) -> dict[str, tuple[Version, int]]:
    """name -> (pinned version, number of hashes)."""
    text = path.read_text()
    entries: dict[str, tuple[Version, int]] = {}
    for block in re.split(r"\n(?=[A-Za-z0-9])", text):
        m = re.match(r"^([A-Za-z0-9_.\-\[\]]+)==([^\s\\;]+)", block)
        if m:
            name = canonicalize_name(m.group(1).split("[")[0])
            entries[name] = (Version(m.group(2)), block.count("--hash=sha256:"))
    return entries


def problems() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project.get("optional-dependencies", {})
    cpu_reqs = [Requirement(r) for r in project["dependencies"] + extras["pipeline"] + extras["test"]]
    gpu_reqs = [Requirement(r) for r in project["dependencies"] + extras["pipeline"]]
    out = []
    for lock_name, reqs, skip in (("cpu.lock", cpu_reqs, set()), ("gpu.lock", gpu_reqs, GPU_PROVIDED)):
        path = ROOT / "requirements" / lock_name
        if not path.is_file():
            out.append(f"requirements/{lock_name}: missing (run `make lock`)")
            continue
        lock = read_lock(path)
        for name, (_, hashes) in lock.items():
            if hashes == 0:
                out.append(f"requirements/{lock_name}: {name} has no --hash")
        for req in reqs:
            name = canonicalize_name(req.name)
            if name in skip:
                continue
            if name not in lock:
                out.append(f"requirements/{lock_name}: {req.name} (pyproject: {req}) is not pinned; run `make lock`")
            elif not req.specifier.contains(lock[name][0], prereleases=True):
                out.append(f"requirements/{lock_name}: {req.name}=={lock[name][0]} does not satisfy pyproject's {req}; run `make lock`")
    return out


def main() -> int:
    found = problems()
    for line in found:
        print(line, file=sys.stderr)
    if not found:
        print("locks match pyproject.toml")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
