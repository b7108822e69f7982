"""Independent reference for the MoE layer: a plain per-expert Python loop.

Slow and host-syncing by design; used by tests and benchmarks to check the fast path."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reference_experts_combine(
    x: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    """x [T, D]; experts/weights [T, k]; gate_up [E, 2H, D]; down [E, D, H] -> [T, D]."""
    out = torch.zeros_like(x)
    hidden = down.shape[-1]
    for e in range(gate_up.shape[0]):
        token_idx, slot = torch.nonzero(experts == e, as_tuple=True)
        if token_idx.numel() == 0:
            continue
        h = x[token_idx] @ gate_up[e].T
        y = (F.silu(h[:, :hidden]) * h[:, hidden:]) @ down[e].T
        out = out.index_add(0, token_idx, y * weights[token_idx, slot, None].to(y.dtype))
    return out
