"""Top-k token router with fp32 logits, balancing losses and optional aux-loss-free bias."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moe.config import MoEConfig


@dataclasses.dataclass
class Routing:
    """The router's decision for T tokens; every tensor stays on the device."""

    experts: torch.Tensor  # [T, k] int64 expert index of each token slot
    weights: torch.Tensor  # [T, k] fp32 combine weight of each slot
    tokens_per_expert: torch.Tensor  # [E] int64 slots routed to each expert (this rank)
    lb_loss: torch.Tensor  # fp32 scalar, unweighted; 1.0 when perfectly balanced
    z_loss: torch.Tensor  # fp32 scalar, unweighted
    # the router's input as the experts' gather must read it (Router.forward's fold_input_grad),
    # else None: read the tokens themselves
    tokens: torch.Tensor | None = None


class Router(nn.Module):
    def __init__(self, d_model: int, cfg: MoEConfig) -> None:
        super().__init__()
        self.num_experts, self.top_k = cfg.num_experts, cfg.top_k
        self.score_func, self.routing = cfg.score_func, cfg.routing
        self.normalize_top_k = cfg.normalize_top_k
        self.global_balance = cfg.lb_loss_scope == "global_batch"
        self.bias_update_rate = cfg.bias_update_rate
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, d_model))
        if self.bias_update_rate > 0:
            # Selection bias (checkpointed) and the load seen since the last optimizer step.
            self.register_buffer("expert_bias", torch.zeros(cfg.num_experts))
            self.register_buffer("pending_load", torch.zeros(cfg.num_experts), persistent=False)
        else:
            self.expert_bias = None
            self.pending_load = None
        # Process group over which token counts are summed for global-batch balancing and
        # bias updates; set from outside by the parallel layout (None: this process only).
        self.balance_group: dist.ProcessGroup | None = None
        # Count tokens per expert with a fixed-order reduction (set by the deterministic mode).
        self.deterministic = False

    def forward(self, x: torch.Tensor, fold_input_grad: bool = False) -> Routing:
        """x: [T, d_model] -> Routing. ``fold_input_grad``: ``Routing.tokens`` is x passed through
        the logits' Function, whose backward adds the logits' input gradient into the gradient that
        arrives through it (in the GEMM, in place): only for a consumer whose backward returns a
        tensor of its own (the local dispatcher's gather), the one reader of ``Routing.tokens``."""
        logits, tokens = router_logits(x, self.weight, pass_through=fold_input_grad)
        scores = logits.softmax(dim=-1) if self.score_func == "softmax" else logits.sigmoid()
        with torch.no_grad():
            if self.routing == "random":
                experts = torch.rand_like(scores).topk(self.top_k, dim=-1).indices
            elif self.expert_bias is not None:
                experts = (scores + self.expert_bias).topk(self.top_k, dim=-1).indices
            else:
                experts = scores.topk(self.top_k, dim=-1).indices
            tokens_per_expert = count_per_expert(experts.reshape(-1), self.num_experts, self.deterministic)
        weights = scores.gather(-1, experts)
        if self.normalize_top_k:
            weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(1e-20)

        n_tokens = x.shape[0]
        counts, total = tokens_per_expert, n_tokens
        if self.global_balance and self._distributed():
            counts = _all_reduce_sum(tokens_per_expert, self.balance_group)
            total = n_tokens * dist.get_world_size(self.balance_group)
        fraction = counts.float() / total  # f_i, sums to k
        mean_score = scores.mean(dim=0)  # P_i
        lb_loss = (self.num_experts / self.top_k) * (fraction * mean_score).sum()
        z_loss = torch.logsumexp(logits, dim=-1).square().mean()

        if self.pending_load is not None and self.training:
            self.pending_load.add_(tokens_per_expert.float())
        return Routing(experts, weights, tokens_per_expert, lb_loss, z_loss, tokens)

    def _distributed(self) -> bool:
        """Counts are summed only over an explicitly set group (None: this process alone)."""
        return self.balance_group is not None and dist.is_initialized() and dist.get_world_size(self.balance_group) > 1

    @torch.no_grad()
    def update_bias(self) -> None:
        """Move the selection bias towards balance from the load since the last call.

        Called after each optimizer step; device-only (no host sync)."""
        if self.pending_load is None:
            return
        load = self.pending_load
        if self._distributed():
            load = _all_reduce_sum(load, self.balance_group)
        self.expert_bias.add_(self.bias_update_rate * torch.sign(load.mean() - load))
        self.pending_load.zero_()

    def reset_parameters(self, std: float) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=std)
        if self.expert_bias is not None:
            self.expert_bias.zero_()
            self.pending_load.zero_()


