"""Every command the README shows runs as written: here, in a trained workspace (slow,
tests/pipeline/test_dvc_e2e.py), or where it needs what this machine lacks (a GPU, a Slurm
job, a container builder), with the test that covers it named. A new README command must be
added to one of these lists."""

import os
import subprocess

import pytest

from tests.readme_commands import ELSEWHERE, GPU, HERE, REPO, WORKSPACE, argv, readme_commands


def test_every_readme_command_is_accounted_for():
    found = readme_commands()
    known = HERE | GPU | set(WORKSPACE) | set(ELSEWHERE)
    assert not [c for c in found if c not in known], "README commands with no test: classify them here"
    assert not [c for c in known if c not in found], "stale entries: the README no longer shows them"


@pytest.mark.parametrize("cmd", sorted(HERE))
def test_readme_command_runs_here(cmd, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run(argv(cmd), cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip()


@pytest.mark.parametrize("cmd", sorted(GPU))
def test_gpu_readme_command_parses(cmd):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([*argv(cmd), "--help"], cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "usage" in (r.stdout + r.stderr).lower()
