"""Fused expert-MLP kernels (Triton): grouped GEMMs that do their own gather and SwiGLU.

The unfused path moves every routed token row through memory several times around the two
grouped GEMMs: the gather's copy of each token row k times, SwiGLU forward (reads [N, 2H],
writes [N, H]) and backward (reads [N, 2H] and [N, H], writes [N, 2H]). These kernels fold that
traffic into the GEMMs (SonicMoE's idea; our own code):

- ``grouped_gemm(a, b, ends, row_index=...)``: out[i] = a[row_index[i]] @ b[g(i)] (bf16/fp32 in,
  fp32 accumulation). The rows are read through the routing indices in the GEMM's prologue, so
  the expert-ordered copy of the tokens is never written.
- ``swiglu_epilogue=True`` (the up projection): each output tile computes its gate and its up
  columns together and writes ``h = [gate | up]`` (what the backward needs) and
  ``a = silu(gate) * up`` (the down projection's input) from registers.
- ``dswiglu_h=h`` (the down projection's dgrad): the epilogue turns dL/da into dL/dh =
  [dL/dgate | dL/dup] with the saved h, so the [N, H] gradient of a is never stored.
- ``grouped_wgrad(g, a, ends, row_index=...)``: dW[e] = g_e^T @ a_e over each expert's rows (a
  gathered through the indices in its prologue too).

Scheduling is persistent: a fixed grid (from host-side sizes, no sync) loops over the tiles of
all experts; a tile's expert is found by binary search over the device-side cumulative tile
counts, so empty and small groups cost nothing and leave no idle programs behind. Every output
tile is computed by one program in a fixed order: results are deterministic (no atomics).

Weights ``b`` are [G, K, N]-shaped views with arbitrary strides (the up projection's
[G, 2H, D] parameter is read transposed in place).
"""

from __future__ import annotations

import torch

