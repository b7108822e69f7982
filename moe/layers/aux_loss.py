"""Attach an auxiliary loss to an activation so its gradient flows in the normal backward.

The model's output stays the logits (what pipeline stages pass along); each MoE layer's
balancing losses add their gradient during backward, scaled like the main loss
(e.g. 1 / gradient-accumulation steps).
"""

from __future__ import annotations

import torch


class _AttachAuxLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, activation: torch.Tensor, aux_loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.save_for_backward(aux_loss)
        return activation.view_as(activation)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        return grad, torch.full_like(aux_loss, ctx.scale), None


def attach_aux_loss(activation: torch.Tensor, aux_loss: torch.Tensor, scale: float) -> torch.Tensor:
    """Return ``activation`` unchanged; backward adds d(scale * aux_loss)."""
    return _AttachAuxLoss.apply(activation, aux_loss, scale)
