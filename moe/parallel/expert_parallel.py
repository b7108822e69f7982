"""Expert parallelism: experts resident on their ranks, tokens travel to them (all-to-all).

``apply_expert_parallel`` keeps on each EP rank only its slice of every MoE layer's experts
and swaps the layer's dispatcher for :class:`AllToAllDispatcher`. Dropless: every token
slot is sent, whatever the load.

The one host sync: ``torch.distributed.all_to_all_single`` takes its split sizes as Python
lists, so the per-destination row counts must reach the host once per dispatch (the counts
themselves are exchanged on the device first). That sync lives in ``_split_sizes`` and
nowhere else; a later NVSHMEM dispatcher removes it.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from moe.layers.dispatch import LocalDispatcher, LocalDispatchState, sort_by_expert
from moe.layers.router import Routing
from moe.parallel.mesh import Mesh


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with variable splits; backward sends gradients back the same way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty((sum(ctx.in_splits), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.in_splits, ctx.out_splits, group=ctx.group)
        return out, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    return _AllToAll.apply(x, out_splits, in_splits, group)


@dataclasses.dataclass
class AllToAllState:
    local: LocalDispatchState
    send: list[int]  # rows sent to each EP rank
    recv: list[int]  # rows received from each EP rank
    inverse: torch.Tensor  # received-row position of each expert-ordered row


def _split_sizes(send_rows: torch.Tensor, recv_rows: torch.Tensor) -> tuple[list[int], list[int]]:
    """The single device-to-host copy of the dispatcher (see the module docstring)."""
    sizes = torch.cat([send_rows, recv_rows]).tolist()
    n = send_rows.numel()
    return sizes[:n], sizes[n:]


class AllToAllDispatcher:
    # all-to-all moves rows without reducing them; the local permutation is LocalDispatcher's.
    deterministic = True

    def __init__(self, group, ep_size: int, num_experts: int) -> None:
        self.group, self.ep, self.num_experts = group, ep_size, num_experts
        self.local_experts = num_experts // ep_size
        self.local = LocalDispatcher()

    def dispatch(self, x: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor, AllToAllState]:
        rows, counts, local_state = self.local.dispatch(x, routing)  # sorted by global expert
        ep, el = self.ep, self.local_experts
        # counts[e] for my tokens -> each rank learns how many rows it gets for each of its experts
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.group)
        recv_counts = recv_counts.view(ep, el)  # [source rank, local expert]
        send, recv = _split_sizes(counts.view(ep, el).sum(1), recv_counts.sum(1))
        received = all_to_all(rows, recv, send, self.group)  # ordered by (source rank, local expert)
        expert_of_row = torch.repeat_interleave(torch.arange(el, device=x.device).repeat(ep), recv_counts.reshape(-1), output_size=received.shape[0])
        order, inverse = sort_by_expert(expert_of_row)
        return received.index_select(0, order), recv_counts.sum(0), AllToAllState(local_state, send, recv, inverse)

    def combine(self, y: torch.Tensor, state: AllToAllState) -> torch.Tensor:
        back = all_to_all(y.index_select(0, state.inverse), state.send, state.recv, self.group)
        return self.local.combine(back, state.local)


@torch.no_grad()
def apply_expert_parallel(model: nn.Module, mesh: Mesh, backend: str = "nccl", capacity_factor: float | None = None) -> nn.Module:
    """Keep this EP rank's slice of every MoE layer's experts; route tokens with all-to-all
    (``backend="nccl"``) or the sync-free symmetric-buffer dispatcher (``"nvshmem"``: NVSHMEM
    on GPUs, its gloo emulation on CPU; see moe.parallel.symmetric_dispatch).

    The full model must be initialised identically on every rank first (same seed), so the
    slices together are exactly the single-process model."""
    from moe.layers.moe_layer import MoELayer

    transport = None
    for name, module in model.named_modules():
        if not isinstance(module, MoELayer):
            continue
        module.router.balance_group = mesh.dp_group
        if mesh.ep == 1:
            continue
        experts = module.experts
        total = experts.global_num_experts
        local = total // mesh.ep
        offset = mesh.ep_rank * local
        experts.gate_up = nn.Parameter(experts.gate_up.data[offset : offset + local].clone())
        experts.down = nn.Parameter(experts.down.data[offset : offset + local].clone())
        experts.num_experts, experts.expert_offset = local, offset
        if backend == "nvshmem":
            from moe.parallel.symmetric_dispatch import SymmetricDispatcher
            from moe.parallel.transport import build_transport

            transport = transport or build_transport(mesh.ep_group, mesh.ep, mesh.ep_ranks)  # one per process
            module.dispatcher = SymmetricDispatcher(mesh.ep_group, mesh.ep, total, transport, capacity_factor, name)
        else:
            module.dispatcher = AllToAllDispatcher(mesh.ep_group, mesh.ep, total)
    return model
