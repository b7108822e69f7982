"""FP8 (e4m3) quantisation kernels for the FP8 expert GEMMs (Triton on CUDA, torch elsewhere).

Scales are per row (or per column within a group of rows) and are powers of two: the encode
scale is 2^floor(log2(448 / amax)), so multiplying by it and by its reciprocal (the decode
scale handed to the GEMM) is exact and only the cast to e4m3 rounds. Values are clamped to
+-448 before the cast (e4m3fn has no infinity; an unclamped overflow would become NaN).

- ``quantize_rows(x)``: one scale per row of [R, C] (GEMM operands whose contraction runs
  along the row: activations and gradients in forward and dgrad, weights in forward).
- ``quantize_cols_grouped(x, ends, ...)``: one scale per (group of rows, column), written
  transposed ([C, rows] per group) so the contraction runs along the row of the output;
  used for the wgrad operands (contraction over each expert's tokens) and for the transposed
  weights of dgrad (contraction over the weight's output dimension). For wgrad every group's
  rows start at a multiple of 16 (FP8 GEMM operand alignment) and pad with zeros.
- ``swiglu_quantize(h)``: silu(gate) * up computed and quantised rowwise in one kernel: the
  down projection's FP8 input without a bf16 round trip through memory.
"""

from __future__ import annotations

import torch

