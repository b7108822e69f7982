"""The MoE feed-forward layer: router -> dispatcher -> experts -> combine (+ shared experts)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from moe.config import MoEConfig
from moe.layers.aux_loss import attach_aux_loss
from moe.layers.dispatch import Dispatcher, LocalDispatcher
from moe.layers.experts import GroupedExperts
from moe.layers.gemm import ExpertGemm, GroupedMM
from moe.layers.router import Router
from moe.nn.mlp import SwiGLU
from moe.spans import span
from moe.switches import choice

# The block's residual add folded into the combine (one read of the residual in the combine's
# pass instead of a separate add kernel's three passes over [tokens, d]): on by default since it was
# measured (one H100, bench/NOTES.md 2026-12-07: 24 adds, 1.5 ms, gone for 0.7 ms more in the combine);
# MOE_RESIDUAL_ADD=separate keeps the block's own add (the side-by-side).
RESIDUAL_IN_COMBINE = choice("MOE_RESIDUAL_ADD") == "combine"
# The router's input gradient added into the gather's inside its GEMM (Router.forward's
# fold_input_grad); MOE_ROUTER_INPUT_GRAD=autograd keeps autograd's add (the side-by-side).
ROUTER_GRAD_IN_GEMM = choice("MOE_ROUTER_INPUT_GRAD") == "gemm"


@dataclasses.dataclass
class MoEStats:
    """Telemetry of the last forward, detached, on the device; reduce only when logging."""

    tokens_per_expert: torch.Tensor  # [E] int64
    lb_loss: torch.Tensor
    z_loss: torch.Tensor
    rows_received: torch.Tensor | None = None  # int64 rows this rank's experts computed


class MoELayer(nn.Module):
    def __init__(self, d_model: int, cfg: MoEConfig, expert_gemm: Callable[[], ExpertGemm] = GroupedMM) -> None:
        """``expert_gemm`` builds the experts' GEMM, chosen once here (moe.precision: the recipe's)."""
        super().__init__()
        self.lb_loss_weight, self.z_loss_weight = cfg.lb_loss_weight, cfg.z_loss_weight
        self.router = Router(d_model, cfg)
        self.experts = GroupedExperts(cfg.num_experts, d_model, cfg.expert_hidden, expert_gemm())
        self.shared = SwiGLU(d_model, cfg.shared_hidden_total) if cfg.num_shared_experts else None
        # Replaced by the parallel layout (expert parallelism); not part of the state dict.
        self.dispatcher: Dispatcher = LocalDispatcher()
        # Gradient scale of the auxiliary losses; the trainer sets it to the main loss's.
        self.aux_loss_scale = 1.0
        self.last_stats: MoEStats | None = None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``residual`` (x's shape): returns residual + the layer's output, the add folded into the
        local combine where that runs (no shared experts; MOE_RESIDUAL_ADD=combine, the default),
        else a plain add."""
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        residual = residual.reshape(tokens.shape) if residual is not None else None
        local = type(self.dispatcher) is LocalDispatcher
        fold = RESIDUAL_IN_COMBINE and residual is not None and self.shared is None and local
        # the local gather's backward returns a tensor of its own: the router may add its input
        # gradient into it (Router.forward's fold_input_grad)
        routing = self.router(tokens, fold_input_grad=ROUTER_GRAD_IN_GEMM and local and not self.experts.reads_token_rows)
        if self.experts.reads_token_rows and local:
            # the experts' GEMM gathers the token rows itself: only the permutation is made here
            with span("dispatch"):
                state = self.dispatcher.sort(routing)
                rows_per_expert = routing.tokens_per_expert
            out = self.experts.forward_tokens(tokens, state, rows_per_expert)
        else:
            with span("dispatch"):
                gathered = routing.tokens if routing.tokens is not None else tokens
                rows, rows_per_expert, state = self.dispatcher.dispatch(gathered, routing)
            y = self.experts(rows, rows_per_expert)
            with span("dispatch"):
                if fold:
                    out = self.dispatcher.combine(y, state, residual)
                    residual = None
                else:
                    out = self.dispatcher.combine(y, state)
        if self.shared is not None:
            out = out + self.shared(tokens)
        if residual is not None:
            out = residual + out
        if self.training and torch.is_grad_enabled():
            aux = self.lb_loss_weight * routing.lb_loss + self.z_loss_weight * routing.z_loss
            if aux.requires_grad:
                out = attach_aux_loss(out, aux, self.aux_loss_scale)
        self.last_stats = MoEStats(routing.tokens_per_expert, routing.lb_loss.detach(), routing.z_loss.detach(), rows_per_expert.sum())
        return out.view(shape)

    def reset_parameters(self, std: float) -> None:
        self.router.reset_parameters(std)
        self.experts.reset_parameters(std)
        if self.shared is not None:
            for lin in (self.shared.gate_proj, self.shared.up_proj, self.shared.down_proj):
                nn.init.normal_(lin.weight, mean=0.0, std=std)
