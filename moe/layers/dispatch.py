"""The dispatcher seam: move token copies to their experts and the results back.

``LocalDispatcher`` permutes on one device. Expert-parallel dispatchers (all-to-all over NCCL
or gloo, later NVSHMEM) implement the same two calls.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import torch

from moe.kernels.routing import combine, gather_rows, use_triton
from moe.layers.router import Routing


@dataclasses.dataclass
class LocalDispatchState:
    order: torch.Tensor  # [T*k] slot index of each expert-ordered row
    inverse: torch.Tensor  # [T*k] expert-ordered row of each slot
    weights: torch.Tensor  # [T, k]


class Dispatcher(Protocol):
    def dispatch(self, x: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """x: [T, D] -> (rows for this rank's experts in expert order, rows per local expert, state)."""
        ...

    def combine(self, y: torch.Tensor, state: Any) -> torch.Tensor:
        """Expert outputs (same order as dispatched) -> [T, D] weighted sum over each token's k slots."""
        ...


def sort_by_expert(expert_of_slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, inverse): the stable permutation that groups slots by expert, and its inverse
    (``inverse[order[i]] = i``), both on the device (the dispatchers' one sorting step)."""
    order = torch.argsort(expert_of_slot, stable=True)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return order, inverse


class LocalDispatcher:
    """Sorts the T*k token slots by expert with one stable argsort; no host sync.

    On CUDA the gather and the weighted combine are fused Triton kernels (moe.kernels) whose
    backwards need no atomics; elsewhere the same arithmetic runs as index_select and bmm."""

    # Fixed-order arithmetic only (moe.train.determinism checks this flag).
    deterministic = True

    def sort(self, routing: Routing) -> LocalDispatchState:
        """The permutation only, for experts that read token rows through it (no gather)."""
        order, inverse = sort_by_expert(routing.experts.reshape(-1))
        return LocalDispatchState(order, inverse, routing.weights)

    def dispatch(self, x: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor, LocalDispatchState]:
        top_k = routing.experts.shape[1]
        state = self.sort(routing)
        order, inverse = state.order, state.inverse
        rows = gather_rows(x, order, inverse, top_k) if use_triton(x) else x.index_select(0, order // top_k)
        return rows, routing.tokens_per_expert, state

    def combine(self, y: torch.Tensor, state: LocalDispatchState, residual: torch.Tensor | None = None) -> torch.Tensor:
        """As the seam's combine; ``residual`` [T, D] is added in the same pass (MoELayer's fold)."""
        return combine_rows(y, state.inverse, state.weights, residual)


def combine_rows(y: torch.Tensor, inverse: torch.Tensor, weights: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """out[t] = (residual[t] +) sum_j weights[t, j] * y[inverse[t*k + j]]: the fused kernel on CUDA
    (the residual read in its pass, one rounding), index_select, bmm and an add elsewhere
    (autograd through both)."""
    if use_triton(y):
        return combine(y, inverse, weights, residual)
    n_tokens, top_k = weights.shape
    per_slot = y.index_select(0, inverse).view(n_tokens, top_k, -1)
    out = torch.bmm(weights.to(y.dtype).unsqueeze(1), per_slot).squeeze(1)
    return out if residual is None else residual + out
