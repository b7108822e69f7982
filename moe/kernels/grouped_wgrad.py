"""The expert weight gradient with the gradient accumulation inside the GEMM.

With micro-batches, every expert weight's gradient used to be written by torch's grouped GEMM
(bf16) and then added into the fp32 accumulator by a separate pass that reads both and writes
one: 10 bytes per expert parameter per micro-batch on top of the GEMM's own 2-byte write
(Megatron calls the cure gradient-accumulation fusion). Here one persistent Triton grouped GEMM
computes out[g] (+)= grad_g^T @ x_g over each expert's rows and adds into ``out`` (fp32, or bf16
for bf16 accumulation) in its epilogue, so the gradient is never stored on its own.

The rows of both operands are contiguous per expert, so each tile reads them through TMA tensor
descriptors made on the device for its expert ([rows_g, M] and [rows_g, K]): the hardware
zero-fills past the expert's last row, no masks in the loop.

Two things keep skewed routing (a few experts with most rows, early in training) cheap: the
experts are visited heaviest first (an order ranked on the device, :func:`_rank_kernel`), so the
fixed round-robin of tiles over the persistent programs spreads the long tiles evenly; and an
expert without rows costs nothing when accumulating (adding zero leaves the sum as it was). Each
output element is computed by one tile, in a fixed order over its rows, wherever the tile runs:
results are deterministic, and the same bits in either order.

On sm90 it goes to :mod:`moe.kernels.grouped_wgrad_ws` (the same tile, warp-specialised, the old sum
fetched under the main loop; the same bits; paired micro-batches too), which this module's kernel
backs everywhere else (CPU, the interpreter, ``MOE_WGRAD_KERNEL=triton``).
"""

from __future__ import annotations

import os

import torch

