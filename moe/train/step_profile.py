"""Where one training step's time goes: a torch.profiler trace summed into named categories.

The paper stages split each claim's gap into measured parts (issue 29): expert GEMMs, dense
GEMMs, attention, dispatch (token permutation and combine), FP8 quantisation, gradient
accumulation over micro-batches, gradient sync (reduction and norm), the optimizer step, and
the rest. A kernel's category comes, in this order, from its own name (Triton quantisation and
attention kernels), from the innermost ``moe.<category>`` range around the op that launched it
(``moe.spans.span``, opened by the library at its seams), then from the innermost aten op or
autograd node it ran under; anything else is ``other``. On CPUs the same tree is summed over
each op's own CPU time instead (tests; the numbers there are not GPU numbers).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch

from moe.spans import CATEGORIES

PREFIX = "profile/"
# The "launched by" of a kernel whose launch torch's profiler linked to no CPU op: kineto links a
# kernel to the op around its launch, and a record_function range is not one (the Triton AdamW
# step runs inside the optimizer's range only). Such kernels are categorised by their own name.
UNLINKED = "(no launching op)"

# Substrings of a kernel's own name (lower case). The expert weight-gradient GEMM that adds into
# the accumulator (moe/kernels/grouped_wgrad.py) counts as expert GEMM time, the add included.
# train.layout_invariant's fixed-point kernels (moe/kernels/fixed_point.py) are gradient accumulation
# and the norm, not FP8 quantisation.
_KERNEL_RULES = (
    ("grouped_wgrad", "expert_gemm"),
    ("observe_quantize_add", "grad_accumulation"),
    ("_dequantize", "grad_accumulation"),
    ("_square_sums", "optimizer"),
    ("_adamw_kernel", "optimizer"),  # moe/kernels/adamw.py (optim.step_kernel: triton)
    ("quant", "fp8_quantize"),
    ("flash", "attention"),
    ("fmha", "attention"),
    ("sdpa", "attention"),
)
# Substrings of an enclosing op's name (lower case), innermost op first.
_OP_RULES = (
    ("scaled_dot_product", "attention"),
    ("attention", "attention"),
    ("grouped_mm", "expert_gemm"),
    ("accumulategrad", "grad_accumulation"),
    # the backward nodes of the dispatchers' own autograd functions (forward: the span)
    ("_gatherrowsbackward", "dispatch"),
    ("_combinebackward", "dispatch"),
    ("_alltoallbackward", "dispatch"),
    ("_exchangebackward", "dispatch"),
    ("indexselectbackward", "dispatch"),
    ("fsdp::", "grad_sync"),  # FSDP2's own ranges: all-gathers, reduce-scatters and their copies
    ("optimizer.step", "optimizer"),
    ("optimizer.zero_grad", "optimizer"),
    ("_fused_adam", "optimizer"),
)
_DENSE_GEMMS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear", "aten::_scaled_mm"}
# CUPTI's marker for a launch that waited on a full queue (a CPU event sharing the launch's id,
# and sometimes listed as a device record spanning the wait).
_NOT_KERNELS = ("command buffer full",)


def _chain(event: Any) -> Iterator[str]:
    while event is not None:
        yield event.name
        event = event.cpu_parent


def _from_chain(names: list[str]) -> str:
    for name in names:  # the library's own ranges win, innermost first
        if name.startswith("moe.") and name[4:] in CATEGORIES:
            return name[4:]
    for name in names:
        low = name.lower()
        if name in _DENSE_GEMMS:
            return "dense_gemm"
        for needle, category in _OP_RULES:
            if needle in low:
                return category
    return "other"


def _from_kernel(kernel_name: str, chain_category: str) -> str:
    low = kernel_name.lower()
    for needle, category in _KERNEL_RULES:
        if needle in low:
            return category
    return chain_category


def _launch_rank(e: Any) -> tuple[bool, float]:
    """Among CPU events sharing an id: an op before CUPTI's marker, then the shortest."""
    return e.name.lower().startswith(_NOT_KERNELS), e.time_range.elapsed_us()


