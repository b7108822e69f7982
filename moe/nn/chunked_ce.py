"""Fused, chunked linear + cross-entropy: the loss of ``hidden @ weight.T`` without the logits.

The unfused loss materialises the logits of the whole batch ([tokens, vocab] in the compute
dtype) and an fp32 copy of them, which at 50k classes is the largest activation of a step.
Here the tokens go through in chunks: each chunk's logits are computed in the input dtype,
reduced to an fp32 log-sum-exp and the target logit, and dropped. Backward recomputes each
chunk's logits, forms ``softmax - onehot`` in fp32, casts it to the input dtype (as autograd
does for ``logits.float()``) and produces the chunk's ``grad_hidden`` and its share of
``grad_weight`` (accumulated in fp32). Only the inputs and one fp32 number per token are saved.

The chunk loop runs over a count fixed by the shapes: no host sync.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # as F.cross_entropy


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, chunk: int, z_weight: float) -> torch.Tensor:
        n = hidden.shape[0]
        valid = target != IGNORE_INDEX
        safe = torch.where(valid, target, torch.zeros_like(target))
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        picked = torch.empty(n, dtype=torch.float32, device=hidden.device)
        for s in range(0, n, chunk):
            logits = (hidden[s : s + chunk] @ weight.t()).float()
            lse[s : s + chunk] = torch.logsumexp(logits, dim=-1)
            picked[s : s + chunk] = logits.gather(1, safe[s : s + chunk, None]).squeeze(1)
        count = valid.sum()
        loss = torch.where(valid, lse - picked, torch.zeros_like(lse)).sum() / count
        ctx.save_for_backward(hidden, weight, safe, valid, lse, count)
        ctx.chunk, ctx.z_weight = chunk, z_weight
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        hidden, weight, safe, valid, lse, count = ctx.saved_tensors
        chunk, z_weight = ctx.chunk, ctx.z_weight
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_h else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        scale = (grad_loss / count).float()
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s : s + chunk]
            g = (h @ weight.t()).float()  # a fresh chunk of logits: updated in place below
            g.sub_(lse[s : s + chunk, None]).exp_()  # softmax
            if z_weight:  # d(w * lse^2) / d logits = 2 w lse softmax
                g.mul_(1.0 + 2.0 * z_weight * lse[s : s + chunk, None])
            g.scatter_add_(1, safe[s : s + chunk, None], torch.full_like(g[:, :1], -1.0))
            g = g.mul_(scale * valid[s : s + chunk, None]).to(hidden.dtype)
            if need_h:
                grad_hidden[s : s + chunk] = g @ weight
            if need_w:
                grad_weight += (g.t() @ h).float()
        if need_w:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


def chunked_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, chunk_tokens: int, z_weight: float = 0.0
) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T`` against ``target`` (``IGNORE_INDEX`` skipped);
    ``z_weight``: the gradient also carries ``z_weight * mean(logsumexp^2)`` (the value does not).

    hidden: [..., d]; weight: [vocab, d]; target: [...] class ids. Under autocast the inputs are
    cast to the autocast dtype first (the cast is differentiable), as ``F.linear`` would."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    hidden, target = hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1)
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    elif hidden.dtype != weight.dtype:
        hidden = hidden.to(weight.dtype)
    with torch.autocast(device, enabled=False):
        return _ChunkedLinearCrossEntropy.apply(hidden, weight, target, chunk_tokens, z_weight)


def unfused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The reference: full logits, then fp32 cross-entropy (what the model's head + loss do)."""
    logits = F.linear(hidden, weight)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))
