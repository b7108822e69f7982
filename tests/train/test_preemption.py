"""Stop requests agreed over real gloo ranks: when one rank gets the signal, every rank stops
at the same step and names that signal (the rank-0 log a Slurm user reads says why)."""

import os
import signal

import pytest

from tests.parallel.dist_utils import run_ranks

pytestmark = pytest.mark.distributed


def _agree(rank, world):
    from moe.train.preemption import StopRequest

    stop = StopRequest().install()
    before = stop.agreed()  # nobody asked yet
    if rank == world - 1:
        os.kill(os.getpid(), signal.SIGUSR2)  # only the last rank gets the signal
    return before, stop.agreed(), stop.signum


def test_a_signal_on_one_rank_stops_every_rank_and_each_names_it():
    results = run_ranks(_agree, 2)
    assert [r[0] for r in results] == [False, False]
    assert [r[1] for r in results] == [True, True]
    assert [r[2] for r in results] == [signal.SIGUSR2, signal.SIGUSR2]
