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


def test_a_result_with_nan_or_infinity_is_written_as_json_any_reader_takes(tmp_path):
    """A variant that was not timed (median NaN) or a ratio of nothing (inf) becomes null: NaN is
    not JSON, and `moe bench log` (pipeline.bench_tracking) refuses a file that holds it. The
    environment records the kernel switches the process ran with, as text."""
    import json
    import math

    from bench.common import environment, write_result
    from pipeline.bench_tracking import load_result

    payload = {
        "environment": environment(),
        "rows": [{"variant": "a", "median_ms": math.nan, "ratio": math.inf, "tflops": 1.5}],
        "matmul_peak_tflops": 700.0,
    }
    path = write_result("nan-check", payload, tmp_path)
    row = json.loads(path.read_text())["rows"][0]
    assert row == {"variant": "a", "median_ms": None, "ratio": None, "tflops": 1.5}
    load_result(path)


def test_the_environment_names_the_kernel_switches_as_text(monkeypatch):
    from bench.common import environment

    monkeypatch.setenv("MOE_WGRAD_ORDER", "index")
    monkeypatch.setenv("MOE_PIPELINE_KEY", "not-a-switch")
    assert environment()["switches"] == "MOE_WGRAD_ORDER=index"
    monkeypatch.delenv("MOE_WGRAD_ORDER")
    assert environment()["switches"] is None
