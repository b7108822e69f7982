"""bench.common.kernel_overlap: the communication time no compute kernel hides, from a trace."""

from types import SimpleNamespace

import pytest

from bench.common import kernel_overlap


class _Range:
    def __init__(self, start: float, end: float) -> None:
        self.start, self.end = start, end

    def elapsed_us(self) -> float:
        return self.end - self.start


def _event(name: str, start: float, end: float, device: str = "CUDA"):
    return SimpleNamespace(name=name, time_range=_Range(start, end), device_type=SimpleNamespace(name=device))


def test_exposed_communication_is_what_no_compute_kernel_covers():
    trace = SimpleNamespace(
        events=lambda: [
            _event("gemm", 0, 100),
            _event("gemm", 90, 150),  # compute 0-150
            _event("ncclDevKernel_AllReduce", 120, 200),  # 30 us hidden, 50 exposed
            _event("ncclDevKernel_AllReduce", 180, 260),  # merges: comm 120-260
            _event("elementwise", 230, 240),  # hides 10 more
            _event("cudaLaunchKernel", 0, 1000, device="CPU"),  # host events are ignored
        ]
    )
    r = kernel_overlap(trace)
    assert r["comm_ms"] == pytest.approx(0.140)
    assert r["compute_ms"] == pytest.approx(0.160)
    assert r["exposed_comm_ms"] == pytest.approx(0.100)
