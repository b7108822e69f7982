import pytest
import torch

from tests.helpers import make_corpus


@pytest.fixture
def corpus(tmp_path):
    d = tmp_path / "tokens"
    d.mkdir()
    make_corpus(d)
    return d


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


def pytest_terminal_summary(terminalreporter):
    """The hostile-input tables and their counts (tests/pipeline/hostile.py), when any ran."""
    import sys

    hostile = sys.modules.get("tests.pipeline.hostile")
    if hostile is not None:
        for line in hostile.summary_lines():
            terminalreporter.write_line(line)


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB file system (tmpfs; needs root, as CI runs): writes past it fail with ENOSPC."""
    import os
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mount = tmp_path / "small"
    mount.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
