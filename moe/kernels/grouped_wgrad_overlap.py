"""The expert weight gradient accumulated in the GEMM, with the accumulator's read under the main loop.

:mod:`moe.kernels.grouped_wgrad`'s Triton kernel reads each tile's old fp32 sum after its main
loop, so every tile waits for that read (and for its next tile's first operand loads) with the
tensor cores idle: on one H200 about 0.8 ms of the Qwen-like gate_up launch's 2.2 ms. Triton
schedules that epilogue itself; Gluon (Triton's explicit dialect) lets this kernel place each
step by hand:

- the tile's old sum is asked of TMA into shared memory while its first wgmma runs, so the
  epilogue only adds from shared memory and hands the result back to TMA without waiting;
- the operand loads run ``STAGES - 1`` steps ahead across tile boundaries, so the next tile's
  first loads are in flight during this tile's epilogue.

Same contract as ``grouped_wgrad`` (fp32 accumulation, each output element summed by one tile in
a fixed order over its rows: deterministic), for the unpaired case with ``M`` a multiple of
``BLOCK_M``; :func:`supports` says when it applies. Gluon kernels have no interpreter: the CPU
path stays on the Triton kernel and torch, and this one is checked on the GPU against it
(tests/kernels/grouped_wgrad_overlap_gpu_check.py) and compiled for sm90 in the CPU tests.
"""

from __future__ import annotations

import os

import torch

from moe.kernels.routing import HAVE_TRITON

try:
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

    HAVE_GLUON = HAVE_TRITON
except ImportError:  # a Triton without Gluon: the Triton kernel serves
    HAVE_GLUON = False

# (BLOCK_M, BLOCK_N, BLOCK_K, STAGES, SUM_BUFFERS, SUM_AT, warps). A 128 x 128 fp32 tile's old sum
# takes 64 KiB of shared memory; an sm90 block has 227 KiB: four 32 KiB operand stages beside one
# sum buffer, or three beside two. With one buffer the old sum is asked for at main-loop step
# SUM_AT (the previous tile's store must have left the buffer first; later steps leave it time);
# with two, at step 0, only the store before the previous one waited for.
CONFIG = (128, 128, 64, 3, 2, 0, 8)
CONFIGS = {"one sum buffer, 4 stages": (128, 128, 64, 4, 1, 2, 8), "two sum buffers, 3 stages": CONFIG}
# MOE_WGRAD_KERNEL=overlap routes the unpaired bf16 wgrad here (opt-in until measured on the H200).
USE_OVERLAP = os.environ.get("MOE_WGRAD_KERNEL", "triton") == "overlap"