from moe.kernels.routing import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from moe.kernels.routing import source_rows

    @triton.jit
    def _dot(x, y, acc, IEEE: tl.constexpr):
        """acc + x @ y with fp32 accumulation; IEEE: exact fp32 products (fp32 inputs, and the
        interpreter, whose bf16 dot is wrong: operands are widened first, which is exact)."""
        if IEEE:
            return tl.dot(x.to(tl.float32), y.to(tl.float32), acc, input_precision="ieee")
        return tl.dot(x, y, acc)

    @triton.jit
    def _find_group(block_ends, tile_m, G, LOG2_G: tl.constexpr):
        """The group whose cumulative m-block range holds ``tile_m``: #{g : block_ends[g] <= tile_m}."""
        lo = tile_m * 0
        hi = tile_m * 0 + G
        for _ in tl.static_range(LOG2_G):
            mid = (lo + hi) // 2
            v = tl.load(block_ends + tl.minimum(mid, G - 1))
            go_right = (v <= tile_m) & (mid < hi)
            lo = tl.where(go_right, mid + 1, lo)
            hi = tl.where(go_right, hi, mid)
        return lo

    @triton.jit
    def _grouped_gemm_kernel(
        a,
        row_index,
        row_scale,
        b,
        ends,
        block_ends,
        out,
        act,
        h_saved,
        dh,
        G,
        K,
        N,
        stride_am,
        stride_bg,
        stride_bk,
        stride_bn,
        GATHER: tl.constexpr,
        ROW_SCALE: tl.constexpr,
        SWIGLU: tl.constexpr,
        DSWIGLU: tl.constexpr,
        IEEE: tl.constexpr,
        LOG2_G: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """out[i, n] = sum_k a[row(i), k] * b[g(i), k, n]. ROW_SCALE: times row_scale[i] (the
        combine's gradient rows: routing weight times the token's output gradient), applied to
        the fp32 accumulator in the epilogue.
        SWIGLU: b's N columns are [gate | up] (N = 2H) and tiles cover H columns of each; DSWIGLU:
        the result is dL/da, turned into dh."""
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        cols_out = N // 2 if SWIGLU else N
        n_blocks = tl.cdiv(cols_out, BLOCK_N)
        total = tl.load(block_ends + G - 1) * n_blocks
        for tile in range(pid, total, nprog):
            tile_m = tile // n_blocks
            tile_n = tile % n_blocks
            g = _find_group(block_ends, tile_m, G, LOG2_G)
            first_block = tl.load(block_ends + g - 1, mask=g > 0, other=0)
            row_start = tl.load(ends + g - 1, mask=g > 0, other=0)
            row_end = tl.load(ends + g)
            rows = row_start + (tile_m - first_block) * BLOCK_M + tl.arange(0, BLOCK_M)
            row_ok = rows < row_end
            rows64 = rows.to(tl.int64)
            src = source_rows(row_index, rows64, row_ok, GATHER)
            if ROW_SCALE:
                scale = tl.load(row_scale + rows64, mask=row_ok, other=0.0).to(tl.float32)
            cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
            col_ok = cols < cols_out
            b_base = b + g.to(tl.int64) * stride_bg
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            if SWIGLU:
                acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                k_ok = ks < K
                a_tile = tl.load(a + src[:, None] * stride_am + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                b_ptr = b_base + ks[:, None].to(tl.int64) * stride_bk + cols[None, :].to(tl.int64) * stride_bn
                b_mask = k_ok[:, None] & col_ok[None, :]
                b_tile = tl.load(b_ptr, mask=b_mask, other=0.0)
                if SWIGLU:  # the up columns of the same tile: every load issued before the dots
                    up_tile = tl.load(b_ptr + cols_out.to(tl.int64) * stride_bn, mask=b_mask, other=0.0)
                acc = _dot(a_tile, b_tile, acc, IEEE)
                if SWIGLU:
                    acc_up = _dot(a_tile, up_tile, acc_up, IEEE)
            mask = row_ok[:, None] & col_ok[None, :]
            if ROW_SCALE:  # (w_i a_i) @ B = w_i (a_i @ B): the scale leaves the main loop alone
                acc = acc * scale[:, None]
            if SWIGLU:
                gate = acc.to(out.dtype.element_ty).to(tl.float32)  # the rounded values the backward sees
                up = acc_up.to(out.dtype.element_ty).to(tl.float32)
                base = out + rows64[:, None] * N + cols[None, :]
                tl.store(base, gate.to(out.dtype.element_ty), mask=mask)
                tl.store(base + cols_out, up.to(out.dtype.element_ty), mask=mask)
                a_val = gate * tl.sigmoid(gate) * up
                tl.store(act + rows64[:, None] * cols_out + cols[None, :], a_val.to(act.dtype.element_ty), mask=mask)
            elif DSWIGLU:
                # acc = dL/da for the columns of a; h = [gate | up] with a's width N
                hbase = h_saved + rows64[:, None] * (2 * N) + cols[None, :]
                gate = tl.load(hbase, mask=mask, other=0.0).to(tl.float32)
                up = tl.load(hbase + N, mask=mask, other=0.0).to(tl.float32)
                sig = tl.sigmoid(gate)
                silu = gate * sig
                dbase = dh + rows64[:, None] * (2 * N) + cols[None, :]
                tl.store(dbase, (acc * up * (sig + silu * (1.0 - sig))).to(dh.dtype.element_ty), mask=mask)
                tl.store(dbase + N, (acc * silu).to(dh.dtype.element_ty), mask=mask)
            else:
                tl.store(out + rows64[:, None] * N + cols[None, :], acc.to(out.dtype.element_ty), mask=mask)

    @triton.jit
    def _grouped_wgrad_kernel(
        grad,
        a,
        row_index,
        grad_index,
        grad_scale,
        ends,
        out,
        G,
        M,
        K,
        stride_am,
        GATHER: tl.constexpr,
        GATHER_GRAD: tl.constexpr,
        GRAD_SCALE: tl.constexpr,
        IEEE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """out[g, m, n] = sum over group g's rows i of grad_i[m] * a[row(i), n]  ([G, M, K]), where
        grad_i = grad[i], or grad[grad_index[i]] (GATHER_GRAD) times grad_scale[i] (GRAD_SCALE),
        rounded to grad's dtype."""
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        m_blocks = tl.cdiv(M, BLOCK_M)
        n_blocks = tl.cdiv(K, BLOCK_N)
        total = G * m_blocks * n_blocks
        for tile in range(pid, total, nprog):
            g = tile // (m_blocks * n_blocks)
            rest = tile % (m_blocks * n_blocks)
            ms = (rest // n_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
            ns = (rest % n_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
            m_ok = ms < M
            n_ok = ns < K
            start = tl.load(ends + g - 1, mask=g > 0, other=0)
            end = tl.load(ends + g)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for r0 in range(start, end, BLOCK_K):
                rows = r0 + tl.arange(0, BLOCK_K)
                r_ok = rows < end
                rows64 = rows.to(tl.int64)
                src = source_rows(row_index, rows64, r_ok, GATHER)
                gsrc = source_rows(grad_index, rows64, r_ok, GATHER_GRAD)
                g_tile = tl.load(grad + gsrc[None, :] * M + ms[:, None], mask=m_ok[:, None] & r_ok[None, :], other=0.0)
                if GRAD_SCALE:
                    gs = tl.load(grad_scale + rows64, mask=r_ok, other=0.0).to(tl.float32)
                    g_tile = (g_tile.to(tl.float32) * gs[None, :]).to(grad.dtype.element_ty)
                a_tile = tl.load(a + src[:, None] * stride_am + ns[None, :], mask=r_ok[:, None] & n_ok[None, :], other=0.0)
                acc = _dot(g_tile, a_tile, acc, IEEE)
            dst = out + g.to(tl.int64) * M * K + ms[:, None].to(tl.int64) * K + ns[None, :]
            tl.store(dst, acc.to(out.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


BLOCK_M, BLOCK_N, BLOCK_K = 128, 128, 64
WGRAD_BLOCK_M, WGRAD_BLOCK_N, WGRAD_BLOCK_K = 128, 128, 32
# compiled for sm90 without a GPU in tests/kernels/test_sm90_compile.py: pipelined, wgmma, no spills
CUDA_LAUNCH = {"num_warps": 8, "num_stages": 3}


def _programs(tiles_upper_bound: int, device: torch.device) -> int:
    """Persistent grid: one program per SM (host-side sizes only, no sync). At 8 warps and the
    136-195 registers the sm90 build uses, one program fits an SM; more would run as a second
    wave behind the first."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(tiles_upper_bound, sms))
    return max(1, min(tiles_upper_bound, 4))  # the interpreter: few programs, each looping


def _launch_opts(x: torch.Tensor) -> dict:
    """Untuned Hopper defaults; not timed yet (bench/h200/kernels.sh)."""
    import os

    opts = {"IEEE": x.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"}
    if x.is_cuda:
        opts.update(CUDA_LAUNCH)
    return opts


def _block_ends(ends: torch.Tensor, block_m: int) -> torch.Tensor:
    counts = torch.diff(ends.long(), prepend=ends.new_zeros(1).long())
    return ((counts + block_m - 1) // block_m).cumsum(0).to(torch.int32)


def grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    ends: torch.Tensor,
    *,
    row_index: torch.Tensor | None = None,
    row_scale: torch.Tensor | None = None,
    rows: int | None = None,
    swiglu_epilogue: bool = False,
    dswiglu_h: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """Grouped GEMM over expert-ordered rows; ``b`` [G, K, N] (any strides), ``ends`` [G] int32.

    Row i of the result (group g(i) by ``ends``) is a[row_index[i]] @ b[g] (a[i] without an
    index; times ``row_scale[i]`` [R] fp32 in the epilogue, when given). Returns (out,)
    plainly; (h [R, N], act [R, N/2]) with ``swiglu_epilogue``; (dh [R, 2N],) with
    ``dswiglu_h`` (h of the rows whose dL/da this GEMM computes)."""
    assert (a.stride(-1) == 1 or a.numel() == 0) and ends.dtype == torch.int32
    assert row_scale is None or not swiglu_epilogue, "row_scale scales one accumulator (not SwiGLU's two)"
    groups, k, n = b.shape
    r = rows if rows is not None else (row_index.numel() if row_index is not None else a.shape[0])
    dev, dtype = a.device, a.dtype
    block_ends = _block_ends(ends, BLOCK_M)
    # SwiGLU tiles hold two accumulators (gate and up), dSwiGLU tiles the saved gate and up
    # next to the accumulator: half as many columns each (no register spills on sm90)
    block_n = BLOCK_N // 2 if swiglu_epilogue or dswiglu_h is not None else BLOCK_N
    empty = a.new_empty(0)
    if swiglu_epilogue:
        assert n % 2 == 0
        out, act, dh, cols_out = torch.empty(r, n, dtype=dtype, device=dev), torch.empty(r, n // 2, dtype=dtype, device=dev), empty, n // 2
    elif dswiglu_h is not None:
        out, act, dh, cols_out = empty, empty, torch.empty(r, 2 * n, dtype=dtype, device=dev), n
    else:
        out, act, dh, cols_out = torch.empty(r, n, dtype=dtype, device=dev), empty, empty, n
    if r and groups:
        upper = (triton.cdiv(r, BLOCK_M) + groups) * triton.cdiv(cols_out, block_n)
        _grouped_gemm_kernel[(_programs(upper, dev),)](
            a,
            row_index if row_index is not None else ends,
            row_scale if row_scale is not None else ends,
            b,
            ends,
            block_ends,
            out,
            act,
            dswiglu_h if dswiglu_h is not None else empty,
            dh,
            groups,
            k,
            n,
            a.stride(0),
            b.stride(0),
            b.stride(1),
            b.stride(2),
            GATHER=row_index is not None,
            ROW_SCALE=row_scale is not None,
            SWIGLU=swiglu_epilogue,
            DSWIGLU=dswiglu_h is not None,
            LOG2_G=max(1, int(groups).bit_length()),
            BLOCK_M=BLOCK_M,
            BLOCK_N=block_n,
            BLOCK_K=BLOCK_K,
            **_launch_opts(a),
        )
    elif dswiglu_h is not None:
        dh.zero_()
    if swiglu_epilogue:
        return out, act
    return (dh,) if dswiglu_h is not None else (out,)


def grouped_wgrad(
    grad: torch.Tensor,
    a: torch.Tensor,
    ends: torch.Tensor,
    *,
    row_index: torch.Tensor | None = None,
    grad_index: torch.Tensor | None = None,
    grad_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """dW [G, M, K], dW[g] = grad_g^T @ a_g over group g's rows (a read through ``row_index``;
    grad's rows through ``grad_index`` and times ``grad_scale`` [R] fp32 when given). Groups
    without rows get zeros. fp32 accumulation, written in grad's dtype."""
    assert grad.is_contiguous() and (a.stride(-1) == 1 or a.numel() == 0) and ends.dtype == torch.int32
    assert grad_scale is None or grad_index is not None
    groups, m, k = ends.numel(), grad.shape[1], a.shape[1]
    out = torch.empty(groups, m, k, dtype=grad.dtype, device=grad.device)
    if groups and m and k:
        tiles = groups * triton.cdiv(m, WGRAD_BLOCK_M) * triton.cdiv(k, WGRAD_BLOCK_N)
        _grouped_wgrad_kernel[(_programs(tiles, grad.device),)](
            grad,
            a,
            row_index if row_index is not None else ends,
            grad_index if grad_index is not None else ends,
            grad_scale if grad_scale is not None else ends,
            ends,
            out,
            groups,
            m,
            k,
            a.stride(0),
            GATHER=row_index is not None,
            GATHER_GRAD=grad_index is not None,
            GRAD_SCALE=grad_scale is not None,
            BLOCK_M=WGRAD_BLOCK_M,
            BLOCK_N=WGRAD_BLOCK_N,
            BLOCK_K=WGRAD_BLOCK_K,
            **_launch_opts(grad),
        )
    return out
