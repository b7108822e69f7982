import json

import pytest
import torch

from moe.config import ConfigError
from moe.spans import CATEGORIES, span
from moe.train.sinks import JsonlSink
from moe.train.step_profile import categorize
from moe.train.trainer import Trainer
from tests.helpers import tiny_config


def test_a_profiled_step_says_where_its_time_went_and_stays_out_of_the_throughput(tmp_path, corpus):
    cfg = tiny_config(
        corpus,
        tmp_path / "ck",
        precision={"recipe": "bf16"},
        train={"max_steps": 5, "log_every": 2, "profile_step": 3},
        optim={"expert_grad_accum": "bf16"},
    )
    summary = Trainer(cfg, sinks=[JsonlSink(tmp_path / "m.jsonl")]).fit()
    rows = {r["step"]: r for r in map(json.loads, (tmp_path / "m.jsonl").read_text().splitlines())}
    profiled = rows[3]
    parts = {c: profiled[f"profile/{c}_ms"] for c in CATEGORIES}
    assert sum(parts.values()) == pytest.approx(profiled["profile/total_ms"])
    assert profiled["profile/wall_ms"] > 0
    # A step of the tiny model does every kind of work but FP8 and a reduction (one process).
    for c in ("expert_gemm", "dense_gemm", "attention", "dispatch", "grad_accumulation", "optimizer", "other"):
        assert parts[c] > 0, (c, parts)
    assert parts["fp8_quantize"] == 0
    # The profiled step is not in any interval's throughput: its own row has none, and the
    # interval it interrupted (steps 3-4) counts only step 4.
    assert "tokens_per_s" not in profiled
    assert "tokens_per_s" in rows[4] and "tokens_per_s" in rows[5]
    assert all("profile/total_ms" not in r for s, r in rows.items() if s != 3)
    assert summary.steps == 5 and sorted(summary.losses) == [1, 2, 3, 4, 5]


def test_the_profile_of_the_last_step_leaves_the_earlier_interval_as_the_throughput(tmp_path, corpus):
    cfg = tiny_config(corpus, tmp_path / "ck", train={"max_steps": 4, "log_every": 3, "profile_step": 4})
    Trainer(cfg, sinks=[JsonlSink(tmp_path / "m.jsonl")]).fit()
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    timed = [r for r in rows if "tokens_per_s_per_device" in r]
    assert [r["step"] for r in timed] == [3]
    assert "profile/expert_gemm_ms" in rows[-1] and rows[-1]["step"] == 4


def test_profile_step_outside_the_run_is_refused(tmp_path, corpus):
    with pytest.raises(ConfigError, match=r"train\.profile_step: must lie in \[0, train\.max_steps=6\]"):
        tiny_config(corpus, tmp_path / "ck", train={"profile_step": 7})


def test_library_ranges_win_over_op_names_innermost_first():
    from torch.profiler import ProfilerActivity, profile

    a = torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with span("optimizer"):
            for _ in range(20):
                a @ a  # a dense GEMM, but inside the optimizer's range
            with span("grad_accumulation"):
                for _ in range(20):
                    a.add_(1.0)
        for _ in range(20):
            a @ a
    parts = categorize(prof.events(), on_device=False)
    assert parts["optimizer"] > 0 and parts["grad_accumulation"] > 0 and parts["dense_gemm"] > 0
    assert parts["expert_gemm"] == parts["attention"] == 0


def test_an_unknown_span_is_refused():
    with pytest.raises(ValueError, match="unknown profile category 'gemm'"):
        span("gemm")


def _event(name, eid, dur, kernels=(), parent=None, device=torch.autograd.DeviceType.CPU, annotation=False):
    """A synthetic profiler event shaped like torch's (the fields step_profile reads)."""
    from types import SimpleNamespace as NS

    return NS(
        name=name,
        id=eid,
        device_type=device,
        is_async=False,
        is_user_annotation=annotation,
        cpu_parent=parent,
        kernels=[NS(name=k, duration=d) for k, d in kernels],
        time_range=NS(elapsed_us=lambda dur=dur: dur),
    )


