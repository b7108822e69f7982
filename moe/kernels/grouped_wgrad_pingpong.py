"""The expert weight gradient accumulated in the GEMM, warp-specialised: one tile's epilogue under
the next tile's main loop.

:mod:`moe.kernels.grouped_wgrad`'s Triton kernel runs each tile's epilogue (read the old fp32 sum,
add, write it back) after its main loop with the tensor cores idle: on one H200 about 0.8 ms of
the Qwen-like gate_up launch's 2.1 ms, the largest lever left in the training step. This kernel is
CUTLASS's ping-pong schedule written in Gluon (Triton's explicit dialect):

- a producer warp walks the program's tiles and feeds a ring of operand stages by TMA, each
  guarded by a ready and an empty barrier (no block-wide barrier in the main loop);
- two consumer warpgroups take the tiles in turn (even, odd): while one runs its tile's main loop
  on the tensor cores, the other adds its finished tile into the sum and stores it;
- each consumer asks TMA for its tile's old sum at the start of its main loop, into its own
  shared buffer, so the epilogue reads shared memory, not HBM.

Same contract as ``grouped_wgrad`` for the unpaired case (fp32 accumulation, each output element
summed by one tile in a fixed order over its rows: deterministic, and the same bits as the Triton
kernel); :func:`supports` says when it applies. Gluon has no interpreter: the CPU path stays on
the Triton kernel, this one is checked on the GPU (tests/kernels/grouped_wgrad_pingpong_gpu_check.py)
and compiled for sm90 in the CPU tests.
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

# (BLOCK_M, BLOCK_N, BLOCK_K, STAGES): each consumer's tile is BLOCK_M x BLOCK_N fp32 in one
# warpgroup's registers (128 x 128: 128 per thread); its old sum takes 64 KiB of shared memory, two
# of them beside three 32 KiB operand stages (or six 16 KiB ones) fill an sm90 block's 227 KiB.
CONFIGS = {
    "6 stages of 32 rows": (128, 128, 32, 6, False),
    "10 stages of 32 rows, halves": (128, 128, 32, 10, True),
    "5 stages of 64 rows, halves": (128, 128, 64, 5, True),
}
# MOE_WGRAD_PINGPONG_STAGES=6 picks the other config for a side-by-side in the step.
CONFIG = next(c for c in CONFIGS.values() if c[3] == int(os.environ.get("MOE_WGRAD_PINGPONG_STAGES", "6")))
CONSUMER_REGS, MAX_REGS = 232, 168  # per thread: 12 warps share 64K registers, the producer gets the rest (40)
# MOE_WGRAD_KERNEL=pingpong routes the unpaired wgrad here (opt-in until measured on the GPU).
USE_PINGPONG = os.environ.get("MOE_WGRAD_KERNEL", "triton") == "pingpong"

if HAVE_GLUON:

    @gluon.jit
    def _tile_at(i, pid, nprog, order, ends, per_group, n_blocks, ORDERED: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
        """(expert, its first row, its rows, first output row, first output column) of this
        program's i-th tile: tiles round-robin over programs, expert-major, experts in ``order``
        (heaviest first) when ORDERED."""
        tile = pid + i * nprog
        slot = tile // per_group
        rest = tile % per_group
        g = gl.load(order + slot) if ORDERED else slot
        start = gl.load(ends + g - 1, mask=g > 0, other=0)
        rows = gl.load(ends + g) - start
        return g, start, rows, (rest // n_blocks) * BLOCK_M, (rest % n_blocks) * BLOCK_N

    @gluon.jit
    def _producer(
        grad, x, ends, order, M, K, pid, nprog, n_tiles, per_group, n_blocks, a_bufs, b_bufs, ready, empty,
        ORDERED: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, STEP_BYTES: gl.constexpr,
    ):  # fmt: skip
        """Operand loads for every tile of this program, in tile order, through the stage ring:
        TMA descriptors over each expert's own rows (the hardware zero-fills past its last row)."""
        a_layout: gl.constexpr = a_bufs.type.layout
        b_layout: gl.constexpr = b_bufs.type.layout
        count = 0
        for i in range(n_tiles):
            _g, start, rows, m0, n0 = _tile_at(i, pid, nprog, order, ends, per_group, n_blocks, ORDERED, BLOCK_M, BLOCK_N)
            start64 = start.to(gl.int64)
            shape_rows = gl.maximum(rows, 1)  # a descriptor needs a non-empty box; no load happens then
            g_desc = tma.make_tensor_descriptor(grad + start64 * M, [shape_rows, M], [M, 1], [BLOCK_K, BLOCK_M], a_layout)
            x_desc = tma.make_tensor_descriptor(x + start64 * K, [shape_rows, K], [K, 1], [BLOCK_K, BLOCK_N], b_layout)
            for r0 in range(0, rows, BLOCK_K):
                s = count % STAGES
                mbarrier.wait(empty.index(s), ((count // STAGES) & 1) ^ 1)
                bar = ready.index(s)
                mbarrier.expect(bar, STEP_BYTES)
                tma.async_copy_global_to_shared(g_desc, [r0, m0], bar, a_bufs.index(s))
                tma.async_copy_global_to_shared(x_desc, [r0, n0], bar, b_bufs.index(s))
                count += 1

    @gluon.jit
    def _add_and_store(part, c_buf, sum_bar, phase, out_desc, row, col, ACCUMULATE: gl.constexpr):
        """part (+ the old sum TMA brought into c_buf, when ACCUMULATE) into c_buf, then to
        out[row:, col:] by TMA, not waited for; returns the sum barrier's next phase."""
        if ACCUMULATE:
            mbarrier.wait(sum_bar, phase)
            phase ^= 1
            part += c_buf.load(part.type.layout).to(gl.float32)
        c_buf.store(part.to(c_buf.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(out_desc, [row, col], c_buf)
        return phase

    @gluon.jit
    def _consume(
        ROLE: gl.constexpr, ends, order, out_desc, M, K, pid, nprog, n_tiles, per_group, n_blocks, a_bufs, b_bufs, c_bufs, ready, empty, summed, turn,
        ACCUMULATE: gl.constexpr, ORDERED: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
        SPLIT: gl.constexpr, SUM_BYTES: gl.constexpr,
    ):  # fmt: skip
        """Consumer ROLE's tiles (i % 2 == ROLE): main loop on the tensor cores, then the old sum
        (asked of TMA when the main loop began) added and stored, not waited for."""
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
        c_buf = c_bufs.index(ROLE)
        sum_bar = summed.index(ROLE)
        count = 0  # operand stages consumed by both consumers before this tile
        phase = 0
        mine = 0  # this consumer's tiles so far
        for i in range(n_tiles):
            g, _start, rows, m0, n0 = _tile_at(i, pid, nprog, order, ends, per_group, n_blocks, ORDERED, BLOCK_M, BLOCK_N)
            steps = gl.cdiv(rows, BLOCK_K)
            if i % 2 == ROLE:
                row = g * M + m0
                live = rows > 0
                if ACCUMULATE:
                    tma.store_wait(pendings=0)  # this buffer's last store has left it
                    mbarrier.expect(sum_bar, SUM_BYTES, pred=live)
                    tma.async_copy_global_to_shared(out_desc, [row, n0], sum_bar, c_buf, pred=live)
                acc = gl.full((BLOCK_M, BLOCK_N), 0.0, gl.float32, acc_layout)  # (gl.zeros is a call: no warp count in a partition)
                # The consumers' main loops take turns: this one waits for stages only once the other
                # has waited for all of its tile's (a stage's barrier phase is then never two behind).
                mbarrier.wait(turn.index(ROLE), (mine & 1) ^ (1 - ROLE))
                mine += 1
                for j in range(steps):
                    s = (count + j) % STAGES
                    mbarrier.wait(ready.index(s), ((count + j) // STAGES) & 1)
                    acc = warpgroup_mma(a_bufs.index(s).permute((1, 0)), b_bufs.index(s), acc, is_async=True)
                    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                    mbarrier.arrive(empty.index((count + j + STAGES - 1) % STAGES), count=1, pred=j > 0)  # the step before has retired
                mbarrier.arrive(turn.index(1 - ROLE), count=1)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                mbarrier.arrive(empty.index((count + steps + STAGES - 1) % STAGES), count=1, pred=live)
                if SPLIT:  # the tile in two column halves through a half-size buffer
                    left, right = gl.split(acc.reshape([BLOCK_M, 2, BLOCK_N // 2]).permute([0, 2, 1]))
                    if ACCUMULATE:
                        if live:  # adding an empty expert's zeros would change nothing
                            phase = _add_and_store(left, c_buf, sum_bar, phase, out_desc, row, n0, True)
                            tma.store_wait(pendings=0)
                            mbarrier.expect(sum_bar, SUM_BYTES)
                            tma.async_copy_global_to_shared(out_desc, [row, n0 + BLOCK_N // 2], sum_bar, c_buf)
                            phase = _add_and_store(right, c_buf, sum_bar, phase, out_desc, row, n0 + BLOCK_N // 2, True)
                    else:
                        tma.store_wait(pendings=0)
                        phase = _add_and_store(left, c_buf, sum_bar, phase, out_desc, row, n0, False)
                        tma.store_wait(pendings=0)
                        phase = _add_and_store(right, c_buf, sum_bar, phase, out_desc, row, n0 + BLOCK_N // 2, False)
                elif ACCUMULATE:
                    if live:
                        phase = _add_and_store(acc, c_buf, sum_bar, phase, out_desc, row, n0, True)
                else:
                    tma.store_wait(pendings=0)
                    phase = _add_and_store(acc, c_buf, sum_bar, phase, out_desc, row, n0, False)
            count += steps
        tma.store_wait(pendings=0)

    @gluon.jit
    def _grouped_wgrad_pingpong_kernel(
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
        SPLIT: gl.constexpr,
        CONSUMER_REGS: gl.constexpr,
    ):
        """out[g, m, n] (+)= sum over group g's rows r of grad[r, m] * x[r, n]; grad [R, M], x [R,
        K] row-major bf16/fp16, out [G, M, K] contiguous fp32 or bf16, M % BLOCK_M == 0."""
        dtype: gl.constexpr = grad.dtype.element_ty
        out_dtype: gl.constexpr = out.dtype.element_ty
        a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, BLOCK_M], dtype)
        b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, BLOCK_N], dtype)
        SUM_N: gl.constexpr = BLOCK_N // 2 if SPLIT else BLOCK_N  # the old-sum buffer's columns
        c_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, SUM_N], out_dtype)
        a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, BLOCK_M], a_layout)
        b_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, BLOCK_N], b_layout)
        c_bufs = gl.allocate_shared_memory(out_dtype, [2, BLOCK_M, SUM_N], c_layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        summed = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for j in gl.static_range(STAGES):
            mbarrier.init(ready.index(j), count=1)
            mbarrier.init(empty.index(j), count=1)
        for j in gl.static_range(2):
            mbarrier.init(summed.index(j), count=1)
            mbarrier.init(turn.index(j), count=1)
        out_desc = tma.make_tensor_descriptor(out, [G * M, K], [K, 1], [BLOCK_M, SUM_N], c_layout)

        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        n_blocks = gl.cdiv(K, BLOCK_N)
        per_group = (M // BLOCK_M) * n_blocks
        n_tiles = gl.cdiv(G * per_group - pid, nprog)
        STEP_BYTES: gl.constexpr = BLOCK_K * (BLOCK_M + BLOCK_N) * dtype.primitive_bitwidth // 8
        SUM_BYTES: gl.constexpr = BLOCK_M * SUM_N * out_dtype.primitive_bitwidth // 8
        # the producer in the kernel's own warps (one warpgroup: it needs few registers), each
        # consumer a worker warpgroup with most of the register file
        gl.warp_specialize(
            [
                (_producer, (grad, x, ends, order, M, K, pid, nprog, n_tiles, per_group, n_blocks, a_bufs, b_bufs, ready, empty,
                             ORDERED, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, STEP_BYTES)),
                (_consume, (0, ends, order, out_desc, M, K, pid, nprog, n_tiles, per_group, n_blocks, a_bufs, b_bufs, c_bufs,
                            ready, empty, summed, turn, ACCUMULATE, ORDERED, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, SPLIT, SUM_BYTES)),
                (_consume, (1, ends, order, out_desc, M, K, pid, nprog, n_tiles, per_group, n_blocks, a_bufs, b_bufs, c_bufs,
                            ready, empty, summed, turn, ACCUMULATE, ORDERED, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, SPLIT, SUM_BYTES)),
            ],
            [4, 4],
            [CONSUMER_REGS, CONSUMER_REGS],
        )  # fmt: skip


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


def grouped_wgrad_pingpong(
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
    block_m, block_n, block_k, stages, split = config or CONFIG
    tiles = groups * (m // block_m) * triton.cdiv(k, block_n)
    slots = torch.cuda.get_device_properties(grad.device).multi_processor_count
    triton.set_allocator(_allocate_scratch)
    ends = ends.to(torch.int32)
    _grouped_wgrad_pingpong_kernel[(min(tiles, slots),)](
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
        SPLIT=split,
        CONSUMER_REGS=CONSUMER_REGS,
        num_warps=4,
        maxnreg=MAX_REGS,
    )
