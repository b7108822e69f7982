"""Run under TRITON_INTERPRET=1: the FP8 quantisation kernels against a torch reference written
here from the definition (power-of-two scale 2^floor(log2(448/amax)) per row or per
(group, column), clamp to +-448, round to nearest e4m3).

Scales must match exactly. The interpreter's float->e4m3 cast is not the GPU's (it flushes
subnormals and breaks some ties away from even), so codes are compared within one e4m3 step
(2^-3 relative, or 2^-6 x the decode scale near zero) and most must agree exactly.
"""

import math
import os
import sys

import torch

from moe.kernels import fp8

E4M3 = torch.float8_e4m3fn


def ref_scale(amax: torch.Tensor) -> torch.Tensor:
    amax = amax.double().clamp_min(1e-12)
    return torch.exp2(torch.floor(torch.log2(448.0 / amax))).float()  # encode scale


def ref_rows(x: torch.Tensor):
    enc = ref_scale(x.float().abs().amax(1))
    return (x.float() * enc[:, None]).clamp(-448, 448).to(E4M3), 1.0 / enc


def close(q, s, rq, rs, name):
    assert torch.equal(s, rs), f"{name}: scales differ"
    dq, rdq = q.float() * s, rq.float() * rs
    tol = rdq.abs() * 2.0**-3 + 2.0**-6 * rs
    assert ((dq - rdq).abs() <= tol).all(), f"{name}: {((dq - rdq).abs() - tol).max().item()} over"
    same = (q.float() == rq.float()).float().mean().item()
    assert same > 0.97, f"{name}: only {same:.3f} of the codes agree"


def check_rows() -> None:
    for rows, cols, scale in [(7, 40, 1.0), (33, 1100, 1e-3), (3, 16, 1e4), (2, 8200, 1.0)]:  # 8200: two passes
        x = (torch.randn(rows, cols) * scale).bfloat16()
        x[0, 3] = 200 * scale  # an outlier: only its own row's scale moves
        q, s = fp8.quantize_rows(x)
        rq, rs = ref_rows(x)
        close(q, s[:, None], rq, rs[:, None], f"rows {rows}x{cols}")
        # round trip: every value within half an e4m3 step (2^-4 relative) of the input, or within
        # a subnormal step of the decode scale
        back = q.float() * s[:, None]
        bound = x.float().abs() * 2.0**-4 + 2.0**-6 * s[:, None]
        assert (back - x.float()).abs().le(bound).all(), "rows round trip"
        assert q.float().abs().max() <= 448 and torch.isfinite(q.float()).all()
    # saturation: the largest magnitude lands at most at 448 (scale is rounded down); an all-zero row
    x = torch.zeros(2, 32)
    x[0] = torch.linspace(-1e38, 1e38, 32)  # near the fp32 limit
    q, s = fp8.quantize_rows(x)
    assert torch.isfinite(q.float()).all() and q.float().abs().max() <= 448
    assert q[1].float().abs().max() == 0 and torch.isfinite(s).all()