def attribute(events: Any, on_device: bool) -> Iterator[tuple[str, str, str, float]]:
    """(category, kernel or op name, the op that launched it, ms) for every piece of time in a
    profiler's ``events()``: kernel time on a GPU (GPU mirrors of ranges and markers left out),
    each op's own CPU time otherwise. Device time no CPU op launched is attributed by the
    kernel's name (``UNLINKED``), so the categories sum to the trace's device records.

    torch lists a kernel under every CPU event with its launch's correlation id, and ids are
    not unique (a range and an op can share one): each id's kernels are taken once, from the
    shortest CPU event with that id (the op that launched them, not a range around it)."""
    cpu = torch.autograd.DeviceType.CPU
    launcher: dict[int, Any] = {}
    # GPU mirrors of ranges: never kernels, whichever CPU event they were listed under
    mirrors = {e.name for e in events if e.device_type != cpu and getattr(e, "is_user_annotation", False)}
    for e in events:
        if e.device_type != cpu or getattr(e, "is_async", False):
            continue
        if not on_device:
            if e.self_cpu_time_total:
                yield _from_chain(list(_chain(e))), e.name, e.name, e.self_cpu_time_total / 1e3
            continue
        if e.kernels:
            held = launcher.get(e.id)
            if held is None or _launch_rank(e) < _launch_rank(held):
                launcher[e.id] = e
    linked: dict[str, float] = {}
    for op in launcher.values():
        chain_category = _from_chain(list(_chain(op)))
        for k in op.kernels:
            if k.name == op.name or k.name in mirrors or k.name.startswith("moe.") or k.name.lower().startswith(_NOT_KERNELS):
                continue  # the GPU mirror of a range, or a marker
            linked[k.name] = linked.get(k.name, 0.0) + k.duration
            yield _from_kernel(k.name, chain_category), k.name, op.name, k.duration / 1e3
    if on_device:  # kernels no CPU op launched (a Triton launch inside a bare range): by name
        for name, us in _device_time(events, mirrors).items():
            if us - linked.get(name, 0.0) > 0.5:
                yield _from_kernel(name, "other"), name, UNLINKED, (us - linked.get(name, 0.0)) / 1e3


def _device_time(events: Any, mirrors: set[str]) -> dict[str, float]:
    """Microseconds per kernel name over the trace's device records (ranges and markers left out)."""
    out: dict[str, float] = {}
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CPU or getattr(e, "is_user_annotation", False):
            continue
        if e.name in mirrors or e.name.startswith("moe.") or e.name.lower().startswith(_NOT_KERNELS):
            continue
        out[e.name] = out.get(e.name, 0.0) + e.time_range.elapsed_us()
    return out


def categorize(events: Any, on_device: bool) -> dict[str, float]:
    """Milliseconds per category (:func:`attribute` summed)."""
    out = dict.fromkeys(CATEGORIES, 0.0)
    for category, _, _, ms in attribute(events, on_device):
        out[category] += ms
    return out


def top_entries(events: Any, on_device: bool, rows: int = 30) -> list[tuple[str, str, str, float, int]]:
    """The ``rows`` largest (category, kernel, launching op) groups: ms and count."""
    groups: dict[tuple[str, str, str], list[float]] = {}
    for category, kernel, op, ms in attribute(events, on_device):
        g = groups.setdefault((category, kernel[:80], op[:60]), [0.0, 0])
        g[0] += ms
        g[1] += 1
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])[:rows]
    return [(c, k, o, ms, int(n)) for (c, k, o), (ms, n) in ranked]


def idle_gaps(events: Any, rows: int = 10) -> tuple[float, list[tuple[float, str, str]]]:
    """Where the GPU waited between kernels: (the idle milliseconds between the first kernel's
    start and the last one's end, over all streams together; the ``rows`` longest gaps as (ms,
    the kernel before, the kernel after))."""
    spans = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in events
        if e.device_type != torch.autograd.DeviceType.CPU
        and not getattr(e, "is_user_annotation", False)
        and not e.name.startswith("moe.")
        and not e.name.lower().startswith(_NOT_KERNELS)
    )
    idle, gaps, end, before = 0.0, [], None, ""
    for start, stop, name in spans:
        if end is not None and start > end:
            idle += start - end
            gaps.append(((start - end) / 1e3, before, name))
        if end is None or stop > end:
            end, before = stop, name
    return idle / 1e3, sorted(gaps, reverse=True)[:rows]


class StepProfiler:
    """Profile what runs between ``start()`` and ``stop()`` (one training step); ``stop()``
    returns ``profile/<category>_ms``, ``profile/total_ms`` (their sum) and ``profile/wall_ms``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._prof: Any = None
        self._t0 = 0.0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start(self) -> StepProfiler:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        self._sync()
        self._prof = profile(activities=activities, acc_events=True)
        self._prof.__enter__()
        self._t0 = time.perf_counter()
        return self

    def stop(self, keep_events: bool = False) -> dict[str, float]:
        """The figures; ``keep_events``: keep the trace's events in ``self.events`` too."""
        self._sync()
        wall = (time.perf_counter() - self._t0) * 1e3
        self._prof.__exit__(None, None, None)
        events = self._prof.events()
        per = categorize(events, self.device.type == "cuda")
        self.events = events if keep_events else None
        self._prof = None
        metrics = {f"{PREFIX}{c}_ms": v for c, v in per.items()}
        metrics[f"{PREFIX}total_ms"] = sum(per.values())
        metrics[f"{PREFIX}wall_ms"] = wall
        return metrics
