import pytest
import torch

from moe.train.throughput import peak_tflops, throughput


def test_throughput_and_mfu():
    tp = throughput(tokens=1000, seconds=2.0, devices=2, flops_token=1e12, peak=500.0)
    assert tp.tokens_per_s == 500 and tp.tokens_per_s_per_device == 250
    assert tp.tflops_per_device == pytest.approx(250.0)
    assert tp.mfu == pytest.approx(0.5)


def test_peak_lookup():
    assert peak_tflops(torch.device("cpu")) is None
    assert peak_tflops(torch.device("cpu"), 123.0) == 123.0
