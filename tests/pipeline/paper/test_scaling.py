"""The scaling rule keeps the paper's shape where it fits and says what it changed elsewhere."""

import pytest

from moe.config import ConfigError
from pipeline.paper.config import load_paper_params
from pipeline.paper.hardware import Hardware
from pipeline.paper.scaling import paper_shape, predict_peak_gib

RESIDENT = {"ep": 8, "shard_optimizer": True}


def test_paper_hardware_gets_the_paper_shape():
    # The paper ran its 47B (128-expert) model on 8 B300s: the rule must not shrink it there.
    s = paper_shape(Hardware("gpu", "B300", 8, 288.0, (10, 0)), 128, None, None, [RESIDENT], 0.8)
    assert s.notes == [] and s.seq_len == 8192
    assert (s.model["d_model"], s.model["n_layers"], s.model["moe"]["num_experts"], s.model["moe"]["top_k"]) == (4096, 8, 128, 4)
    assert s.model["moe"]["routing"] == "random"


def test_one_h200_scales_layers_first_and_says_so():
    s = paper_shape(Hardware("gpu", "H200", 1, 139.8, (9, 0)), 64, None, None, [{"ep": 1}], 0.8)
    assert s.model["d_model"] == 4096 and s.seq_len == 8192  # width and sequence kept
    assert 2 <= s.model["n_layers"] < 8 and s.notes == [f"layers 8 -> {s.model['n_layers']} (memory)"]
    assert predict_peak_gib(s.model, s.seq_len, 1, 1, {"ep": 1}) <= 139.8 * 0.8


def test_prediction_grows_with_layers_and_shrinks_with_sharding_and_recompute():
    s = paper_shape(Hardware("gpu", "H200", 2, 141.0), 64, None, None, [{"ep": 2}], 0.8)
    m = s.model
    base = predict_peak_gib(m, 8192, 1, 2, {"ep": 1})
    assert predict_peak_gib({**m, "n_layers": m["n_layers"] + 1}, 8192, 1, 2, {"ep": 1}) > base
    assert predict_peak_gib(m, 8192, 1, 2, {"ep": 2}) < base
    assert predict_peak_gib(m, 8192, 1, 2, {"ep": 2, "shard_optimizer": True}) < predict_peak_gib(m, 8192, 1, 2, {"ep": 2})
    peak = {mode: predict_peak_gib(m, 8192, 4, 2, {"ep": 2}, mode) for mode in ("none", "selective", "full")}
    assert peak["full"] <= peak["selective"] <= peak["none"] and peak["full"] < peak["none"]


def test_cpu_scale_is_tiny_and_labelled():
    s = paper_shape(Hardware("cpu", "cpu", 2, None), 128, None, None, [RESIDENT], 0.8)
    assert s.model["d_model"] == 64 and s.model["moe"]["num_experts"] == 128 and "CPU scale" in s.notes[0]


def test_params_errors_name_the_key(tmp_path):
    p = tmp_path / "params.yaml"
    p.write_text("paper: {steps: 1}\n")
    with pytest.raises(ConfigError, match="paper.steps"):
        load_paper_params(p)
    p.write_text("paper: {stepz: 3}\n")
    with pytest.raises(ConfigError, match="paper.stepz: unknown key .did you mean 'paper.steps'"):
        load_paper_params(p)
    p.write_text("model: {d_model: 8}\n")
    with pytest.raises(ConfigError, match="model: not read here"):
        load_paper_params(p)
    p.write_text("paper: {recompute: [full]}\n")
    with pytest.raises(ConfigError, match="paper.recompute"):
        load_paper_params(p)