def count_per_expert(flat: torch.Tensor, num_experts: int, fixed_order: bool = False) -> torch.Tensor:
    """[N] expert ids -> [E] int64 counts, on the device.

    ``fixed_order`` (the deterministic mode): a compare-and-sum reduction ([N, E] booleans)
    instead of ``scatter_add_``, whose CUDA kernel accumulates with atomics (exact for integers,
    but not a fixed-order reduction, and rerouted by ``torch.use_deterministic_algorithms``)."""
    if fixed_order:
        return (flat.unsqueeze(1) == torch.arange(num_experts, device=flat.device)).sum(0)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat))


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with an fp32 result: a bf16 tensor-core GEMM with fp32 accumulation and output on
    CUDA (bf16 x bf16 products are exact in fp32), an fp32 GEMM elsewhere."""
    if a.is_cuda and a.dtype == torch.bfloat16 and b.dtype == torch.bfloat16:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (RuntimeError, TypeError):  # a torch without mm(out_dtype=)
            pass
    return a.float() @ b.float()


def _mm_rounded(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b in fp32, rounded once to a's dtype. On CUDA the GEMM's epilogue rounds its fp32 sum:
    the [T, d] input gradient is not written in fp32 and cast in a second kernel (a 128 MiB write,
    a read and a copy launch per MoE layer and micro-batch at 16,384 tokens of d=2048)."""
    if a.is_cuda and a.dtype == b.dtype and a.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(a, b)
    return _mm_fp32(a, b).to(a.dtype)


class _RouterLogits(torch.autograd.Function):
    """fp32 logits from the model-dtype activations and router weight, and x passed through (a
    view). The backward rounds the logit gradient to the activations' dtype, as every other bf16
    backward does. The experts' rows read x through the second output, so the backward receives
    their input gradient with the logits' and adds the logits' product into it inside the GEMM
    (``addmm_``: one read of it in the epilogue, one rounding) where autograd would write the
    product and sum the two in an add kernel (a [T, d] read twice and written, per MoE layer and
    micro-batch). The arriving gradient is written in place: Router.forward's fold_input_grad says
    when that is safe."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.save_for_backward(x, weight)
        ctx.set_materialize_grads(False)
        return _mm_fp32(x, weight.t()), x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None, grad_through: torch.Tensor | None):
        x, weight = ctx.saved_tensors
        g = grad.to(x.dtype) if grad is not None else None
        grad_x = grad_through
        if ctx.needs_input_grad[0] and g is not None:
            w = weight.to(x.dtype)
            if grad_through is None:
                grad_x = _mm_rounded(g, w)
            elif grad_through.dtype == x.dtype and grad_through.is_contiguous():
                grad_x = grad_through.view(-1, x.shape[-1]).addmm_(g, w).view(grad_through.shape)
            else:
                grad_x = grad_through + _mm_rounded(g, w)
        grad_w = _mm_fp32(g.t(), x).to(weight.dtype) if ctx.needs_input_grad[1] and g is not None else None
        return grad_x, grad_w


def router_logits(x: torch.Tensor, weight: torch.Tensor, pass_through: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[T, d] activations, [E, d] weight -> ([T, E] fp32 logits, x through the logits' Function
    where ``pass_through`` asks for it and that Function runs (low-precision inputs), else None)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.linear(x, weight), None
    logits, through = _RouterLogits.apply(x, weight)
    return logits, through if pass_through else None


def _all_reduce_sum(t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    out = t.clone()
    dist.all_reduce(out, group=group)
    return out
