"""Build CI's CPU image: debootstrap makes a Debian root filesystem, Charliecloud imports it as
the base, `make container` builds containers/Dockerfile on it with the CPU lock and exports a
directory image. A script, so that the test session can start it in the background when it
starts (tests/conftest.py): the build waits minutes on the network and the disk, which the
test workers use meanwhile; the container tests' fixture then waits for its result file.

    python -m tests.containers.image_build RESULT.json     # writes {"ok": ..., ...} atomically
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOTFS = Path("/var/tmp/moe-ci-rootfs")
IMAGE_DIR = Path("/var/tmp/moe-images/moe-cpu")
TOOLS = ("debootstrap", "ch-image", "ch-run", "ch-convert")


def missing() -> str | None:
    """Why the image cannot be built here, or None."""
    for tool in TOOLS:
        if not shutil.which(tool):
            return f"{tool} not installed (apt-get install debootstrap charliecloud-runtime charliecloud-builders python3-lark)"
    if os.geteuid() != 0:
        return "debootstrap needs root"
    return None


def _sh(*cmd, timeout=1200, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "USER": os.environ.get("USER", "root")}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, **kw)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r


def build() -> dict:
    """The image at IMAGE_DIR; {"dir", "build_s", "log"}. Raises RuntimeError with the failing step's output."""
    t0 = time.time()
    if not (ROOTFS / "usr/bin/python3").exists():
        shutil.rmtree(ROOTFS, ignore_errors=True)
        _sh(
            "debootstrap",
            "--variant=minbase",
            "--include=python3,python3-venv,python3-pip,ca-certificates",
            "bookworm",
            str(ROOTFS),
            "http://deb.debian.org/debian",
        )
        for entry in (ROOTFS / "dev").iterdir():  # device nodes would be copied as files
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
    _sh("/usr/bin/python3", shutil.which("ch-image"), "import", str(ROOTFS), "moe-ci-base")
    r = _sh(
        "make",
        "container",
        "BASE_IMAGE=moe-ci-base",
        "LOCK=requirements/cpu.lock",
        "TAG=moe:cpu",
        f"IMAGE_DIR={IMAGE_DIR}",
        f"BIN={Path(sys.executable).parent}",
        cwd=REPO,
        timeout=2400,
    )
    return {"dir": str(IMAGE_DIR), "build_s": time.time() - t0, "log": r.stdout}


def _selected(config) -> bool:
    """Whether this session takes in the container tests (only then is a minutes-long build started)."""
    if "not slow" in (config.option.markexpr or ""):
        return False
    target = REPO / "tests" / "containers"
    for arg in config.args:
        path = (config.invocation_params.dir / arg.split("::")[0]).resolve()
        if path == target or target.is_relative_to(path) or path.is_relative_to(target):
            return True
    return False


def start_in_background(config) -> Path | None:
    """On the session's controller: start the build when this session runs the container tests;
    the path its result will be written to (None: not started)."""
    if missing() or not _selected(config):
        return None
    folder = Path(tempfile.mkdtemp(prefix="moe-image-build-"))
    with open(folder / "build.log", "w") as log:
        config._image_build = subprocess.Popen(
            [sys.executable, "-m", "tests.containers.image_build", str(folder / "result.json")],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return folder / "result.json"


def stop_background(config) -> None:
    """At the session's end: a build still running (the container tests were deselected or failed early) is stopped."""
    proc = getattr(config, "_image_build", None)
    if proc is not None and proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)


def background_result(config) -> Path | None:
    """Where this session's background build writes its result (a worker reads it from its input)."""
    worker = getattr(config, "workerinput", None)
    value = worker.get("image_build") if worker is not None else getattr(config, "image_build", None)
    return Path(value) if value else None


def main(result: Path) -> int:
    try:
        why = missing()
        out = {"ok": False, "error": why} if why else {"ok": True, **build()}
    except Exception as e:  # noqa: BLE001 - the waiting fixture reports it
        out = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    tmp = result.with_suffix(".tmp")
    tmp.write_text(json.dumps(out))
    tmp.replace(result)
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
