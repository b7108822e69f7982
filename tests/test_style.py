"""`make lint` as a test: ruff's lint rules and its formatting hold for the whole tree."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TREE = ["moe", "pipeline", "bench", "scripts", "tests"]


def _ruff() -> str:
    found = Path(sys.executable).with_name("ruff")
    if found.is_file():
        return str(found)
    path = shutil.which("ruff")
    if path is None:
        pytest.skip("ruff is not installed (it is in requirements/cpu.lock)")
    return path


@pytest.mark.parametrize("args", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff(args):
    r = subprocess.run([_ruff(), *args, *TREE], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
