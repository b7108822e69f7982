"""NVSHMEM teardown: after a failure on this rank nothing collective is attempted (it could only
wait for ranks that are still training); after a clean run it is finalised once, and a failure
inside the teardown is reported without changing the run's outcome."""

import atexit

import pytest

from moe.parallel import transport


class _Untouchable:
    """Stands in for the nvshmem module: any use is a collective this test forbids."""

    def __getattr__(self, name):
        raise AssertionError(f"nvshmem.{name} called during a failed run's teardown")


@pytest.fixture
def nv_state():
    saved = dict(transport._NV_STATE)
    yield transport._NV_STATE
    transport._NV_STATE.clear()
    transport._NV_STATE.update(saved)


def test_failed_rank_drops_nvshmem_without_collectives(nv_state):
    nv_state.update({"nv": _Untouchable(), "transports": []})
    atexit.register(transport._finalize)
    transport.shutdown(clean=False)
    assert "nv" not in nv_state and "transports" not in nv_state
    transport._finalize()  # what interpreter exit would run: nothing left to finalize


def test_clean_teardown_reports_a_failure_and_goes_on(nv_state, capsys):
    class _Broken:
        def finalize(self):
            raise RuntimeError("peer gone")

    nv_state.update({"nv": _Broken(), "transports": []})
    transport.shutdown(clean=True, timeout_s=30)
    assert "nv" not in nv_state
    assert "NVSHMEM teardown failed" in capsys.readouterr().err


def test_nothing_to_do_without_nvshmem(nv_state):
    nv_state.clear()
    transport.shutdown(clean=True)
    transport.shutdown(clean=False)
