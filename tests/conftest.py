import os
import shutil
import subprocess

import pytest
import torch
import yaml

from tests.helpers import make_corpus, need_slurm
from tests.workspace import REPO, TINY_PARAMS, write_corpus


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


@pytest.fixture
def workspace(tmp_path, monkeypatch):
    """A pipeline working directory with a tiny corpus and params.yaml; cwd is set to it."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MOE_PIPELINE_KEY", raising=False)
    monkeypatch.setenv("PYTHONPATH", str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    write_corpus(tmp_path / "corpus")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(TINY_PARAMS, sort_keys=False))
    return tmp_path


@pytest.fixture(scope="session")
def slurm_cluster():
    if not (shutil.which("sbatch") and shutil.which("slurmctld")):
        need_slurm("Slurm is not installed (apt-get install slurmctld slurmd slurm-client munge)")
    if os.geteuid() != 0 and subprocess.run(["sinfo"], capture_output=True).returncode != 0:
        need_slurm("no running Slurm cluster and not root to start one")
    r = subprocess.run(["bash", str(REPO / "slurm/local/start.sh")], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        need_slurm(f"could not start the local Slurm cluster: {r.stderr[-500:]}")
    return True
