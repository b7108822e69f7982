import pytest
import torch

from moe.config import ModelConfig
from moe.train.accounting import flops_per_token, param_counts, peak_tflops, throughput


def test_flops_per_token_counts_only_top_k_experts_and_attention():
    cfg = ModelConfig.from_dict(
        {"vocab_size": 100, "d_model": 16, "n_layers": 2, "n_heads": 2, "moe": {"num_experts": 8, "top_k": 2, "expert_hidden": 4}}
    ).validate()
    d, v, s = 16, 100, 32
    per_layer = 4 * d * d + 8 * d + 2 * 3 * d * 4  # q,k,v,o + router + 2 active experts
    expected = 6 * (2 * per_layer + v * d) + 12 * 2 * s * d
    assert flops_per_token(cfg, s) == expected
    assert param_counts(cfg).matmul_active == 2 * per_layer + v * d


def test_throughput_and_mfu():
    tp = throughput(tokens=1000, seconds=2.0, devices=2, flops_token=1e12, peak=500.0)
    assert tp.tokens_per_s == 500 and tp.tokens_per_s_per_device == 250
    assert tp.tflops_per_device == pytest.approx(250.0)
    assert tp.mfu == pytest.approx(0.5)


def test_peak_lookup():
    assert peak_tflops(torch.device("cpu")) is None
    assert peak_tflops(torch.device("cpu"), 123.0) == 123.0
