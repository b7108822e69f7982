"""AdamW over fp32 masters in one pass that also writes the bf16 copy the model trains with.

torch's fused AdamW reads the master, gradient and both moments and writes master and
moments back (28 bytes per parameter), writes the gradient back once more when it is given a
``grad_scale`` (the clipping coefficient: 4 bytes), and a second pass copies every master
into its bf16 parameter (reads 4, writes 2): 38 bytes per parameter per step, about 40 ms for
the 3.56 billion parameters of the 8-layer OLMoE-width benchmark on an H200. This kernel
reads master, gradient and moments once and writes master, moments and the bf16 copy: 30
bytes, no gradient write-back, no second pass.

The update is torch's (``torch/_refs`` and the fused CUDA kernel): decoupled weight decay
``p -= lr * wd * p`` first, then the moments, then ``p -= lr / bc1 * m / (sqrt(v) / sqrt(bc2)
+ eps)``, all in fp32; the step count lives on the device (the optimizer's ``state["step"]``),
so a skipped step (``found_inf``) costs no host sync. Elementwise and the same for every
element wherever it sits, so a sharded master (ZeRO-1, FSDP's local shard) steps to the same
bits as the whole one.
"""

from __future__ import annotations

import torch

from moe.kernels.routing import HAVE_TRITON, use_triton

BLOCK = 2048
WARPS = 8

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _adamw_kernel(
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        mirror,
        step_ptr,
        found_inf_ptr,
        grad_div_ptr,
        lr_ptr,
        n,
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        HAS_MIRROR: tl.constexpr,
        HAS_FOUND_INF: tl.constexpr,
        HAS_GRAD_DIV: tl.constexpr,
        HAS_WD: tl.constexpr,
        LR_ON_DEVICE: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        if HAS_FOUND_INF:  # a skipped step reads and writes nothing
            n = tl.where(tl.load(found_inf_ptr) == 0, n, 0)
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        p = tl.load(param + offs, mask=mask)
        g = tl.load(grad + offs, mask=mask).to(tl.float32)
        m = tl.load(exp_avg + offs, mask=mask)
        v = tl.load(exp_avg_sq + offs, mask=mask)
        if HAS_GRAD_DIV:
            g = g / tl.load(grad_div_ptr)
        step = tl.load(step_ptr)
        if LR_ON_DEVICE:  # (a captured step: the schedule writes it before each replay)
            lr = tl.load(lr_ptr)
        bc1 = 1.0 - tl.exp2(step * tl.log2(beta1))
        bc2_sqrt = tl.sqrt(1.0 - tl.exp2(step * tl.log2(beta2)))
        if HAS_WD:
            p = p - lr * weight_decay * p
        m = beta1 * m + (1.0 - beta1) * g
        v = beta2 * v + (1.0 - beta2) * g * g
        denom = tl.sqrt(v) / bc2_sqrt + eps
        p = p - (lr / bc1) * m / denom
        tl.store(param + offs, p, mask=mask)
        tl.store(exp_avg + offs, m, mask=mask)
        tl.store(exp_avg_sq + offs, v, mask=mask)
        if HAS_MIRROR:
            tl.store(mirror + offs, p.to(mirror.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP, ZeRO over DTensors), else the tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def supports(master: torch.Tensor, grad: torch.Tensor, mirror: torch.Tensor | None) -> bool:
    """Whether this kernel can step ``master`` (fp32, contiguous, with a contiguous gradient and
    a contiguous low-precision copy of the same shape, if any)."""
    tensors = [_local(master), _local(grad)] + ([_local(mirror)] if mirror is not None else [])
    return (
        use_triton(tensors[0])
        and len({t.device for t in tensors}) == 1
        and all(t.is_contiguous() for t in tensors)
        and _local(master).dtype == torch.float32
        and all(t.shape == tensors[0].shape for t in tensors)
    )


def adamw_step(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: torch.Tensor,
    *,
    lr: float | torch.Tensor,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    mirror: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    grad_div: torch.Tensor | None = None,
) -> None:
    """One AdamW step of ``master`` in place (and of its moments), writing ``mirror`` (the
    bf16 parameter) from the new master in the same pass. ``step`` is the device step count
    already advanced for this step; where ``found_inf`` (a device scalar) is nonzero nothing is
    written; ``grad_div`` (a device scalar) divides every gradient; ``lr`` may be a device fp32
    scalar, read by the kernel (what a CUDA graph replays with the schedule's current value; the
    same bits as the float, which the kernel takes as fp32 too). Check :func:`supports`."""
    p, g, m, v = (_local(t) for t in (master, grad, exp_avg, exp_avg_sq))
    out = _local(mirror) if mirror is not None else p
    g = g if g.is_contiguous() else g.contiguous()  # read only: a copy is safe
    written = (p, m, v, out)
    if not all(t.is_contiguous() and t.shape == p.shape for t in written) or g.shape != p.shape:
        raise ValueError("adamw_step: the master, its moments and its copy must be contiguous and of the gradient's shape")
    n = p.numel()
    if n == 0:
        return
    on_device = isinstance(lr, torch.Tensor)
    if on_device and (lr.dtype != torch.float32 or lr.numel() != 1 or lr.device != p.device):
        raise ValueError("adamw_step: a device learning rate is one fp32 scalar on the master's device")
    _adamw_kernel[(triton.cdiv(n, BLOCK),)](
        p,
        g,
        m,
        v,
        out,
        step,
        found_inf if found_inf is not None else step,
        grad_div if grad_div is not None else step,
        lr if on_device else step,
        n,
        0.0 if on_device else float(lr),
        float(betas[0]),
        float(betas[1]),
        float(eps),
        float(weight_decay),
        HAS_MIRROR=mirror is not None,
        HAS_FOUND_INF=found_inf is not None,
        HAS_GRAD_DIV=grad_div is not None,
        HAS_WD=weight_decay != 0,
        LR_ON_DEVICE=on_device,
        BLOCK=BLOCK,
        num_warps=WARPS,
    )
