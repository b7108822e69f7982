"""Figures of the real expert load against plain-Python formulas."""

import math

import pytest
import torch

from moe.train.load_stats import LOAD_STATS, load_stats, max_over_mean, relative_load


def reference(c):
    mean = sum(c) / len(c)
    p = [x / sum(c) for x in c]
    return {
        "max_over_mean": max(c) / mean,
        "min_over_mean": min(c) / mean,
        "cv": math.sqrt(sum((x - mean) ** 2 for x in c) / len(c)) / mean,
        "idle": sum(x == 0 for x in c),
        "entropy": -sum(q * math.log(q) for q in p if q > 0) / math.log(len(c)),
    }


@pytest.mark.parametrize("counts", [[5, 5, 5, 5], [12, 0, 4, 0], [1, 2, 3, 10], [0, 0, 0, 7]])
def test_load_stats_match_the_formulas(counts):
    got = load_stats(torch.tensor([counts]))[0].tolist()
    ref = reference(counts)
    for name, value in zip(LOAD_STATS, got, strict=True):
        assert value == pytest.approx(ref[name], abs=1e-12), name


def test_balanced_and_empty_layers():
    out = load_stats(torch.tensor([[3, 3, 3], [0, 0, 0]]))
    assert out[0].tolist() == pytest.approx([1.0, 1.0, 0.0, 0.0, 1.0])
    assert out[1].tolist() == [0.0] * 5  # no tokens seen: zeros, not NaN


def test_relative_load_and_rank_ratio():
    assert relative_load(torch.tensor([[2, 6, 0, 0]])).tolist() == [[1.0, 3.0, 0.0, 0.0]]
    # rows per rank [R=2, L=2]: layer 0 even, layer 1 the busy rank carries 1.5x the mean
    assert max_over_mean(torch.tensor([[10, 30], [10, 10]])).tolist() == [1.0, 1.5]