if HAVE_GLUON:

    @gluon.jit
    def _tile_at(i, pid, nprog, order, ends, G, per_group, n_blocks, ORDERED: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
        """(expert, first row of its rows, its row count, first output row, first output column) of
        this program's i-th tile: tiles round-robin over programs, expert-major, experts heaviest
        first when ORDERED (an i past the program's tiles reads the last expert; not used)."""
        tile = pid + i * nprog
        slot = gl.minimum(tile // per_group, G - 1)
        rest = tile % per_group
        g = gl.load(order + slot) if ORDERED else slot
        start = gl.load(ends + g - 1, mask=g > 0, other=0)
        rows = gl.load(ends + g) - start
        return g, start, rows, (rest // n_blocks) * BLOCK_M, (rest % n_blocks) * BLOCK_N

    @gluon.jit
    def _operand_descs(
        grad,
        x,
        start,
        rows,
        M,
        K,
        a_layout: gl.constexpr,
        b_layout: gl.constexpr,
        BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        BLOCK_K: gl.constexpr,
    ):
        """TMA descriptors over one expert's rows of grad [rows, M] and x [rows, K]: the hardware
        zero-fills past its last row, so the loop needs no masks."""
        start64 = start.to(gl.int64)
        shape_rows = gl.maximum(rows, 1)  # a descriptor needs a non-empty box; no load happens then
        g_desc = tma.make_tensor_descriptor(grad + start64 * M, [shape_rows, M], [M, 1], [BLOCK_K, BLOCK_M], a_layout)
        x_desc = tma.make_tensor_descriptor(x + start64 * K, [shape_rows, K], [K, 1], [BLOCK_K, BLOCK_N], b_layout)
        return g_desc, x_desc

    @gluon.jit
    def _grouped_wgrad_overlap_kernel(
        grad,
        x,
        ends,
        order,
        out,
        G,
        M,
        K,
        ACCUMULATE: gl.constexpr,
        ORDERED: gl.constexpr,
        BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        BLOCK_K: gl.constexpr,
        STAGES: gl.constexpr,
        SUM_BUFFERS: gl.constexpr,
        SUM_AT: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        """out[g, m, n] (+)= sum over group g's rows r of grad[r, m] * x[r, n]; grad [R, M], x [R,
        K] row-major bf16/fp16, out [G, M, K] contiguous fp32 or bf16, M % BLOCK_M == 0."""
        dtype: gl.constexpr = grad.dtype.element_ty
        out_dtype: gl.constexpr = out.dtype.element_ty
        a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, BLOCK_M], dtype)
        b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, BLOCK_N], dtype)
        c_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], out_dtype)
        # one warp per 16 accumulator rows (BLOCK_M == 16 * num_warps), each wgmma the tile's full width
        gl.static_assert(16 * num_warps == BLOCK_M)
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 256 // dtype.primitive_bitwidth]
        )

        a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, BLOCK_M], a_layout)
        b_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, BLOCK_N], b_layout)
        c_bufs = gl.allocate_shared_memory(out_dtype, [SUM_BUFFERS, BLOCK_M, BLOCK_N], c_layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for j in gl.static_range(STAGES):
            mbarrier.init(ready.index(j), count=1)
        summed = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(summed, count=1)
        out_desc = tma.make_tensor_descriptor(out, [G * M, K], [K, 1], [BLOCK_M, BLOCK_N], c_layout)

        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        n_blocks = gl.cdiv(K, BLOCK_N)
        per_group = (M // BLOCK_M) * n_blocks
        n_tiles = gl.cdiv(G * per_group - pid, nprog)
        step_bytes: gl.constexpr = BLOCK_K * (BLOCK_M + BLOCK_N) * dtype.primitive_bitwidth // 8

        # The producer walks the same tiles as the consumer, STAGES - 1 loads ahead, over tile
        # boundaries: p_tile is its tile, p_row the next row block to load there.
        p_tile = 0
        p_row = 0
        _g, p_start, p_rows, p_m0, p_n0 = _tile_at(0, pid, nprog, order, ends, G, per_group, n_blocks, ORDERED, BLOCK_M, BLOCK_N)
        g_desc, x_desc = _operand_descs(grad, x, p_start, p_rows, M, K, a_layout, b_layout, BLOCK_M, BLOCK_N, BLOCK_K)
        produced = 0
        consumed = 0
        sum_phase = 0
        stored = 0  # TMA stores issued: the next one goes from sum buffer stored % SUM_BUFFERS
        for _j in gl.static_range(STAGES - 1):
            p_tile, p_row, p_m0, p_n0, p_rows, g_desc, x_desc, produced = _produce(
                grad,
                x,
                ends,
                order,
                pid,
                nprog,
                G,
                per_group,
                n_blocks,
                n_tiles,
                M,
                K,
                p_tile,
                p_row,
                p_m0,
                p_n0,
                p_rows,
                g_desc,
                x_desc,
                produced,
                ready,
                a_bufs,
                b_bufs,
                step_bytes,
                a_layout,
                b_layout,
                ORDERED,
                BLOCK_M,
                BLOCK_N,
                BLOCK_K,
                STAGES,
            )

        for i in range(n_tiles):
            g, _start, rows, m0, n0 = _tile_at(i, pid, nprog, order, ends, G, per_group, n_blocks, ORDERED, BLOCK_M, BLOCK_N)
            acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)
            for r0 in range(0, rows, BLOCK_K):
                s = consumed % STAGES
                mbarrier.wait(ready.index(s), (consumed // STAGES) & 1)
                acc = warpgroup_mma(a_bufs.index(s).permute((1, 0)), b_bufs.index(s), acc, is_async=True)
                if ACCUMULATE and r0 == gl.minimum(SUM_AT * BLOCK_K, (rows - 1) // BLOCK_K * BLOCK_K):
                    # the old sum into shared memory while the tensor cores work, once the last
                    # TMA store from this buffer has read it
                    tma.store_wait(pendings=SUM_BUFFERS - 1)
                    mbarrier.expect(summed, BLOCK_M * BLOCK_N * out_dtype.primitive_bitwidth // 8)
                    tma.async_copy_global_to_shared(out_desc, [g * M + m0, n0], summed, c_bufs.index(stored % SUM_BUFFERS))
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                consumed += 1
                p_tile, p_row, p_m0, p_n0, p_rows, g_desc, x_desc, produced = _produce(
                    grad,
                    x,
                    ends,
                    order,
                    pid,
                    nprog,
                    G,
                    per_group,
                    n_blocks,
                    n_tiles,
                    M,
                    K,
                    p_tile,
                    p_row,
                    p_m0,
                    p_n0,
                    p_rows,
                    g_desc,
                    x_desc,
                    produced,
                    ready,
                    a_bufs,
                    b_bufs,
                    step_bytes,
                    a_layout,
                    b_layout,
                    ORDERED,
                    BLOCK_M,
                    BLOCK_N,
                    BLOCK_K,
                    STAGES,
                )
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            if ACCUMULATE:
                if rows > 0:  # adding an empty expert's zeros would change nothing
                    mbarrier.wait(summed, sum_phase)
                    sum_phase ^= 1
                    acc += c_bufs.index(stored % SUM_BUFFERS).load(acc_layout).to(gl.float32)
                    _store_tile(out_desc, c_bufs.index(stored % SUM_BUFFERS), acc, g * M + m0, n0)
                    stored += 1
            else:
                tma.store_wait(pendings=SUM_BUFFERS - 1)
                _store_tile(out_desc, c_bufs.index(stored % SUM_BUFFERS), acc, g * M + m0, n0)
                stored += 1
        tma.store_wait(pendings=0)
        for j in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(j))
        mbarrier.invalidate(summed)

    @gluon.jit
    def _store_tile(out_desc, c_buf, acc, row, col):
        """acc into the shared staging buffer, then to out[row:, col:] by TMA, not waited for."""
        c_buf.store(acc.to(c_buf.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(out_desc, [row, col], c_buf)

    @gluon.jit
    def _produce(
        grad,
        x,
        ends,
        order,
        pid,
        nprog,
        G,
        per_group,
        n_blocks,
        n_tiles,
        M,
        K,
        p_tile,
        p_row,
        p_m0,
        p_n0,
        p_rows,
        g_desc,
        x_desc,
        produced,
        ready,
        a_bufs,
        b_bufs,
        step_bytes: gl.constexpr,
        a_layout: gl.constexpr,
        b_layout: gl.constexpr,
        ORDERED: gl.constexpr,
        BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        BLOCK_K: gl.constexpr,
        STAGES: gl.constexpr,
    ):
        """Issue the producer's next operand load (if any is left), moving it to the next tile
        with rows when its tile is done; returns its new state."""
        while (p_row >= p_rows) & (p_tile < n_tiles):
            p_tile += 1
            p_row = 0
            _g, p_start, p_rows, p_m0, p_n0 = _tile_at(p_tile, pid, nprog, order, ends, G, per_group, n_blocks, ORDERED, BLOCK_M, BLOCK_N)
            p_rows = gl.where(p_tile < n_tiles, p_rows, 0)
            g_desc, x_desc = _operand_descs(grad, x, p_start, p_rows, M, K, a_layout, b_layout, BLOCK_M, BLOCK_N, BLOCK_K)
        if p_tile < n_tiles:
            s = produced % STAGES
            bar = ready.index(s)
            mbarrier.expect(bar, step_bytes)
            tma.async_copy_global_to_shared(g_desc, [p_row, p_m0], bar, a_bufs.index(s))
            tma.async_copy_global_to_shared(x_desc, [p_row, p_n0], bar, b_bufs.index(s))
            produced += 1
            p_row += BLOCK_K
        return p_tile, p_row, p_m0, p_n0, p_rows, g_desc, x_desc, produced


def supports(grad: torch.Tensor, x: torch.Tensor, out: torch.Tensor, *, paired: bool = False) -> bool:
    """Whether this kernel takes the case: Gluon, an sm90 GPU, bf16/fp16 operands with 16-byte
    aligned rows, an fp32 or bf16 accumulator whose M is a multiple of BLOCK_M, unpaired."""
    if not HAVE_GLUON or paired or grad.device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if torch.cuda.get_device_capability(grad.device)[0] != 9:
        return False
    item = grad.element_size()
    return (
        grad.dtype in (torch.bfloat16, torch.float16)
        and x.dtype == grad.dtype
        and out.dtype in (torch.float32, torch.bfloat16)
        and out.is_contiguous()
        and out.shape[1] % CONFIG[0] == 0
        and grad.is_contiguous()
        and x.is_contiguous()
        and (grad.shape[1] * item) % 16 == 0
        and (x.shape[1] * item) % 16 == 0
        and (out.shape[2] * out.element_size()) % 16 == 0
        and grad.data_ptr() % 16 == 0
        and x.data_ptr() % 16 == 0
    )


def grouped_wgrad_overlap(
    grad: torch.Tensor,
    x: torch.Tensor,
    ends: torch.Tensor,
    order: torch.Tensor | None,
    out: torch.Tensor,
    *,
    accumulate: bool,
    config: tuple[int, ...] | None = None,
) -> None:
    """out[g] (+)= grad_g^T @ x_g over group g's rows (``ends`` [G] int32 on the device), experts
    visited in ``order`` (or index order when None); check :func:`supports` first."""
    from moe.kernels.grouped_wgrad import _allocate_scratch  # (that module imports this one)

    groups, m, k = out.shape
    if not (groups and m and k):
        return
    block_m, block_n, block_k, stages, sum_buffers, sum_at, warps = config or CONFIG
    tiles = groups * (m // block_m) * triton.cdiv(k, block_n)
    slots = torch.cuda.get_device_properties(grad.device).multi_processor_count
    triton.set_allocator(_allocate_scratch)
    ends = ends.to(torch.int32)
    _grouped_wgrad_overlap_kernel[(min(tiles, slots),)](
        grad,
        x,
        ends,
        ends if order is None else order,
        out,
        groups,
        m,
        k,
        ACCUMULATE=accumulate,
        ORDERED=order is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        STAGES=stages,
        SUM_BUFFERS=sum_buffers,
        SUM_AT=sum_at,
        num_warps=warps,
    )
