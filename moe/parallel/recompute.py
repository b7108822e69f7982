"""Activation recompute, applied per block from outside an unmodified model (``train.recompute``).

Each transformer block's forward is wrapped in non-reentrant ``torch.utils.checkpoint``; what
is kept for backward depends on the mode:

    none       keep everything autograd saves (no recompute)
    matmuls    selective: keep the outputs of every matmul, grouped expert GEMM and attention
               kernel; recompute norms, RoPE, the SwiGLU activation, router softmax/top-k and
               the permuted expert rows (cheap elementwise and gather work)
    selective  keep only the expensive outputs (attention kernel, grouped expert GEMMs, router
               logits); also recompute the dense q/k/v/o projections (~7% more FLOPs at OLMoE
               width, measured in bench/memory.py)
    full       keep only each block's input; recompute the whole block in backward

Our Triton kernels (fused RMSNorm, SwiGLU, token permutation) run inside autograd Functions
whose launches the policies do not see; the policies see only the torch ops around them (the
``aten.empty`` of their outputs, index ops), none of which they save, so the selective modes
recompute these kernels (tests/kernels/rmsnorm_check.py counts the fused norm's forwards).

The selective modes use torch's ``create_selective_checkpoint_contexts`` policies. Parameter
names do not change (the block's forward is replaced on the instance), so checkpoints,
ZeRO-1 ownership and expert layouts are unaffected; apply it before the parallel layout
(FSDP2's ``fully_shard`` then gathers weights before the recompute, as for any forward).

Recompute re-runs the block's forward exactly (RNG state restored, so random routing repeats);
expert parallelism's all-to-alls run again inside the recompute on every rank of the group in
the same order. State a forward mutates (the router's pending load for aux-loss-free
balancing) is restored after the recompute so it is counted once.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

RECOMPUTE_MODES = ("none", "matmuls", "selective", "full")

_aten = torch.ops.aten


def _ops(*names: str) -> frozenset:
    """The op packets that exist in this torch (older ones lack some attention kernels)."""
    return frozenset(getattr(_aten, n) for n in names if hasattr(_aten, n))


ATTENTION_OPS = _ops(
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_fused_attention_overrideable",
    "_flash_attention_forward",
    "_efficient_attention_forward",
)
EXPERT_GEMM_OPS = _ops("_grouped_mm", "_scaled_grouped_mm")
DENSE_MATMUL_OPS = _ops("mm", "addmm", "bmm", "baddbmm", "_scaled_mm")
# The router's fp32-output GEMM on CUDA (mm with out_dtype): tiny, and keeps routing exact.
ROUTER_OVERLOADS = frozenset(o for o in [getattr(_aten.mm, "dtype", None)] if o is not None)

SAVED_OPS: dict[str, frozenset] = {
    "matmuls": ATTENTION_OPS | EXPERT_GEMM_OPS | DENSE_MATMUL_OPS,
    "selective": ATTENTION_OPS | EXPERT_GEMM_OPS,
}


def _policy(saved: frozenset) -> Callable:
    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if func.overloadpacket in saved or func in ROUTER_OVERLOADS:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


@contextlib.contextmanager
def _restore_forward_state(block: nn.Module) -> Iterator[None]:
    """Undo what a recomputed forward adds to module state (the router's pending load)."""
    buffers = [m.pending_load for m in block.modules() if getattr(m, "pending_load", None) is not None]
    saved = [b.clone() for b in buffers]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, s in zip(buffers, saved, strict=True):
                b.copy_(s)


def _contexts(block: nn.Module, mode: str) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    if mode == "full":
        forward_ctx, recompute_ctx = contextlib.nullcontext(), contextlib.nullcontext()
    else:
        forward_ctx, recompute_ctx = create_selective_checkpoint_contexts(_policy(SAVED_OPS[mode]))
    return forward_ctx, _chain(_restore_forward_state(block), recompute_ctx)  # restore outside SAC's mode


@contextlib.contextmanager
def _chain(*managers: contextlib.AbstractContextManager) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for m in managers:
            stack.enter_context(m)
        yield


def _checkpointed_forward(block: nn.Module, inner: Callable, mode: str, *args, **kwargs):
    if not torch.is_grad_enabled():  # evaluation: nothing to save, nothing to recompute
        return inner(*args, **kwargs)
    return checkpoint(inner, *args, use_reentrant=False, context_fn=functools.partial(_contexts, block, mode), **kwargs)


def blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a model (or of a pipeline stage's pruned model)."""
    return list(model.layers.values())


def apply_recompute(model: nn.Module, mode: str) -> nn.Module:
    """Wrap every block's forward for ``mode`` (re-applying replaces the previous mode)."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"train.recompute: unknown mode {mode!r}; known: {', '.join(RECOMPUTE_MODES)}")
    for block in blocks(model):
        if "forward" in block.__dict__:
            del block.forward  # back to the class's forward
        if mode == "none":
            continue
        block.forward = functools.partial(_checkpointed_forward, block, type(block).forward.__get__(block), mode)
    return model
