"""MXFP8 quantisation against a numpy reference of the OCP MX format (32-element blocks, e8m0
scales, round-the-scale-up rule, e4m3 elements rounded to nearest even)."""

import numpy as np
import pytest
import torch

from moe.kernels.mxfp8 import mx_dequantize, mx_quantize


def np_e4m3_round(v: np.ndarray) -> np.ndarray:
    """Nearest e4m3 value (ties to even; 3 mantissa bits, min normal 2^-6, max 448)."""
    v = np.clip(v.astype(np.float64), -448, 448)
    exp = np.floor(np.log2(np.maximum(np.abs(v), 2.0**-6)))
    step = 2.0 ** (exp - 3)
    return np.clip(np.round(v / step) * step, -448, 448)


def np_mx(x: np.ndarray, block: int = 32):
    b = x.astype(np.float64).reshape(*x.shape[:-1], -1, block)
    amax = np.abs(b).max(-1)
    with np.errstate(divide="ignore"):
        exp = np.where(amax > 0, np.ceil(np.log2(amax / 448.0)), -127)
    exp = np.clip(exp, -127, 127)
    q = np_e4m3_round(b / 2.0 ** exp[..., None])
    return q.reshape(x.shape), (exp + 127).astype(np.uint8)


@pytest.mark.parametrize("shape,scale", [((4, 64), 1.0), ((3, 5, 96), 1e-4), ((2, 32), 3e4)])
def test_mx_quantize_matches_numpy(shape, scale):
    torch.manual_seed(0)
    x = torch.randn(*shape) * scale
    x.view(-1)[7] = 0.0
    x[..., :32] *= 50  # blocks of very different magnitudes in one row
    q, s = mx_quantize(x)
    rq, rs = np_mx(x.numpy())
    assert s.dtype == torch.float8_e8m0fnu and s.shape == (*shape[:-1], shape[-1] // 32)
    np.testing.assert_array_equal(s.view(torch.uint8).numpy(), rs)
    np.testing.assert_array_equal(q.float().numpy(), rq.astype(np.float32))
    # round trip: within half an e4m3 step of each value (relative 2^-4) or of the block's subnormals
    back = mx_dequantize(q, s)
    block_scale = torch.exp2(s.view(torch.uint8).float() - 127).repeat_interleave(32, -1)
    assert ((back - x).abs() <= x.abs() * 2.0**-4 + block_scale * 2.0**-9).all()


def test_mx_blocks_saturate_never_and_zero_blocks_stay_zero():
    x = torch.zeros(2, 64)
    x[0, :32] = torch.linspace(-1e30, 1e30, 32)
    q, s = mx_quantize(x)
    assert q.float().abs().max() <= 448 and torch.isfinite(q.float()).all()
    assert q[1].float().abs().max() == 0 and s.view(torch.uint8)[1].tolist() == [0, 0]


def test_mx_rejects_ragged_blocks():
    with pytest.raises(ValueError, match="multiple of 32"):
        mx_quantize(torch.randn(2, 40))
