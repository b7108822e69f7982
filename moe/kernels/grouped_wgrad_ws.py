"""The expert weight gradient accumulated in the GEMM, warp-specialised, with the old sum fetched
under the main loop.

:mod:`moe.kernels.grouped_wgrad`'s Triton kernel reads each tile's old fp32 sum after its main loop
(two TMA loads waited for in turn, while every SM does the same): on one H200 about 0.5 ms of the
OLMoE-width gate_up launch's 2.1 ms. This Gluon kernel keeps the Triton kernel's 128 x 256 tile and
its main loop (two consumer warpgroups, 64 rows each, fed by a producer warpgroup through a ring of
TMA stages guarded by ready/empty barriers) and moves the old sum's read off the critical path:

- the producer, ``LEAD`` steps before a tile's main loop ends, asks TMA for the first half of the
  tile's old sum (two 64 x 64 strips per consumer) into four shared slots;
- each consumer adds its tile in four column strips: the first two from those slots, the last two
  loaded by the consumer itself into the slots its first two stores have left.

Same contract as ``grouped_wgrad``, paired micro-batches included (fp32 accumulation, each output element
summed by one tile in a fixed order over its rows: deterministic, and the same bits as the Triton
kernel); :func:`supports` says when it applies, and there it is the default (``MOE_WGRAD_KERNEL=triton``
keeps the Triton kernel for a side-by-side). Gluon has no interpreter: the CPU path stays on the
Triton kernel, this one is checked on the GPU (tests/kernels/grouped_wgrad_ws_gpu_check.py) and
compiled for sm90 in the CPU tests.
"""

from __future__ import annotations

import os

import torch

from moe.kernels.routing import HAVE_TRITON
from moe.switches import choice

try:
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

    HAVE_GLUON = HAVE_TRITON
except ImportError:  # a Triton without Gluon: the Triton kernel serves
    HAVE_GLUON = False

# (BLOCK_M, BLOCK_N, BLOCK_K, STAGES, LEAD): the Triton kernel's tile in six 24 KiB stages of 32 rows
# beside four 16 KiB old-sum slots (213 KiB); LEAD: main-loop steps before a tile's end at which its
# old sum is asked for. Chosen on an H100 over three stage shapes and two leads (bench/NOTES.md, "Three
# wgrad kernels against the exposed epilogue"): 1.11-1.20x the Triton kernel on random routing.
CONFIG = (128, 256, 32, 6, 16)
CONFIGS = {"k32-s6-lead16": CONFIG}
CONSUMER_REGS, MAX_REGS = 232, 168  # per thread: 12 warps share 64K registers, the producer gets the rest (40)
# The default on sm90 wherever it applies; MOE_WGRAD_KERNEL=triton keeps the Triton kernel (side-by-sides).
USE_WS = choice("MOE_WGRAD_KERNEL") == "ws"

