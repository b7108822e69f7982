"""A Slurm task's torch threads: sized to its CPUs, unless the job was given OMP_NUM_THREADS
(several node daemons sharing one host's cores, as the local test cluster does)."""

import pytest
import torch

from pipeline.slurm_task import _set_threads


@pytest.fixture(autouse=True)
def _restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_threads_follow_the_task_s_cpus(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "3")
    _set_threads(1)
    assert torch.get_num_threads() == 3 and __import__("os").environ["OMP_NUM_THREADS"] == "3"


def test_a_given_omp_num_threads_wins_and_a_malformed_one_falls_back(monkeypatch):
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    monkeypatch.setenv("SLURM_CPUS_ON_NODE", "4")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    _set_threads(2)
    assert torch.get_num_threads() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "4,2")
    _set_threads(2)
    assert torch.get_num_threads() == 2  # 4 CPUs over 2 tasks