from moe.kernels import grouped_wgrad_ws as ws
from moe.kernels.routing import HAVE_TRITON, use_triton
from moe.switches import choice

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _tile_of(tile, per_group, n_blocks, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """(expert, first row, first column) of a persistent loop's tile, expert-major."""
        rest = tile % per_group
        return tile // per_group, (rest // n_blocks) * BLOCK_M, (rest % n_blocks) * BLOCK_N

    @triton.jit
    def _row_squares(sums, sq, g, m0, n0, M, n_blocks, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """sq[g, m0 + i, n0 // BLOCK_N] = sums[i]: a tile's row sums of squares (rows past M are
        not stored)."""
        rows = m0 + tl.arange(0, BLOCK_M)
        at = (g.to(tl.int64) * M + rows) * n_blocks + n0 // BLOCK_N
        tl.store(sq + at, sums, mask=rows < M)

    @triton.jit
    def _add_tile(
        out, out_desc, acc, g, m0, n0, ACCUMULATE: tl.constexpr, SPLIT_EPILOGUE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        sq, M, n_blocks, SQUARES: tl.constexpr,
    ):  # fmt: skip
        """out[g, m0:, n0:] (+)= acc through the [G, M, K] accumulator's descriptor (boxes of one
        expert's rows: a tile past M or K is clipped), in two column halves when SPLIT_EPILOGUE
        (the staging buffer of a wide fp32 tile then fits in shared memory); SQUARES: each stored
        row's sum of squares into ``sq`` (:func:`_row_squares`)."""
        HALF: tl.constexpr = BLOCK_N // 2
        dtype = out.dtype.element_ty
        if SPLIT_EPILOGUE:
            left, right = tl.split(acc.reshape(BLOCK_M, 2, HALF).permute(0, 2, 1))
            if ACCUMULATE:
                left += out_desc.load([g, m0, n0]).reshape(BLOCK_M, HALF).to(tl.float32)
            left = left.to(dtype)
            out_desc.store([g, m0, n0], left.reshape(1, BLOCK_M, HALF))
            if ACCUMULATE:
                right += out_desc.load([g, m0, n0 + HALF]).reshape(BLOCK_M, HALF).to(tl.float32)
            right = right.to(dtype)
            out_desc.store([g, m0, n0 + HALF], right.reshape(1, BLOCK_M, HALF))
            if SQUARES:
                left, right = left.to(tl.float32), right.to(tl.float32)
                _row_squares(tl.sum(left * left, axis=1) + tl.sum(right * right, axis=1), sq, g, m0, n0, M, n_blocks, BLOCK_M, BLOCK_N)
        else:
            if ACCUMULATE:
                acc += out_desc.load([g, m0, n0]).reshape(BLOCK_M, BLOCK_N).to(tl.float32)
            stored = acc.to(dtype)
            out_desc.store([g, m0, n0], stored.reshape(1, BLOCK_M, BLOCK_N))
            if SQUARES:
                stored = stored.to(tl.float32)
                _row_squares(tl.sum(stored * stored, axis=1), sq, g, m0, n0, M, n_blocks, BLOCK_M, BLOCK_N)

    @triton.jit
    def _group_rows(ends, ends2, idx, G, PAIRED: tl.constexpr):
        """Rows of groups ``idx`` (0 past G): over ``ends``, plus ``ends2``'s when PAIRED."""
        live = idx < G
        rows = tl.load(ends + idx, mask=live, other=0) - tl.load(ends + idx - 1, mask=(idx > 0) & live, other=0)
        if PAIRED:
            rows += tl.load(ends2 + idx, mask=live, other=0) - tl.load(ends2 + idx - 1, mask=(idx > 0) & live, other=0)
        return rows

    @triton.jit
    def _rank_kernel(ends, ends2, order, G, PAIRED: tl.constexpr, BLOCK: tl.constexpr):
        """order[i] = the expert with the i-th most rows (ties: the lower index first), for
        the groups ending at ``ends`` (and ``ends2``: rows summed, when PAIRED): each program
        ranks BLOCK experts against all G."""
        mine = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mine_rows = _group_rows(ends, ends2, mine, G, PAIRED)
        rank = tl.zeros((BLOCK,), dtype=tl.int32)
        for h0 in range(0, G, BLOCK):
            other = h0 + tl.arange(0, BLOCK)
            other_rows = _group_rows(ends, ends2, other, G, PAIRED)
            ahead = (other_rows[None, :] > mine_rows[:, None]) | ((other_rows[None, :] == mine_rows[:, None]) & (other[None, :] < mine[:, None]))
            ahead = ahead & (other[None, :] < G)
            rank += tl.sum(ahead.to(tl.int32), axis=1)
        tl.store(order + rank, mine, mask=mine < G)

    @triton.jit
    def _empty_squares_kernel(out, ends, ends2, sq, G, M, K, n_blocks, PAIRED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """What an accumulating wgrad launch leaves alone, for :func:`grouped_wgrad`'s ``squares``:
        the row sums of squares of the experts without rows, read from their sums (program (g, i):
        rows i * BLOCK_M onward of expert g; a program of an expert with rows does nothing)."""
        g = tl.program_id(0)
        m0 = tl.program_id(1) * BLOCK_M
        if _group_rows(ends, ends2, g, G, PAIRED) == 0:
            rows = m0 + tl.arange(0, BLOCK_M)
            for nb in range(0, n_blocks):
                cols = nb * BLOCK_N + tl.arange(0, BLOCK_N)
                mask = (rows < M)[:, None] & (cols < K)[None, :]
                v = tl.load(out + (g.to(tl.int64) * M + rows)[:, None] * K + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                _row_squares(tl.sum(v * v, axis=1), sq, g, m0, nb * BLOCK_N, M, n_blocks, BLOCK_M, BLOCK_N)

    @triton.jit
    def _add_rows(acc, grad, x, ends, g, m0, n0, M, K, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """acc + group g's grad rows^T @ its x rows (the [m0:, n0:] block), through TMA descriptors
        over the group's own rows (the hardware zero-fills past its last row)."""
        start = tl.load(ends + g - 1, mask=g > 0, other=0)
        rows = tl.load(ends + g) - start
        start64 = start.to(tl.int64)
        shape_rows = tl.maximum(rows, 1)  # a descriptor needs a non-empty box; no load happens then
        g_desc = tl.make_tensor_descriptor(grad + start64 * M, shape=[shape_rows, M], strides=[M, 1], block_shape=[BLOCK_K, BLOCK_M])
        x_desc = tl.make_tensor_descriptor(x + start64 * K, shape=[shape_rows, K], strides=[K, 1], block_shape=[BLOCK_K, BLOCK_N])
        for r0 in range(0, rows, BLOCK_K):
            g_tile = g_desc.load([r0, m0])
            x_tile = x_desc.load([r0, n0])
            if IEEE:
                acc = tl.dot(tl.trans(g_tile).to(tl.float32), x_tile.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(tl.trans(g_tile), x_tile, acc)
        return acc

    @triton.jit
    def _grouped_wgrad_kernel(
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
        ACCUMULATE: tl.constexpr,
        SPLIT_EPILOGUE: tl.constexpr,
        ORDERED: tl.constexpr,
        PAIRED: tl.constexpr,
        IEEE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SQUARES: tl.constexpr = False,
    ):
        """out[g, m, n] (+)= sum over group g's rows r of grad[r, m] * x[r, n] (then, when PAIRED,
        over its rows of grad2 and x2, in the same sum); grad [R, M], x [R, K] row-major, out
        [G, M, K] contiguous; experts visited in ``order`` [G] when ORDERED; SQUARES: each stored row's
        sum of squares into ``sq`` [G, M, cdiv(K, BLOCK_N)] fp32."""
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        m_blocks = tl.cdiv(M, BLOCK_M)
        n_blocks = tl.cdiv(K, BLOCK_N)
        per_group = m_blocks * n_blocks
        HALF: tl.constexpr = BLOCK_N // 2  # the epilogue's column halves (_add_tile)
        if SPLIT_EPILOGUE:
            out_desc = tl.make_tensor_descriptor(out, shape=[G, M, K], strides=[M * K, K, 1], block_shape=[1, BLOCK_M, HALF])
        else:
            out_desc = tl.make_tensor_descriptor(out, shape=[G, M, K], strides=[M * K, K, 1], block_shape=[1, BLOCK_M, BLOCK_N])
        for tile in range(pid, G * per_group, nprog):
            slot, m0, n0 = _tile_of(tile, per_group, n_blocks, BLOCK_M, BLOCK_N)
            g = tl.load(order + slot) if ORDERED else slot
            rows = _group_rows(ends, ends2, g, G, PAIRED)
            if rows > 0 or not ACCUMULATE:  # adding an empty expert's zeros would change nothing
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                acc = _add_rows(acc, grad, x, ends, g, m0, n0, M, K, IEEE, BLOCK_M, BLOCK_N, BLOCK_K)
                if PAIRED:
                    acc = _add_rows(acc, grad2, x2, ends2, g, m0, n0, M, K, IEEE, BLOCK_M, BLOCK_N, BLOCK_K)
                _add_tile(out, out_desc, acc, g, m0, n0, ACCUMULATE, SPLIT_EPILOGUE, BLOCK_M, BLOCK_N, sq, M, n_blocks, SQUARES)

    @triton.jit
    def _grouped_wgrad_fp8_kernel(
        gt,
        sg,
        xt,
        sx,
        ends,
        out,
        G,
        M,
        K,
        W,
        ACCUMULATE: tl.constexpr,
        SPLIT_EPILOGUE: tl.constexpr,
        IEEE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """out[g, m, n] (+)= sg[g, m] * sx[g, n] * sum over group g's columns c of gt[m, c] * xt[n, c];
        gt [M, W] and xt [K, W] e4m3, row-major, each group's columns a zero-padded run starting at a
        multiple of 16 (moe.kernels.fp8.quantize_cols_grouped(pad=True)); sg [G, M], sx [G, K] fp32
        decode scales; out [G, M, K] contiguous. Both operands are K-major, as FP8 wgmma needs."""
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        m_blocks = tl.cdiv(M, BLOCK_M)
        n_blocks = tl.cdiv(K, BLOCK_N)
        per_group = m_blocks * n_blocks
        HALF: tl.constexpr = BLOCK_N // 2
        if SPLIT_EPILOGUE:
            out_desc = tl.make_tensor_descriptor(out, shape=[G, M, K], strides=[M * K, K, 1], block_shape=[1, BLOCK_M, HALF])
        else:
            out_desc = tl.make_tensor_descriptor(out, shape=[G, M, K], strides=[M * K, K, 1], block_shape=[1, BLOCK_M, BLOCK_N])
        for tile in range(pid, G * per_group, nprog):
            g, m0, n0 = _tile_of(tile, per_group, n_blocks, BLOCK_M, BLOCK_N)
            start = tl.multiple_of(tl.load(ends + g - 1, mask=g > 0, other=0).to(tl.int64), 16)
            cols = (tl.load(ends + g).to(tl.int64) - start).to(tl.int32)
            shape_cols = tl.maximum(cols, 16)
            g_desc = tl.make_tensor_descriptor(gt + start, shape=[M, shape_cols], strides=[W, 1], block_shape=[BLOCK_M, BLOCK_K])
            x_desc = tl.make_tensor_descriptor(xt + start, shape=[K, shape_cols], strides=[W, 1], block_shape=[BLOCK_N, BLOCK_K])
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for c0 in range(0, cols, BLOCK_K):
                g_tile = g_desc.load([m0, c0])
                x_tile = x_desc.load([n0, c0])
                if IEEE:
                    acc = tl.dot(g_tile.to(tl.float32), tl.trans(x_tile.to(tl.float32)), acc, input_precision="ieee")
                else:
                    acc = tl.dot(g_tile, tl.trans(x_tile), acc)
            rows_m = m0 + tl.arange(0, BLOCK_M)
            cols_n = n0 + tl.arange(0, BLOCK_N)
            scale_m = tl.load(sg + g * M + rows_m, mask=rows_m < M, other=0.0)
            scale_n = tl.load(sx + g * K + cols_n, mask=cols_n < K, other=0.0)
            acc = acc * scale_m[:, None] * scale_n[None, :]
            _add_tile(out, out_desc, acc, g, m0, n0, ACCUMULATE, SPLIT_EPILOGUE, BLOCK_M, BLOCK_N, out, M, n_blocks, False)


# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) on sm90: chosen from bench/wgrad.py on one
# H200 (bench/NOTES.md, "The weight gradient accumulated in the GEMM"); one fixed choice keeps
# reruns bitwise (an autotuner's timing-noise pick would change the summation order).
CUDA_CONFIG = (128, 256, 64, 8, 3)
INTERPRETER_CONFIG = (32, 32, 16, 4, 1)
# The experts heaviest first (bench/wgrad.py --epilogue, bench/h200/wgrad_epilogue.sh);
# MOE_WGRAD_ORDER=index keeps index order for a side-by-side.
ORDERED_TILES = choice("MOE_WGRAD_ORDER") == "heaviest"
RANK_BLOCK, RANK_WARPS = 64, 4  # experts ranked per program of _rank_kernel (64 x 64 comparisons at a time)
# The FP8 kernel's tile: twice the contraction depth (one byte per element, wgmma takes 32 at a time).
FP8_CUDA_CONFIG = (128, 256, 128, 8, 3)


def supports(grad: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether the fused kernel can take these operands: Triton on this device (or the
    interpreter), contiguous rows with 16-byte-aligned strides (TMA), bf16/fp16/fp32 inputs of one
    dtype. (The accumulator: fp32 or bf16, contiguous.)"""
    if not (HAVE_TRITON and use_triton(grad)) or grad.dtype != x.dtype or grad.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    item = grad.element_size()
    aligned = (grad.shape[1] * item) % 16 == 0 and (x.shape[1] * item) % 16 == 0
    return aligned and grad.is_contiguous() and x.is_contiguous() and grad.data_ptr() % 16 == 0 and x.data_ptr() % 16 == 0


def split_epilogue(block_n: int, out_dtype: torch.dtype) -> bool:
    """Whether a tile's epilogue goes in two column halves: a wide fp32 tile's staging buffer
    would not fit in an sm90 block's shared memory beside the operand stages."""
    return block_n >= 256 and out_dtype == torch.float32


def expert_order(ends: torch.Tensor, ends2: torch.Tensor | None = None) -> torch.Tensor:
    """The experts by rows (over ``ends``, plus ``ends2``'s), most first (ties: the lower index
    first), on the device: int32 [G]."""
    groups = ends.numel()
    order = torch.empty(groups, dtype=torch.int32, device=ends.device)
    grid = (triton.cdiv(groups, RANK_BLOCK),)
    _rank_kernel[grid](ends, ends if ends2 is None else ends2, order, groups, PAIRED=ends2 is not None, BLOCK=RANK_BLOCK, num_warps=RANK_WARPS)
    return order


def grouped_wgrad(
    grad: torch.Tensor,
    x: torch.Tensor,
    ends: torch.Tensor,
    out: torch.Tensor,
    *,
    accumulate: bool,
    config: tuple[int, ...] | None = None,
    ordered: bool | None = None,
    pair: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    kernel: str | None = None,
    ws_config: tuple[int, ...] | None = None,
    squares: bool = False,
) -> torch.Tensor | None:
    """out[g] = grad_g^T @ x_g (``accumulate``: out[g] += it) over group g's rows, for grad [R, M]
    and x [R, K] with rows sorted by group ending at ``ends`` [G] (int32, on the device); out
    [G, M, K] in fp32 or bf16. fp32 accumulation; a group without rows gets zeros (or is left
    as it was when accumulating). Check :func:`supports` first. ``config``: (BLOCK_M, BLOCK_N,
    BLOCK_K, warps, stages) instead of the shipped choice (benchmarks, tests); ``ordered``
    (heaviest experts first) instead of ORDERED_TILES. ``pair``: a second micro-batch's (grad, x,
    ends), summed with the first in the same GEMM (optim.expert_wgrad=paired: one epilogue for
    two micro-batches). ``kernel``: "ws" for the warp-specialised Gluon kernel that fetches
    the old sum under the main loop (moe.kernels.grouped_wgrad_ws, where it applies: the default)
    or "triton", instead of MOE_WGRAD_KERNEL; ``ws_config``: its config instead of its shipped one.
    ``squares``: also return fp32 partial sums whose sum is the sum of squares of ``out`` after
    the call (each stored row's, per column block, from the epilogue; the experts an accumulating
    call leaves alone read by a small kernel): the gradient norm without a pass over ``out``."""
    groups, m, k = out.shape
    if out.dtype not in (torch.float32, torch.bfloat16) or not out.is_contiguous():
        raise ValueError(f"grouped_wgrad: the accumulator must be contiguous fp32 or bf16, got {out.dtype}")
    if ends.numel() != groups or grad.shape[1] != m or x.shape[1] != k or grad.shape[0] != x.shape[0]:
        raise ValueError(f"grouped_wgrad: grad {tuple(grad.shape)}, x {tuple(x.shape)}, {ends.numel()} groups, out {tuple(out.shape)}")
    if pair is not None:
        grad2, x2, ends2 = pair
        if ends2.numel() != groups or grad2.shape[1] != m or x2.shape[1] != k or grad2.shape[0] != x2.shape[0] or grad2.dtype != grad.dtype:
            raise ValueError(f"grouped_wgrad: pair grad {tuple(grad2.shape)}, x {tuple(x2.shape)}, {ends2.numel()} groups, out {tuple(out.shape)}")
        ends2 = ends2.to(torch.int32)
    if not (groups and m and k):
        return torch.zeros(1, device=out.device) if squares else None
    ends = ends.to(torch.int32)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    block_m, block_n, block_k, warps, stages, *rest = config or (INTERPRETER_CONFIG if interpreted else CUDA_CONFIG)
    blocks_per_sm, split = rest or (1, split_epilogue(block_n, out.dtype))
    ordered = ORDERED_TILES if ordered is None else ordered
    use_ws = ws.USE_WS if kernel is None else kernel == "ws"
    if use_ws and config is None and ws.supports(grad, x, out, pair=pair):
        block_n = (ws_config or ws.CONFIG)[1]
        sq = torch.empty(groups, m, triton.cdiv(k, block_n), dtype=torch.float32, device=out.device) if squares else None
        order = expert_order(ends, ends2 if pair is not None else None) if ordered else None
        ws.grouped_wgrad_ws(
            grad, x, ends, order, out, accumulate=accumulate, config=ws_config, pair=(grad2, x2, ends2) if pair is not None else None, squares=sq
        )
        return _squares_of_the_rest(out, ends, ends2 if pair is not None else None, sq, block_n) if accumulate else sq
    sq = torch.empty(groups, m, triton.cdiv(k, block_n), dtype=torch.float32, device=out.device) if squares else None
    tiles = groups * triton.cdiv(m, block_m) * triton.cdiv(k, block_n)
    # persistent: blocks_per_sm programs per SM (the interpreter: a few programs, each looping over tiles)
    slots = 8 if interpreted else blocks_per_sm * torch.cuda.get_device_properties(grad.device).multi_processor_count
    triton.set_allocator(ws.allocate_scratch)
    second = (grad2, x2, ends2) if pair is not None else (grad, x, ends)  # not read unless PAIRED
    _grouped_wgrad_kernel[(min(tiles, slots),)](
        grad,
        x,
        ends,
        *second,
        expert_order(ends, ends2 if pair is not None else None) if ordered else ends,
        out,
        out if sq is None else sq,
        groups,
        m,
        k,
        ACCUMULATE=accumulate,
        SPLIT_EPILOGUE=split,
        ORDERED=ordered,
        PAIRED=pair is not None,
        IEEE=grad.dtype == torch.float32 or interpreted,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SQUARES=sq is not None,
        num_warps=warps,
        num_stages=stages,
    )
    return _squares_of_the_rest(out, ends, ends2 if pair is not None else None, sq, block_n) if accumulate else sq


def _squares_of_the_rest(
    out: torch.Tensor, ends: torch.Tensor, ends2: torch.Tensor | None, sq: torch.Tensor | None, block_n: int
) -> torch.Tensor | None:
    """``sq``'s rows of the experts an accumulating launch skipped (no rows: their sums unchanged),
    read from ``out``; the launch wrote every other row."""
    if sq is None:
        return None
    groups, m, k = out.shape
    block_m = 32
    _empty_squares_kernel[(groups, triton.cdiv(m, block_m))](
        out, ends, ends if ends2 is None else ends2, sq, groups, m, k, sq.shape[2], PAIRED=ends2 is not None, BLOCK_M=block_m, BLOCK_N=block_n
    )
    return sq


def supports_fp8(gt: torch.Tensor) -> bool:
    """Whether the FP8 kernel can run here: Triton on a GPU with FP8 tensor cores (sm89+), or
    the interpreter."""
    if not (HAVE_TRITON and use_triton(gt)):
        return False
    return gt.device.type != "cuda" or torch.cuda.get_device_capability(gt.device) >= (8, 9)


def grouped_wgrad_fp8(
    gt: torch.Tensor,
    g_scales: torch.Tensor,
    xt: torch.Tensor,
    x_scales: torch.Tensor,
    padded_ends: torch.Tensor,
    out: torch.Tensor,
    *,
    accumulate: bool,
    config: tuple[int, ...] | None = None,
) -> None:
    """out[g] (+)= (gt_g * g_scales[g]) @ (xt_g * x_scales[g])^T for the transposed, zero-padded
    column quantisations of moe.kernels.fp8.quantize_cols_grouped(pad=True): gt [M, W], xt [K, W]
    e4m3 whose group g occupies columns padded_ends[g-1]:padded_ends[g], and decode scales [G*M]
    and [G*K] (group-major). fp32 accumulation, the scales applied in the epilogue, the sum added
    into ``out`` [G, M, K] (fp32 or bf16): the FP8 weight gradient is never stored on its own.
    Check :func:`supports_fp8` first. ``config``: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages[,
    blocks per SM, split epilogue]): small tiles with a split epilogue fit two blocks on an SM, so
    one block's accumulator read and write overlap the other's GEMM."""
    groups, m, k = out.shape
    if out.dtype not in (torch.float32, torch.bfloat16) or not out.is_contiguous():
        raise ValueError(f"grouped_wgrad_fp8: the accumulator must be contiguous fp32 or bf16, got {out.dtype}")
    width = gt.shape[1]
    if (
        gt.shape[0] != m
        or xt.shape != (k, width)
        or padded_ends.numel() != groups
        or g_scales.numel() != groups * m
        or x_scales.numel() != groups * k
        or width % 16
        or not (gt.is_contiguous() and xt.is_contiguous())
    ):
        raise ValueError(
            f"grouped_wgrad_fp8: gt {tuple(gt.shape)}, xt {tuple(xt.shape)}, {padded_ends.numel()} groups, "
            f"scales {g_scales.numel()}/{x_scales.numel()}, out {tuple(out.shape)}"
        )
    if not (groups and m and k):
        return
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    block_m, block_n, block_k, warps, stages, *rest = config or (INTERPRETER_CONFIG if interpreted else FP8_CUDA_CONFIG)
    blocks_per_sm, split = rest or (1, split_epilogue(block_n, out.dtype))
    tiles = groups * triton.cdiv(m, block_m) * triton.cdiv(k, block_n)
    slots = 8 if interpreted else blocks_per_sm * torch.cuda.get_device_properties(gt.device).multi_processor_count
    triton.set_allocator(ws.allocate_scratch)
    _grouped_wgrad_fp8_kernel[(min(tiles, slots),)](
        gt,
        g_scales.float().contiguous(),
        xt,
        x_scales.float().contiguous(),
        padded_ends.to(torch.int32),
        out,
        groups,
        m,
        k,
        width,
        ACCUMULATE=accumulate,
        SPLIT_EPILOGUE=split,
        IEEE=interpreted,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
        num_stages=stages,
    )