from moe.kernels.routing import HAVE_TRITON, use_triton

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
AMAX_EPS = 1e-12  # an all-zero row gets a finite scale and quantises to zeros
ALIGN = 16  # FP8 GEMM operands: 16-byte aligned rows and group starts

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from moe.kernels.routing import source_rows

    @triton.jit
    def _pow2_encode_scale(amax):
        enc = 448.0 / tl.maximum(amax, 1e-12)
        # keep the exponent bits only: 2^floor(log2(enc)), exact
        return (enc.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)

    @triton.jit
    def _to_e4m3(v, dtype: tl.constexpr):
        """Round to the e4m3 grid in fp32 (nearest, ties to even), clamp to +-448, then cast (exact):
        the result does not depend on the converter's rounding (Triton's interpreter differs)."""
        bits = v.to(tl.int32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
        sub = ((v * 512.0 + 12582912.0) - 12582912.0) * 0.001953125  # multiples of 2^-9 below 2^-6
        r = tl.where(tl.abs(v) < 0.015625, sub, normal)
        return tl.clamp(r, -448.0, 448.0).to(dtype)

    @triton.jit
    def _quant_rows_kernel(x, q, s, C, stride_x, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        if ONE_PASS:  # the whole row in registers: one read
            cols = tl.arange(0, BLOCK)
            mask = cols < C
            v = tl.load(x + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
            enc = _pow2_encode_scale(tl.max(tl.abs(v), axis=0))
            tl.store(s + row, 1.0 / enc)
            tl.store(q + row * C + cols, _to_e4m3(tl.clamp(v * enc, -448.0, 448.0), q.dtype.element_ty), mask=mask)
        else:
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, C, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                v = tl.load(x + row * stride_x + cols, mask=cols < C, other=0.0).to(tl.float32)
                acc = tl.maximum(acc, tl.abs(v))
            enc = _pow2_encode_scale(tl.max(acc, axis=0))
            tl.store(s + row, 1.0 / enc)
            for start in range(0, C, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                mask = cols < C
                v = tl.load(x + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
                tl.store(q + row * C + cols, _to_e4m3(tl.clamp(v * enc, -448.0, 448.0), q.dtype.element_ty), mask=mask)

    @triton.jit
    def _cols_tile(x, row_index, row_scale, rows, end, cols, cmask, stride_x, GATHER: tl.constexpr, ROW_SCALE: tl.constexpr):
        """Rows ``rows`` (masked at ``end``) of the group, columns ``cols``, in fp32."""
        rmask = rows < end
        src = source_rows(row_index, rows, rmask, GATHER)  # token rows: no gathered copy
        v = tl.load(x + src[:, None] * stride_x + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        if ROW_SCALE:  # row r is row_scale[r] * x[src] (a routing weight: the combine's gradient)
            v = v * tl.load(row_scale + rows, mask=rmask, other=0.0).to(tl.float32)[:, None]
        return v

    @triton.jit
    def _group_columns(ends, C, BLOCK_C: tl.constexpr):
        """This program's (group, row split, splits, the group's rows start:end, its columns and
        their mask) on the grid (column block, group, row split) of the column quantisation."""
        g = tl.program_id(1)
        start = tl.load(ends + g - 1, mask=g > 0, other=0).to(tl.int64)
        end = tl.load(ends + g).to(tl.int64)
        cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
        return g, tl.program_id(2), tl.num_programs(2), start, end, cols, cols < C

    @triton.jit
    def _amax_cols_grouped_kernel(
        x,
        row_index,
        row_scale,
        ends,
        amax,
        C,
        stride_x,
        GATHER: tl.constexpr,
        ROW_SCALE: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        """amax[g, c] = max |x[r, c]| over group g's rows: the rows split over program_id(2),
        each split's maximum combined by an atomic max (exact and order-free: bitwise reruns)."""
        g, split, splits, start, end, cols, cmask = _group_columns(ends, C, BLOCK_C)
        acc = tl.zeros([BLOCK_C], dtype=tl.float32)
        for r0 in range(start + split * BLOCK_R, end, splits * BLOCK_R):
            v = _cols_tile(x, row_index, row_scale, r0 + tl.arange(0, BLOCK_R), end, cols, cmask, stride_x, GATHER, ROW_SCALE)
            acc = tl.maximum(acc, tl.max(tl.abs(v), axis=0))
        tl.atomic_max(amax + g * C + cols, acc, mask=cmask, sem="relaxed")

    @triton.jit
    def _quant_cols_grouped_kernel(
        x,
        row_index,
        row_scale,
        ends,
        dst_ends,
        amax,
        q,
        s,
        C,
        stride_x,
        stride_g,
        stride_c,
        PAD: tl.constexpr,
        ALIGNED: tl.constexpr,
        GATHER: tl.constexpr,
        ROW_SCALE: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        """Quantise with the group's column scales and store transposed, the padding's zeros with
        the rows (rows past the group's end load as zeros): each tile is turned in registers and a
        padded group's length is a multiple of ALIGN (ALIGNED: equal groups of such a length), so a
        column's rows leave as 16-byte stores (a store masked at an unaligned bound would go out a
        byte at a time)."""
        g, split, splits, start, end, cols, cmask = _group_columns(ends, C, BLOCK_C)
        enc = _pow2_encode_scale(tl.load(amax + g * C + cols, mask=cmask, other=0.0))
        if split == 0:
            tl.store(s + g * C + cols, 1.0 / enc, mask=cmask)
        if PAD:
            dst = tl.multiple_of(tl.load(dst_ends + g - 1, mask=g > 0, other=0).to(tl.int64), 16)
            limit = tl.multiple_of(tl.load(dst_ends + g).to(tl.int64) - dst, 16)
        elif ALIGNED:
            dst = 0
            limit = tl.multiple_of(end - start, 16)
        else:
            dst = 0
            limit = end - start
        out = q + g.to(tl.int64) * stride_g + cols[:, None].to(tl.int64) * stride_c + dst  # [BLOCK_C, 1]
        for i0 in range(split * BLOCK_R, limit, splits * BLOCK_R):
            i = tl.multiple_of(i0, BLOCK_R) + tl.arange(0, BLOCK_R)
            v = _cols_tile(x, row_index, row_scale, start + i, end, cols, cmask, stride_x, GATHER, ROW_SCALE)
            v = _to_e4m3(tl.clamp(v * enc[None, :], -448.0, 448.0), q.dtype.element_ty)
            tl.store(out + i[None, :], tl.trans(v), mask=cmask[:, None] & (i < limit)[None, :])

    @triton.jit
    def _quant_cols_kernel(x, enc, q, R, C, W, stride_x, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        """q[c, r] = e4m3(x[r, c] * enc[c]) for r < W (zeros past R): one tile per program."""
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = cols < C
        v = tl.load(x + rows[:, None].to(tl.int64) * stride_x + cols[None, :], mask=(rows < R)[:, None] & cmask[None, :], other=0.0)
        e = tl.load(enc + cols, mask=cmask, other=1.0)
        v = _to_e4m3(tl.clamp(v.to(tl.float32) * e[None, :], -448.0, 448.0), q.dtype.element_ty)
        tl.store(q + cols[None, :].to(tl.int64) * W + rows[:, None], v, mask=(rows < W)[:, None] & cmask[None, :])

    @triton.jit
    def _swiglu_quant_kernel(h, q, s, H, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        if ONE_PASS:
            cols = tl.arange(0, BLOCK)
            mask = cols < H
            g = tl.load(h + row * 2 * H + cols, mask=mask, other=0.0).to(tl.float32)
            u = tl.load(h + row * 2 * H + H + cols, mask=mask, other=0.0).to(tl.float32)
            a = g * tl.sigmoid(g) * u
            enc = _pow2_encode_scale(tl.max(tl.abs(a), axis=0))
            tl.store(s + row, 1.0 / enc)
            tl.store(q + row * H + cols, _to_e4m3(tl.clamp(a * enc, -448.0, 448.0), q.dtype.element_ty), mask=mask)
        else:
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, H, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                mask = cols < H
                g = tl.load(h + row * 2 * H + cols, mask=mask, other=0.0).to(tl.float32)
                u = tl.load(h + row * 2 * H + H + cols, mask=mask, other=0.0).to(tl.float32)
                acc = tl.maximum(acc, tl.abs(g * tl.sigmoid(g) * u))
            enc = _pow2_encode_scale(tl.max(acc, axis=0))
            tl.store(s + row, 1.0 / enc)
            for start in range(0, H, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                mask = cols < H
                g = tl.load(h + row * 2 * H + cols, mask=mask, other=0.0).to(tl.float32)
                u = tl.load(h + row * 2 * H + H + cols, mask=mask, other=0.0).to(tl.float32)
                a = tl.clamp(g * tl.sigmoid(g) * u * enc, -448.0, 448.0)
                tl.store(q + row * H + cols, _to_e4m3(a, q.dtype.element_ty), mask=mask)


def pow2_encode_scale(amax: torch.Tensor) -> torch.Tensor:
    """2^floor(log2(448 / amax)) in fp32 (torch reference of the kernels' scale rule)."""
    enc = E4M3_MAX / amax.float().clamp_min(AMAX_EPS)
    return (enc.view(torch.int32) & 0x7F800000).view(torch.float32)


def _cast(x: torch.Tensor, enc: torch.Tensor) -> torch.Tensor:
    return (x.float() * enc).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


ONE_PASS_MAX = 8192  # rows up to this many elements are quantised from registers (one read)


def _row_launch(c: int) -> dict:
    block = triton.next_power_of_2(max(c, 16))
    if block <= ONE_PASS_MAX:
        return {"BLOCK": block, "ONE_PASS": True, "num_warps": 8 if block >= 2048 else 4}
    return {"BLOCK": 1024, "ONE_PASS": False, "num_warps": 4}


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] -> (e4m3 [R, C], fp32 decode scales [R]); x ~= q * scale[:, None]."""
    assert x.dim() == 2 and x.stride(-1) == 1
    rows, cols = x.shape
    if not use_triton(x):
        enc = pow2_encode_scale(x.abs().amax(1) if cols else x.new_zeros(rows))
        return _cast(x, enc[:, None]), 1.0 / enc
    q = torch.empty(rows, cols, dtype=E4M3, device=x.device)
    s = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        _quant_rows_kernel[(rows,)](x, q, s, cols, x.stride(0), **_row_launch(cols))
    return q, s


def gather_quantized_rows(q: torch.Tensor, s: torch.Tensor, row_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``row_index`` of a rowwise-quantised tensor (1-byte rows and their scales): quantising
    the T tokens once and gathering FP8 bytes moves 3T + 2N row-bytes per element against 7N for
    gathering bf16 rows and then quantising the N = T*k copies."""
    rows = q.view(torch.uint8).index_select(0, row_index).view(E4M3)  # (copy kernels lack fp8 on CPU)
    return rows, s.index_select(0, row_index)


def padded_group_ends(ends: torch.Tensor, width: int) -> torch.Tensor:
    """Cumulative ends of groups padded to multiples of ALIGN (at least ALIGN each, so an empty
    group is a block of zeros); the last group also takes the slack up to ``width``."""
    counts = torch.diff(ends.long(), prepend=ends.new_zeros(1).long())
    padded = (counts.clamp_min(1) + ALIGN - 1) // ALIGN * ALIGN
    # (no item assignment: writing a Python number into a CUDA tensor is a host-to-device copy)
    return torch.cat([padded[:-1].cumsum(0), padded.new_full((1,), width)]).to(torch.int32)


def padded_width(rows: int, groups: int) -> int:
    """Host-side upper bound of the padded groups' total (no sync needed)."""
    return (rows + ALIGN - 1) // ALIGN * ALIGN + ALIGN * groups


# Column quantisation's launch: row tiles of BLOCK_R, column blocks of BLOCK_C, and each group's
# rows split over enough programs that about ``programs`` run (no more splits than row tiles).
COLS_LAUNCH = {"BLOCK_R": 128, "BLOCK_C": 64, "num_warps": 4, "programs": 4096}


def cols_splits(rows: int, groups: int, cols: int, launch: dict) -> int:
    """Programs per (column block, group), from host-side sizes only (the mean group size)."""
    base = triton.cdiv(cols, launch["BLOCK_C"]) * groups
    tiles = triton.cdiv(triton.cdiv(rows, groups), launch["BLOCK_R"])
    return max(1, min(tiles, triton.cdiv(launch["programs"], base)))


def quantize_cols_grouped(
    x: torch.Tensor,
    ends: torch.Tensor,
    *,
    pad: bool,
    row_index: torch.Tensor | None = None,
    row_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Columnwise scales within row groups; output transposed.

    ``row_index`` [R]: the rows are x[row_index] (token rows read through the routing indices,
    the expert-ordered copy never made); R is then row_index's length. ``row_scale`` [R] (with
    row_index): row r is row_scale[r] * x[row_index[r]], multiplied in fp32 (the combine's
    gradient rows: routing weight times the token's output gradient, never stored).

    x [R, C] with groups of rows ending at ``ends`` [G] (int32, on the device).
    pad=True (token groups, for wgrad): returns (q [C, W], scales [G*C] group-major,
    padded ends [G]) where group g's rows occupy columns padded_ends[g-1]:padded_ends[g] of q,
    zero-filled past its rows; W = padded_width(R, G).
    pad=False (equal groups of M rows, e.g. weights [G*M, C]): returns (q [G, C, M], scales
    [G, C], ends). x[r] ~= q^T[r] * scale.
    """
    assert x.dim() == 2 and x.stride(-1) == 1
    rows, cols = (row_index.numel(), x.shape[1]) if row_index is not None else x.shape
    groups = ends.numel()
    if pad:
        width = padded_width(rows, groups)
        dst_ends = padded_group_ends(ends, width)
        q = torch.empty(cols, width, dtype=E4M3, device=x.device)
        stride_g, stride_c = 0, width
    else:
        m = rows // groups
        dst_ends = ends
        q = torch.empty(groups, cols, m, dtype=E4M3, device=x.device)
        stride_g, stride_c = cols * m, m
    s = torch.empty(groups * cols, dtype=torch.float32, device=x.device)
    if row_scale is not None and row_index is None:
        raise ValueError("quantize_cols_grouped: row_scale needs row_index")
    if not use_triton(x):
        src = x.index_select(0, row_index) if row_index is not None else x
        if row_scale is not None:
            src = src.float() * row_scale.float()[:, None]
        _quant_cols_grouped_torch(src, ends, dst_ends, q, s, pad)
    elif groups and cols:
        gather = row_index is not None
        args = (x, row_index.contiguous() if gather else ends, row_scale.contiguous() if row_scale is not None else x, ends)
        flags = {"GATHER": gather, "ROW_SCALE": row_scale is not None}
        launch = COLS_LAUNCH
        block_r, block_c, warps = launch["BLOCK_R"], launch["BLOCK_C"], launch["num_warps"]
        grid = (triton.cdiv(cols, block_c), groups, cols_splits(rows, groups, cols, launch))
        amax = torch.zeros(groups * cols, dtype=torch.float32, device=x.device)
        _amax_cols_grouped_kernel[grid](*args, amax, cols, x.stride(0), **flags, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)
        _quant_cols_grouped_kernel[grid](
            *args,
            dst_ends,
            amax,
            q,
            s,
            cols,
            x.stride(0),
            stride_g,
            stride_c,
            PAD=pad,
            ALIGNED=pad or (rows // groups) % ALIGN == 0,
            **flags,
            BLOCK_R=block_r,
            BLOCK_C=block_c,
            num_warps=warps,
        )
    return q, (s if pad else s.view(groups, cols)), dst_ends


def quantize_cols(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per column over all rows, transposed and padded with zero rows: x [R, C] ->
    (q [C, W], decode scales [C]) with W = padded_width(R, 1); the same bytes as
    ``quantize_cols_grouped(x, [R], pad=True)``. For a single group (dense wgrad, contraction over
    every token) the grouped kernel would run one program per 64 columns over all rows; here
    torch's max-abs reduction and a quantise pass tiled over rows and columns share the GPU.
    (A NaN column gets a zero decode scale here where the grouped kernel may drop the NaN from
    its max; either way the GEMM's result is not finite, which the step's overflow check sees.)"""
    assert x.dim() == 2 and x.stride(-1) == 1
    rows, cols = x.shape
    if not use_triton(x):
        q, s, _ = quantize_cols_grouped(x, torch.full((1,), rows, dtype=torch.int32, device=x.device), pad=True)
        return q, s
    width = padded_width(rows, 1)
    amax = torch.linalg.vector_norm(x, ord=float("inf"), dim=0, dtype=torch.float32) if rows else x.new_zeros(cols, dtype=torch.float32)
    enc = pow2_encode_scale(amax)
    q = torch.empty(cols, width, dtype=E4M3, device=x.device)
    if cols:
        block_r, block_c = 64, 64
        _quant_cols_kernel[(triton.cdiv(width, block_r), triton.cdiv(cols, block_c))](
            x, enc, q, rows, cols, width, x.stride(0), BLOCK_R=block_r, BLOCK_C=block_c
        )
    return q, 1.0 / enc


def _quant_cols_grouped_torch(x, ends, dst_ends, q, s, pad: bool) -> None:
    """The reference (device ops only; used on CPU)."""
    groups, cols = ends.numel(), x.shape[1]
    rows = x.shape[0]
    if not pad:
        xg = x.view(groups, rows // groups, cols).float()
        enc = pow2_encode_scale(xg.abs().amax(1) if rows else xg.new_zeros(groups, cols))  # [G, C]
        s.copy_((1.0 / enc).reshape(-1))
        q.copy_(_cast(xg, enc[:, None, :]).transpose(1, 2))
        return
    group = torch.searchsorted(ends.long(), torch.arange(rows, device=x.device), right=True)  # group of every row
    amax = torch.zeros(groups, cols, device=x.device).scatter_reduce_(0, group[:, None].expand(-1, cols), x.float().abs(), "amax")
    enc = pow2_encode_scale(amax)
    s.copy_((1.0 / enc).reshape(-1))
    starts = ends.long() - torch.diff(ends.long(), prepend=ends.new_zeros(1).long())
    dst_starts = torch.cat([dst_ends.new_zeros(1), dst_ends[:-1]]).long()
    dest = dst_starts[group] + torch.arange(rows, device=x.device) - starts[group]
    q8 = q.view(torch.uint8).zero_()  # copy kernels lack fp8 on CPU: move the bytes
    q8.index_copy_(1, dest, _cast(x, enc[group]).view(torch.uint8).t().contiguous())


def swiglu_quantize(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """h [N, 2H] = [gate | up] -> quantize_rows(silu(gate) * up) without storing the bf16 product."""
    assert h.dim() == 2 and h.is_contiguous()
    rows, hidden = h.shape[0], h.shape[1] // 2
    if not use_triton(h):
        gate, up = h.float().chunk(2, dim=-1)
        return quantize_rows(torch.nn.functional.silu(gate) * up)
    q = torch.empty(rows, hidden, dtype=E4M3, device=h.device)
    s = torch.empty(rows, dtype=torch.float32, device=h.device)
    if rows:
        _swiglu_quant_kernel[(rows,)](h, q, s, hidden, **_row_launch(hidden))
    return q, s