if HAVE_GLUON:

    @gluon.jit
    def _rows_of(ends, g):
        """(first row, rows) of group g over ``ends``."""
        start = gl.load(ends + g - 1, mask=g > 0, other=0)
        return start, gl.load(ends + g) - start

    @gluon.jit
    def _tile_at(i, pid, nprog, order, ends, per_group, n_blocks, ORDERED: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
        """(expert, its first row, its rows, first output row, first output column) of this
        program's i-th tile: tiles round-robin over programs, expert-major, experts in ``order``
        (heaviest first) when ORDERED."""
        tile = pid + i * nprog
        slot = tile // per_group
        rest = tile % per_group
        g = gl.load(order + slot) if ORDERED else slot
        start, rows = _rows_of(ends, g)
        return g, start, rows, (rest // n_blocks) * BLOCK_M, (rest % n_blocks) * BLOCK_N

    @gluon.jit
    def _operand_descs(
        grad, x, start, rows, M, K, a_layout: gl.constexpr, b_layout: gl.constexpr, BLOCK_K: gl.constexpr, HALF_M: gl.constexpr, BLOCK_N: gl.constexpr
    ):
        """TMA descriptors over one expert's rows of grad and x (the hardware zero-fills past its
        last row; an empty expert gets a one-row box that is never loaded)."""
        start64 = start.to(gl.int64)
        shape_rows = gl.maximum(rows, 1)
        g_desc = tma.make_tensor_descriptor(grad + start64 * M, [shape_rows, M], [M, 1], [BLOCK_K, HALF_M], a_layout)
        x_desc = tma.make_tensor_descriptor(x + start64 * K, [shape_rows, K], [K, 1], [BLOCK_K, BLOCK_N], b_layout)
        return g_desc, x_desc

    @gluon.jit
    def _fetch_old_sum(
        out_desc, c_bufs, c_ready, c_free, fetched, g, M, m0, n0, HALF_M: gl.constexpr, STRIP: gl.constexpr, STRIP_BYTES: gl.constexpr
    ):
        """The first half of a tile's old sum (slot 2r + q: consumer r's strip q) into the four
        shared slots, once the consumers have released them."""
        for slot in gl.static_range(4):
            mbarrier.wait(c_free.index(slot), (fetched & 1) ^ 1)
            mbarrier.expect(c_ready.index(slot), STRIP_BYTES)
            at = [g * M + m0 + (slot // 2) * HALF_M, n0 + (slot % 2) * STRIP]
            tma.async_copy_global_to_shared(out_desc, at, c_ready.index(slot), c_bufs.index(slot))
        return fetched + 1

    @gluon.jit
    def _load_rows(
        g_desc, x_desc, steps, done, fetch_at, count, fetched, out_desc, g, M, m0, n0, a0_bufs, a1_bufs, b_bufs, c_bufs, ready, empty,
        c_ready, c_free, ACCUMULATE: gl.constexpr, HALF_M: gl.constexpr, STRIP: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
        STEP_BYTES: gl.constexpr, STRIP_BYTES: gl.constexpr,
    ):  # fmt: skip
        """``steps`` main-loop steps' operands through the stage ring, the tile's ``done`` steps
        before them; the old sum asked for at the tile's step ``fetch_at``."""
        for j in range(steps):
            if ACCUMULATE:  # noqa: SIM102 (a compile-time branch around a run-time one)
                if done + j == fetch_at:
                    fetched = _fetch_old_sum(out_desc, c_bufs, c_ready, c_free, fetched, g, M, m0, n0, HALF_M, STRIP, STRIP_BYTES)
            s = count % STAGES
            mbarrier.wait(empty.index(s), ((count // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, STEP_BYTES)
            tma.async_copy_global_to_shared(g_desc, [j * BLOCK_K, m0], bar, a0_bufs.index(s))
            tma.async_copy_global_to_shared(g_desc, [j * BLOCK_K, m0 + HALF_M], bar, a1_bufs.index(s))
            tma.async_copy_global_to_shared(x_desc, [j * BLOCK_K, n0], bar, b_bufs.index(s))
            count += 1
        return count, fetched

    @gluon.jit
    def _producer(
        grad, x, ends, grad2, x2, ends2, order, out_desc, M, K, pid, nprog, n_tiles, per_group, n_blocks, a0_bufs, a1_bufs, b_bufs,
        c_bufs, ready, empty, c_ready, c_free, ACCUMULATE: gl.constexpr, ORDERED: gl.constexpr, PAIRED: gl.constexpr,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, LEAD: gl.constexpr,
        STEP_BYTES: gl.constexpr, STRIP_BYTES: gl.constexpr,
    ):  # fmt: skip
        """Operand loads for every tile of this program through the stage ring (the expert's rows
        of grad and x, then, when PAIRED, its rows of grad2 and x2), and each tile's first
        old-sum strips LEAD steps before its end."""
        HALF_M: gl.constexpr = BLOCK_M // 2
        STRIP: gl.constexpr = BLOCK_N // 4
        a_layout: gl.constexpr = a0_bufs.type.layout
        b_layout: gl.constexpr = b_bufs.type.layout
        count = 0
        fetched = 0  # old-sum prefetches so far
        for i in range(n_tiles):
            g, start, rows, m0, n0 = _tile_at(i, pid, nprog, order, ends, per_group, n_blocks, ORDERED, BLOCK_M, BLOCK_N)
            steps = gl.cdiv(rows, BLOCK_K)
            total = steps
            if PAIRED:
                start2, rows2 = _rows_of(ends2, g)
                total += gl.cdiv(rows2, BLOCK_K)
            fetch_at = gl.maximum(total - LEAD, 0)
            g_desc, x_desc = _operand_descs(grad, x, start, rows, M, K, a_layout, b_layout, BLOCK_K, HALF_M, BLOCK_N)
            count, fetched = _load_rows(
                g_desc, x_desc, steps, 0, fetch_at, count, fetched, out_desc, g, M, m0, n0, a0_bufs, a1_bufs, b_bufs, c_bufs, ready,
                empty, c_ready, c_free, ACCUMULATE, HALF_M, STRIP, BLOCK_K, STAGES, STEP_BYTES, STRIP_BYTES,
            )  # fmt: skip
            if PAIRED:
                g_desc2, x_desc2 = _operand_descs(grad2, x2, start2, rows2, M, K, a_layout, b_layout, BLOCK_K, HALF_M, BLOCK_N)
                count, fetched = _load_rows(
                    g_desc2, x_desc2, total - steps, steps, fetch_at, count, fetched, out_desc, g, M, m0, n0, a0_bufs, a1_bufs,
                    b_bufs, c_bufs, ready, empty, c_ready, c_free, ACCUMULATE, HALF_M, STRIP, BLOCK_K, STAGES, STEP_BYTES, STRIP_BYTES,
                )  # fmt: skip

    @gluon.jit
    def _strip_out(part, buf, bar, phase, out_desc, row, col, ACCUMULATE: gl.constexpr):
        """part (+ the old sum TMA brought into buf, when ACCUMULATE) into buf, then to out[row:,
        col:] by TMA, not waited for; the row sums of squares of what was stored."""
        if ACCUMULATE:
            mbarrier.wait(bar, phase)
            part += buf.load(part.type.layout).to(gl.float32)
        stored = part.to(buf.dtype)
        buf.store(stored)
        fence_async_shared()
        tma.async_copy_shared_to_global(out_desc, [row, col], buf)
        stored = stored.to(gl.float32)
        return gl.sum(stored * stored, axis=1)  # not computed where the caller drops it (SQUARES off)

    @gluon.jit
    def _store_row_sums(sums, sq, row, n0, n_blocks, ROWS: gl.constexpr, BLOCK_N: gl.constexpr):
        """sq[row + i, n0 // BLOCK_N] = sums[i] (sq viewed as [G * M, n_blocks])."""
        at = (row.to(gl.int64) + gl.arange(0, ROWS, layout=sums.type.layout)) * n_blocks + n0 // BLOCK_N
        gl.store(sq + at, sums)

    @gluon.jit
    def _quarters(acc, ROWS: gl.constexpr, COLS: gl.constexpr):
        """acc [ROWS, COLS] as four column strips, left to right."""
        h0, h1 = gl.split(acc.reshape([ROWS, 2, COLS // 2]).permute([0, 2, 1]))
        q0, q1 = gl.split(h0.reshape([ROWS, 2, COLS // 4]).permute([0, 2, 1]))
        q2, q3 = gl.split(h1.reshape([ROWS, 2, COLS // 4]).permute([0, 2, 1]))
        return q0, q1, q2, q3

    @gluon.jit
    def _consume(
        ROLE: gl.constexpr, ends, ends2, order, out_desc, sq, M, pid, nprog, n_tiles, per_group, n_blocks, a_bufs, b_bufs, c_bufs, ready, empty,
        c_ready, c_free, ACCUMULATE: gl.constexpr, ORDERED: gl.constexpr, PAIRED: gl.constexpr, SQUARES: gl.constexpr,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, STRIP_BYTES: gl.constexpr,
    ):  # fmt: skip
        """Consumer ROLE: rows ROLE * 64 onward of every tile, main loop on the tensor cores, then
        the tile added into the old sum in four column strips (SQUARES: each stored row's sum of
        squares into sq[expert, row, column block])."""
        HALF_M: gl.constexpr = BLOCK_M // 2
        STRIP: gl.constexpr = BLOCK_N // 4
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
        buf0 = c_bufs.index(2 * ROLE)
        buf1 = c_bufs.index(2 * ROLE + 1)
        bar0 = c_ready.index(2 * ROLE)
        bar1 = c_ready.index(2 * ROLE + 1)
        count = 0
        owed = 0  # whether this consumer's slots await release to the producer
        for i in range(n_tiles):
            g, _start, rows, m0, n0 = _tile_at(i, pid, nprog, order, ends, per_group, n_blocks, ORDERED, BLOCK_M, BLOCK_N)
            steps = gl.cdiv(rows, BLOCK_K)
            if PAIRED:  # the second micro-batch's rows in the same sum
                _start2, rows2 = _rows_of(ends2, g)
                steps += gl.cdiv(rows2, BLOCK_K)
            live = steps > 0
            if ACCUMULATE:  # noqa: SIM102 (a compile-time branch around a run-time one)
                if owed == 1:  # the last tile's stores have long left the slots
                    tma.store_wait(pendings=0)
                    mbarrier.arrive(c_free.index(2 * ROLE), count=1)
                    mbarrier.arrive(c_free.index(2 * ROLE + 1), count=1)
                    owed = 0
            acc = gl.full((HALF_M, BLOCK_N), 0.0, gl.float32, acc_layout)  # (gl.zeros is a call: no warp count in a partition)
            for j in range(steps):
                s = (count + j) % STAGES
                mbarrier.wait(ready.index(s), ((count + j) // STAGES) & 1)
                acc = warpgroup_mma(a_bufs.index(s).permute((1, 0)), b_bufs.index(s), acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                mbarrier.arrive(empty.index((count + j + STAGES - 1) % STAGES), count=1, pred=j > 0)  # the step before has retired
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(empty.index((count + steps + STAGES - 1) % STAGES), count=1, pred=live)
            count += steps
            row = g * M + m0 + ROLE * HALF_M
            q0, q1, q2, q3 = _quarters(acc, HALF_M, BLOCK_N)
            if ACCUMULATE:
                if live:  # adding an empty expert's zeros would change nothing
                    s0 = _strip_out(q0, buf0, bar0, 0, out_desc, row, n0, True)
                    s1 = _strip_out(q1, buf1, bar1, 0, out_desc, row, n0 + STRIP, True)
                    tma.store_wait(pendings=1)  # the first strip's store has left buf0
                    mbarrier.expect(bar0, STRIP_BYTES)
                    tma.async_copy_global_to_shared(out_desc, [row, n0 + 2 * STRIP], bar0, buf0)
                    tma.store_wait(pendings=0)
                    mbarrier.expect(bar1, STRIP_BYTES)
                    tma.async_copy_global_to_shared(out_desc, [row, n0 + 3 * STRIP], bar1, buf1)
                    s2 = _strip_out(q2, buf0, bar0, 1, out_desc, row, n0 + 2 * STRIP, True)
                    s3 = _strip_out(q3, buf1, bar1, 1, out_desc, row, n0 + 3 * STRIP, True)
                    owed = 1
                    if SQUARES:
                        _store_row_sums(s0 + s1 + s2 + s3, sq, row, n0, n_blocks, HALF_M, BLOCK_N)
            else:
                tma.store_wait(pendings=0)
                s0 = _strip_out(q0, buf0, bar0, 0, out_desc, row, n0, False)
                s1 = _strip_out(q1, buf1, bar1, 0, out_desc, row, n0 + STRIP, False)
                tma.store_wait(pendings=1)
                s2 = _strip_out(q2, buf0, bar0, 0, out_desc, row, n0 + 2 * STRIP, False)
                tma.store_wait(pendings=1)
                s3 = _strip_out(q3, buf1, bar1, 0, out_desc, row, n0 + 3 * STRIP, False)
                if SQUARES:
                    _store_row_sums(s0 + s1 + s2 + s3, sq, row, n0, n_blocks, HALF_M, BLOCK_N)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _grouped_wgrad_ws_kernel(
        grad,
        x,
        ends,
        grad2,
        x2,
        ends2,
        order,
        out,
        sq,
        G,
        M,
        K,
        ACCUMULATE: gl.constexpr,
        ORDERED: gl.constexpr,
        PAIRED: gl.constexpr,
        SQUARES: gl.constexpr,
        BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        BLOCK_K: gl.constexpr,
        STAGES: gl.constexpr,
        LEAD: gl.constexpr,
        CONSUMER_REGS: gl.constexpr,
    ):
        """out[g, m, n] (+)= sum over group g's rows r of grad[r, m] * x[r, n] (then, when PAIRED,
        over its rows of grad2 and x2, in the same sum); grad [R, M], x [R, K] row-major bf16/fp16,
        out [G, M, K] contiguous fp32 or bf16, M % BLOCK_M == 0; SQUARES: each stored row's sum of
        squares into ``sq`` [G, M, cdiv(K, BLOCK_N)] fp32 (rows of experts skipped are not written)."""
        dtype: gl.constexpr = grad.dtype.element_ty
        out_dtype: gl.constexpr = out.dtype.element_ty
        HALF_M: gl.constexpr = BLOCK_M // 2
        STRIP: gl.constexpr = BLOCK_N // 4
        a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, HALF_M], dtype)
        b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, BLOCK_N], dtype)
        c_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF_M, STRIP], out_dtype)
        a0_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, HALF_M], a_layout)
        a1_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, HALF_M], a_layout)
        b_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, BLOCK_N], b_layout)
        c_bufs = gl.allocate_shared_memory(out_dtype, [4, HALF_M, STRIP], c_layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        c_ready = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
        c_free = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
        for j in gl.static_range(STAGES):
            mbarrier.init(ready.index(j), count=1)
            mbarrier.init(empty.index(j), count=2)  # both consumers read every stage
        for j in gl.static_range(4):
            mbarrier.init(c_ready.index(j), count=1)
            mbarrier.init(c_free.index(j), count=1)
        out_desc = tma.make_tensor_descriptor(out, [G * M, K], [K, 1], [HALF_M, STRIP], c_layout)

        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        n_blocks = gl.cdiv(K, BLOCK_N)
        per_group = (M // BLOCK_M) * n_blocks
        n_tiles = gl.cdiv(G * per_group - pid, nprog)
        STEP_BYTES: gl.constexpr = BLOCK_K * (BLOCK_M + BLOCK_N) * dtype.primitive_bitwidth // 8
        STRIP_BYTES: gl.constexpr = HALF_M * STRIP * out_dtype.primitive_bitwidth // 8
        # the producer in the kernel's own warps (one warpgroup: it needs few registers), each
        # consumer a worker warpgroup with most of the register file
        gl.warp_specialize(
            [
                (_producer, (grad, x, ends, grad2, x2, ends2, order, out_desc, M, K, pid, nprog, n_tiles, per_group, n_blocks, a0_bufs, a1_bufs,
                             b_bufs, c_bufs, ready, empty, c_ready, c_free, ACCUMULATE, ORDERED, PAIRED, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, LEAD,
                             STEP_BYTES, STRIP_BYTES)),
                (_consume, (0, ends, ends2, order, out_desc, sq, M, pid, nprog, n_tiles, per_group, n_blocks, a0_bufs, b_bufs, c_bufs,
                            ready, empty, c_ready, c_free, ACCUMULATE, ORDERED, PAIRED, SQUARES, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, STRIP_BYTES)),
                (_consume, (1, ends, ends2, order, out_desc, sq, M, pid, nprog, n_tiles, per_group, n_blocks, a1_bufs, b_bufs, c_bufs,
                            ready, empty, c_ready, c_free, ACCUMULATE, ORDERED, PAIRED, SQUARES, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, STRIP_BYTES)),
            ],
            [4, 4],
            [CONSUMER_REGS, CONSUMER_REGS],
        )  # fmt: skip


def allocate_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Global memory for the tensor descriptors a kernel makes on the device (this one's and
    moe.kernels.grouped_wgrad's)."""
    device = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    return torch.empty(size, dtype=torch.int8, device=device)


def supports(grad: torch.Tensor, x: torch.Tensor, out: torch.Tensor, *, pair: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> bool:
    """Whether this kernel takes the case: Gluon, an sm90 GPU, bf16/fp16 operands with 16-byte
    aligned rows (a second micro-batch's too, when ``pair`` is given), an fp32 or bf16 accumulator
    whose M is a multiple of BLOCK_M."""
    if not HAVE_GLUON or grad.device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if torch.cuda.get_device_capability(grad.device)[0] != 9:
        return False
    if not (out.dtype in (torch.float32, torch.bfloat16) and out.is_contiguous() and out.shape[1] % CONFIG[0] == 0):
        return False
    if (out.shape[2] * out.element_size()) % 16 != 0:
        return False
    return _operands_fit(grad, x) and (pair is None or (_operands_fit(pair[0], pair[1]) and pair[0].dtype == grad.dtype))


def _operands_fit(grad: torch.Tensor, x: torch.Tensor) -> bool:
    """bf16/fp16 operands of one dtype, contiguous, on the GPU, rows and base 16-byte aligned (TMA)."""
    item = grad.element_size()
    return (
        grad.dtype in (torch.bfloat16, torch.float16)
        and x.dtype == grad.dtype
        and grad.device.type == "cuda"
        and x.device.type == "cuda"
        and grad.is_contiguous()
        and x.is_contiguous()
        and (grad.shape[1] * item) % 16 == 0
        and (x.shape[1] * item) % 16 == 0
        and grad.data_ptr() % 16 == 0
        and x.data_ptr() % 16 == 0
    )


def grouped_wgrad_ws(
    grad: torch.Tensor,
    x: torch.Tensor,
    ends: torch.Tensor,
    order: torch.Tensor | None,
    out: torch.Tensor,
    *,
    accumulate: bool,
    config: tuple[int, ...] | None = None,
    pair: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    squares: torch.Tensor | None = None,
) -> None:
    """out[g] (+)= grad_g^T @ x_g over group g's rows (``ends`` [G] int32 on the device), experts
    visited in ``order`` (or index order when None); ``pair``: a second micro-batch's (grad, x,
    ends) in the same sum (optim.expert_wgrad=paired); ``squares`` [G, M, cdiv(K, BLOCK_N)] fp32:
    each stored row's sum of squares per column block. Check :func:`supports` first."""
    groups, m, k = out.shape
    if not (groups and m and k):
        return
    block_m, block_n, block_k, stages, lead = config or CONFIG
    tiles = groups * (m // block_m) * triton.cdiv(k, block_n)
    slots = torch.cuda.get_device_properties(grad.device).multi_processor_count
    triton.set_allocator(allocate_scratch)
    ends = ends.to(torch.int32)
    grad2, x2, ends2 = (pair[0], pair[1], pair[2].to(torch.int32)) if pair is not None else (grad, x, ends)  # not read unless PAIRED
    _grouped_wgrad_ws_kernel[(min(tiles, slots),)](
        grad,
        x,
        ends,
        grad2,
        x2,
        ends2,
        ends if order is None else order,
        out,
        out if squares is None else squares,
        groups,
        m,
        k,
        ACCUMULATE=accumulate,
        ORDERED=order is not None,
        PAIRED=pair is not None,
        SQUARES=squares is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        STAGES=stages,
        LEAD=lead,
        CONSUMER_REGS=CONSUMER_REGS,
        num_warps=4,
        maxnreg=MAX_REGS,
    )
