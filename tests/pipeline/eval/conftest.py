"""The reference environment (ai2-olmo-eval with its own pins, and torch) that the task tests
compare against, built once under .venv-olmo-eval/ for every module that asks for it (under a
file lock: two test workers may ask at once)."""

from __future__ import annotations

import fcntl
import subprocess
import sys

import pytest

from tests.workspace import REPO

VENV = REPO / ".venv-olmo-eval"
LOCK = REPO / "requirements" / "olmo-eval-reference.lock"


@pytest.fixture(scope="session")
def reference_python():
    python = VENV / "bin" / "python"
    stamp = VENV / ".installed"
    with open(REPO / ".venv-olmo-eval.build-lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        if not (stamp.is_file() and stamp.read_text() == LOCK.read_text()):
            subprocess.run([sys.executable, "-m", "venv", "--clear", str(VENV)], check=True)
            subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--upgrade", "pip>=24"], check=True)
            r = subprocess.run(
                [str(python), str(REPO / "scripts/install_lock.py"), "install", str(LOCK), "-q", "--disable-pip-version-check"],
                capture_output=True,
                text=True,
                timeout=1800,
            )
            assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
            stamp.write_text(LOCK.read_text())
    return python