def check_cols_grouped() -> None:
    counts = [5, 0, 33, 17, 1]
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    rows, cols = sum(counts), 72
    x = torch.randn(rows, cols).bfloat16()
    q, s, padded = fp8.quantize_cols_grouped(x, ends, pad=True)
    width = fp8.padded_width(rows, len(counts))
    assert q.shape == (cols, width) and s.shape == (len(counts) * cols,)
    pstarts = [0] + padded.tolist()[:-1]
    assert all(p % 16 == 0 for p in pstarts) and padded[-1].item() == width
    start = 0
    for g, n in enumerate(counts):
        rq, rs = ref_rows(x[start : start + n].t().contiguous()) if n else (None, None)
        sg = s[g * cols : (g + 1) * cols]
        block = q[:, pstarts[g] : pstarts[g] + n]
        if n:
            close(block, sg[:, None], rq, rs[:, None], f"cols group {g}")
        pad = q[:, pstarts[g] + n : padded[g].item()].float()
        assert pad.abs().max().item() == 0 if pad.numel() else True, f"group {g} padding not zero"
        start += n
    # token rows read through routing indices: the same bytes as quantising the gathered copy
    tokens = torch.randn(23, cols).bfloat16()
    row_index = torch.randint(0, 23, (rows,))
    q2, s2, padded2 = fp8.quantize_cols_grouped(tokens, ends, pad=True, row_index=row_index)
    q3, s3, _ = fp8.quantize_cols_grouped(tokens.index_select(0, row_index), ends, pad=True)
    assert torch.equal(q2.view(torch.uint8), q3.view(torch.uint8)) and torch.equal(s2, s3) and torch.equal(padded2, padded)
    # ... and with a per-row factor (the routing weight): the weighted rows, multiplied in fp32
    scale = torch.rand(rows)
    q4, s4, _ = fp8.quantize_cols_grouped(tokens, ends, pad=True, row_index=row_index, row_scale=scale)
    q5, s5, _ = fp8.quantize_cols_grouped(tokens.index_select(0, row_index).float() * scale[:, None], ends, pad=True)
    assert torch.equal(q4.view(torch.uint8), q5.view(torch.uint8)) and torch.equal(s4, s5)
    # each group's rows split over several programs (small tiles): the same bytes, padding included
    shipped = fp8.COLS_LAUNCH
    try:
        fp8.COLS_LAUNCH = {"BLOCK_R": 4, "BLOCK_C": 32, "num_warps": 4, "programs": 10**6}  # 3 splits
        q6, s6, _ = fp8.quantize_cols_grouped(tokens, ends, pad=True, row_index=row_index, row_scale=scale)
        q7, s7, _ = fp8.quantize_cols_grouped(x, ends, pad=True)
    finally:
        fp8.COLS_LAUNCH = shipped
    assert torch.equal(q6.view(torch.uint8), q4.view(torch.uint8)) and torch.equal(s6, s4)
    assert torch.equal(q7.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s7, s)
    # one group (dense wgrad): the 2D-tiled quantiser writes the grouped kernel's bytes
    for n_rows in (0, 1, 37, 130):
        t = torch.randn(n_rows, cols + 8).bfloat16()[:, 4 : 4 + cols]  # strided rows
        if n_rows:
            t[:, 5] = 0  # an all-zero column: a finite scale, zero bytes
        qa, sa = fp8.quantize_cols(t)
        qb, sb, _ = fp8.quantize_cols_grouped(t, torch.tensor([n_rows], dtype=torch.int32), pad=True)
        assert torch.equal(qa.view(torch.uint8), qb.view(torch.uint8)) and torch.equal(sa, sb), n_rows
        assert torch.isfinite(sa).all()
    # FP8 rows of the tokens, gathered: the bytes of quantising the gathered rows
    qg, sg = fp8.gather_quantized_rows(*fp8.quantize_rows(tokens), row_index)
    qr, sr = fp8.quantize_rows(tokens.index_select(0, row_index))
    assert torch.equal(qg.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(sg, sr)
    # equal groups, no padding: the transposed weights of dgrad
    w = torch.randn(3, 24, 40).bfloat16()
    q, s, _ = fp8.quantize_cols_grouped(w.reshape(72, 40), torch.arange(1, 4, dtype=torch.int32) * 24, pad=False)
    assert q.shape == (3, 40, 24) and s.shape == (3, 40)
    for g in range(3):
        rq, rs = ref_rows(w[g].t().contiguous())
        close(q[g], s[g][:, None], rq, rs[:, None], f"weights {g}")


def check_swiglu() -> None:
    h = torch.randn(9, 2 * 48).bfloat16()
    q, s = fp8.swiglu_quantize(h)
    gate, up = h.float().chunk(2, dim=-1)
    rq, rs = ref_rows(torch.nn.functional.silu(gate) * up)
    close(q, s[:, None], rq, rs[:, None], "swiglu")


def main() -> int:
    """Checks whichever path moe.kernels.fp8 takes here: Triton under TRITON_INTERPRET=1 (run as a
    script), the torch path otherwise (the CPU fallback, also checked in-process by pytest)."""
    torch.manual_seed(0)
    assert math.isclose(fp8.pow2_encode_scale(torch.tensor([1.0])).item(), 256.0)
    check_rows()
    check_cols_grouped()
    check_swiglu()
    print("fp8 kernels ok")
    return 0


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run under TRITON_INTERPRET=1"
    sys.exit(main())
