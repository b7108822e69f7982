"""Stacked SwiGLU experts computed with one grouped GEMM per projection (dropless)."""

from __future__ import annotations

import torch
from torch import nn

from moe.layers.gemm import ExpertGemm, GroupedMM


class GroupedExperts(nn.Module):
    """Weights in transformers' OLMoE layout: gate_up [E, 2H, D] (gate rows first), down [E, D, H]."""

    def __init__(self, num_experts: int, d_model: int, hidden: int, gemm: ExpertGemm | None = None) -> None:
        super().__init__()
        self.num_experts, self.d_model, self.hidden = num_experts, d_model, hidden
        # Which experts these rows are: expert parallelism keeps a slice of the global set.
        self.expert_offset, self.global_num_experts = 0, num_experts
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * hidden, d_model))
        self.down = nn.Parameter(torch.empty(num_experts, d_model, hidden))
        self.gemm: ExpertGemm = gemm or GroupedMM()

    @property
    def reads_token_rows(self) -> bool:
        """Whether the GEMM gathers token rows itself (:meth:`forward_tokens`)."""
        return self.gemm.reads_token_rows

    def forward_tokens(self, tokens: torch.Tensor, state, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """The experts on token rows tokens[order // k] (expert order, never materialised) and the
        weighted combine: [T, D] out. ``state``: the local dispatcher's permutation and weights."""
        offsets = tokens_per_expert.cumsum(0).to(torch.int32)
        return self.gemm.expert_mlp(tokens, self.gate_up, self.down, offsets, order=state.order, inverse=state.inverse, weights=state.weights)

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """x: [N, D] rows grouped by expert (group sizes tokens_per_expert, on the device)."""
        offsets = tokens_per_expert.cumsum(0).to(torch.int32)
        return self.gemm.expert_mlp(x, self.gate_up, self.down, offsets)

    def reset_parameters(self, std: float) -> None:
        nn.init.normal_(self.gate_up, mean=0.0, std=std)
        nn.init.normal_(self.down, mean=0.0, std=std)


def expert_param_layout(model: nn.Module) -> dict[str, tuple[int, int]]:
    """Parameter name -> (global index of its first local expert, experts in the whole model),
    for every stacked expert weight of ``model`` (what checkpoints and gradient groups key on)."""
    out = {}
    for mod_name, module in model.named_modules():
        if isinstance(module, GroupedExperts):
            for pname in ("gate_up", "down"):
                out[f"{mod_name}.{pname}"] = (module.expert_offset, module.global_num_experts)
    return out