def test_gpu_attribution_counts_each_launch_once_and_skips_mirrors_and_markers():
    """The device path on synthetic events shaped like torch's: a kernel is listed under every
    CPU event sharing its correlation id (here a range and the op inside it), GPU mirrors of
    ranges and CUPTI's queue-full marker ride along as 'kernels'."""
    from moe.train.step_profile import attribute

    cuda, ev = torch.autograd.DeviceType.CUDA, _event

    step = ev("moe.optimizer", 1, 1000, kernels=[("moe.optimizer", 900.0)])
    adam = ev("aten::_fused_adamw_", 7, 100, kernels=[("multi_tensor_apply_kernel", 50.0)], parent=step)
    shared = ev("moe.grad_sync", 7, 400, kernels=[("multi_tensor_apply_kernel", 50.0)])  # same id as adam
    gemm = ev("aten::_grouped_mm", 9, 80, kernels=[("cutlass_grouped_kernel", 300.0), ("Command Buffer Full", 5000.0)])
    marker = ev("Command Buffer Full", 9, 10, kernels=[("cutlass_grouped_kernel", 300.0)], parent=gemm)
    mirror = ev("moe.optimizer", 0, 900, device=cuda, annotation=True)
    rows = list(attribute([step, adam, shared, gemm, marker, mirror], on_device=True))
    assert sorted((c, k, op, ms) for c, k, op, ms in rows) == [
        ("expert_gemm", "cutlass_grouped_kernel", "aten::_grouped_mm", 0.3),
        ("optimizer", "multi_tensor_apply_kernel", "aten::_fused_adamw_", 0.05),
    ]


def test_the_weight_gradient_gemm_that_accumulates_counts_as_expert_gemm_time():
    from moe.train.step_profile import _from_kernel

    assert _from_kernel("_grouped_wgrad_kernel", "other") == "expert_gemm"
    assert _from_kernel("_quant_rows_kernel", "other") == "fp8_quantize"


def test_the_fixed_point_kernels_are_accumulation_and_norm_not_fp8():
    from moe.train.step_profile import _from_kernel

    assert _from_kernel("_observe_quantize_add", "other") == "grad_accumulation"
    assert _from_kernel("_dequantize", "other") == "grad_accumulation"
    assert _from_kernel("_square_sums", "other") == "optimizer"


def test_the_triton_adamw_step_is_optimizer_time():
    from moe.train.step_profile import _from_kernel

    assert _from_kernel("_adamw_kernel", "other") == "optimizer"


def test_device_time_no_op_launched_is_attributed_by_kernel_name():
    """A Triton kernel launched inside a bare range has no CPU launcher in torch's trace (the
    AdamW step measured 26 ms of such kernels on an H200): its device records still count,
    once, by name; linked launches of the same name are not counted twice."""
    from moe.train.step_profile import UNLINKED, attribute

    cuda, ev = torch.autograd.DeviceType.CUDA, _event

    op = ev("aten::add_", 3, 20, kernels=[("add_kernel", 40.0)])
    events = [
        op,
        ev("add_kernel", 0, 40.0, device=cuda),  # the linked launch's own device record
        ev("_adamw_kernel", 0, 600.0, device=cuda),
        ev("_adamw_kernel", 0, 400.0, device=cuda),
        ev("moe.optimizer", 0, 1200.0, device=cuda, annotation=True),  # a range's GPU mirror
    ]
    rows = sorted(attribute(events, on_device=True))
    assert rows == [("optimizer", "_adamw_kernel", UNLINKED, 1.0), ("other", "add_kernel", "aten::add_", 0.04)]


def test_idle_gaps_are_the_time_no_stream_ran_a_kernel():
    """Two streams overlap (no gap), then the GPU waits 300 us and 50 us; ranges' GPU mirrors and
    CUPTI's markers are not kernels."""
    from types import SimpleNamespace as NS

    from moe.train.step_profile import idle_gaps

    cuda = torch.autograd.DeviceType.CUDA

    def kernel(name, start, end, annotation=False):
        return NS(name=name, device_type=cuda, is_user_annotation=annotation, time_range=NS(start=start, end=end))

    events = [
        kernel("gemm", 0, 1000),
        kernel("side_stream_add", 500, 1200),
        kernel("norm", 1500, 1600),
        kernel("moe.optimizer", 1600, 5000, annotation=True),
        kernel("Command Buffer Full", 1600, 3000),
        kernel("adamw", 1650, 1700),
    ]
    idle, gaps = idle_gaps(events)
    assert idle == 0.35
    assert gaps == [(0.3, "side_stream_add", "norm"), (0.05, "norm", "adamw")]
