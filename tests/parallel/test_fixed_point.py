"""The order-independent sums of train.layout_invariant (moe.parallel.fixed_point): exact in
any order, independent of how a tensor is sliced, within their stated error, and loud when a
gradient leaves its range."""

import pytest
import torch

from moe.errors import NonFiniteLossError
from moe.parallel.fixed_point import (
    HEADROOM_BITS,
    FixedPointScales,
    dequantize,
    exact_total,
    exponents_for,
    power_of_two,
    quantize,
    square_sum_count,
    square_sums,
)
from moe.train.trainer import Trainer
from tests.helpers import tiny_config


def test_powers_of_two_are_exact_over_the_whole_range():
    e = torch.arange(-120, 121)
    assert torch.equal(power_of_two(e), torch.ldexp(torch.ones(e.shape), e))
    assert torch.equal(power_of_two(e, torch.float64), torch.ldexp(torch.ones(e.shape, dtype=torch.float64), e))


def test_integer_sums_do_not_depend_on_the_order_float_sums_do():
    g = [torch.randn(4096) * 10.0**k for k in range(-3, 5)]  # magnitudes far apart: float sums round differently
    e = exponents_for(torch.stack([x.abs().max() for x in g]).max(), 62 - 3)
    scale, inverse = power_of_two(e), power_of_two(-e)
    forward = sum(quantize(x, scale) for x in g)
    backward = sum(quantize(x, scale) for x in reversed(g))
    assert torch.equal(forward, backward)
    assert not torch.equal(sum(g), sum(reversed(g)))
    exact = sum(x.double() for x in g)
    assert torch.allclose(dequantize(forward, inverse).double(), exact, rtol=2e-7, atol=0)


def test_dequantizing_a_slice_gives_the_bits_of_the_whole():
    q = torch.randint(-(2**62), 2**62, (1003,))
    inverse = power_of_two(torch.tensor(-40))
    whole = dequantize(q, inverse)
    for k in (2, 3, 7):
        assert torch.equal(torch.cat([dequantize(part, inverse) for part in q.tensor_split(k)]), whole)


def test_a_row_s_square_sums_are_a_function_of_that_row_alone():
    x = torch.randn(37, 5, 1100) * torch.logspace(-8, 8, 37).view(37, 1, 1)  # rows of 5,500: two segments each
    whole = square_sums(x)
    assert whole.numel() == square_sum_count(x.shape) == 74
    assert torch.equal(torch.cat([square_sums(part) for part in x.tensor_split(5)]), whole)  # as FSDP shards rows
    assert torch.equal(square_sums(x[3:4]), whole[6:8])
    reference = x.double().square().view(74, -1).sum(1)
    assert torch.allclose(whole, reference, rtol=1e-12, atol=0)
    assert square_sums(torch.tensor(3.0)).item() == 9.0 and square_sums(torch.zeros(0, 4)).numel() == 0


def test_exact_total_ignores_the_order_and_stays_within_its_bound():
    v = torch.rand(10_000, dtype=torch.float64) * torch.logspace(-10, 10, 10_000, dtype=torch.float64)
    a, b = exact_total(v, v.numel()), exact_total(v.flip(0), v.numel())
    assert torch.equal(a, b)
    assert abs(a.item() - v.sum().item()) <= v.sum().item() * 1e-10


def test_scales_follow_the_largest_gradient_and_flag_an_overflow():
    scales = FixedPointScales(["w"], micro_batches=4, device=torch.device("cpu"))
    scales.observe(0, torch.tensor([0.5, -3.0]))
    scales.calibrate(None, None, 0)
    # |g| up to 2^HEADROOM_BITS times the calibrating maximum fits
    assert (torch.tensor(3.0 * 2**HEADROOM_BITS) * scales.scales[0]).item() < 2.0**scales.limit_bits
    assert not scales.end_step(None).item()
    scales.observe(0, torch.tensor([3.0 * 2 ** (HEADROOM_BITS + 2)]))
    assert scales.end_step(None).item()  # beyond the range: the step is not applied
    scales.observe(0, torch.tensor([float("nan")]))
    assert scales.end_step(None).item()


def test_exponents_round_trip_through_a_checkpoint_and_bad_ones_are_refused():
    scales = FixedPointScales(["a", "b"], micro_batches=2, device=torch.device("cpu"))
    assert scales.state_dict() == {}  # not calibrated: nothing to keep
    scales.observe(0, torch.tensor([2.0]))
    scales.end_step(None)
    state = scales.state_dict()
    other = FixedPointScales(["a", "b"], micro_batches=2, device=torch.device("cpu"))
    other.load_state_dict(state)
    assert other.calibrated and torch.equal(other.exponents, scales.exponents)
    with pytest.raises(ValueError, match="do not match this model's parameters"):
        other.load_state_dict({"a": 1})
    with pytest.raises(ValueError, match="gradient exponent of b"):
        other.load_state_dict({"a": 1, "b": 10**6})


def test_a_gradient_beyond_the_range_stops_the_run_as_a_non_finite_step(corpus, tmp_path):
    trainer = Trainer(tiny_config(corpus, tmp_path / "ck", train={"layout_invariant": True, "max_steps": 4}, checkpoint={"save": False}))
    trainer.fit(stop_at=1)
    trainer.layout.scales.exponents.fill_(120)  # as if the gradients had grown 2^80-fold
    trainer.layout.scales._refresh()
    with pytest.raises(NonFiniteLossError, match="at step 2"):
        trainer.fit()
