"""What is live at a run's peak of allocated GPU memory, grouped by where it was allocated.

Used by ``python -m bench.model --peak-breakdown``: torch's allocator history is recorded over
one training step, replayed to find the moment of the peak, and the blocks live then are summed
by the innermost stack frame in this project's code (moe/, bench/, pipeline/); blocks allocated
before the recording began count as "held before the step" (weights, masters, AdamW moments and
whatever the previous step left).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

GIB = 2**30
OURS = ("/moe/", "/bench/", "/pipeline/")


def _site(frames: list[dict[str, Any]]) -> str:
    ours = [f for f in frames if any(part in f.get("filename", "") for part in OURS)]
    f = ours[0] if ours else (frames[0] if frames else {"filename": "?", "line": 0, "name": "?"})
    name = f.get("filename", "?")
    for part in OURS:
        if part in name:
            name = part.strip("/") + "/" + name.split(part, 1)[1]
            break
    return f"{name}:{f.get('line', 0)} {f.get('name', '?')}"


def peak_breakdown(run: Callable[[], None], top: int = 15) -> dict[str, Any]:
    """Run ``run`` with the allocator's history on; the peak and what was live at it."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    try:
        run()
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    live: dict[int, tuple[int, str]] = {}
    held_before = before
    current = before
    peak, peak_live, peak_held = current, {}, held_before
    for trace in snap["device_traces"]:
        for ev in trace:
            action, addr, size = ev["action"], ev["addr"], ev["size"]
            if action == "alloc":
                live[addr] = (size, _site(ev.get("frames", [])))
                current += size
            elif action == "free_completed":
                if addr in live:
                    current -= live.pop(addr)[0]
                else:  # allocated before the recording
                    held_before -= size
                    current -= size
            else:
                continue
            if current > peak:
                peak, peak_live, peak_held = current, dict(live), held_before
    by_site: dict[str, int] = defaultdict(int)
    for size, site in peak_live.values():
        by_site[site] += size
    rows = sorted(by_site.items(), key=lambda kv: -kv[1])
    result = {
        "peak_gib": peak / GIB,
        "held_before_step_gib": peak_held / GIB,
        "sites": [{"site": s, "gib": b / GIB} for s, b in rows[:top]],
        "other_gib": sum(b for _, b in rows[top:]) / GIB,
    }
    print(f"peak {result['peak_gib']:.2f} GiB: held before the step {result['held_before_step_gib']:.2f} GiB, then by allocation site:")
    for row in result["sites"]:
        print(f"  {row['gib']:8.3f} GiB  {row['site']}")
    print(f"  {result['other_gib']:8.3f} GiB  (other sites)", flush=True)
    return result
