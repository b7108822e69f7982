import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_lock_files_match_pyproject():
    r = subprocess.run([sys.executable, str(REPO / "scripts/check_lock.py")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_dockerfile_parses_with_charliecloud_rules():
    text = (REPO / "containers/Dockerfile").read_text()
    assert "FROM $BASE_IMAGE" in text and "FROM ${" not in text  # ch-image 0.31 rejects braces
    assert "--require-hashes" in text
    assert "@sha256:" in text.split("ARG BASE_IMAGE=", 1)[1].splitlines()[0]
