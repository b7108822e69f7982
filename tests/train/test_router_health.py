"""Router collapse (issue 28): the balance loss near its maximum E/k, or a router z-loss
growing without bound after the warm-up, reported once in one line with the cause and the
knob, tagged and logged; and the load alarm does not watch the warm-up."""

import logging

import pytest

from moe.config import ConfigError, ExperimentConfig
from moe.config.router_health import RouterHealthConfig
from moe.train.router_health import RouterHealth
from moe.train.trainer import Trainer
from tests.helpers import TagSink, tiny_config


def _point(**layers):
    out = {}
    for name, (lb, z) in layers.items():
        out[f"lb_loss/layer_{name}"], out[f"z_loss/layer_{name}"] = lb, z
    return out


def test_a_balance_loss_near_its_maximum_is_a_collapse():
    health = RouterHealth(RouterHealthConfig(), num_experts=64, top_k=8)  # max 8, threshold 4.5
    assert health.update(10, _point(**{"0": (1.2, 20.0), "1": (3.0, 20.0)}), after_warmup=False) is None
    event = health.update(20, _point(**{"0": (7.6, 20.0), "1": (1.1, 20.0)}), after_warmup=False)
    line = event.message(lr=0.003, warmup_steps=20)
    assert line.startswith("router collapse at step 20: balance loss of layer 0 7.60 (max 8: every token on the same few experts)")
    assert "optim.lr=0.003" in line and "recipe=olmoe-1b-7b" in line and "\n" not in line
    assert health.update(30, _point(**{"0": (7.9, 20.0)}), after_warmup=True) is None  # reported once
    assert health.state == 1.0
    health.update(40, _point(**{"0": (1.1, 20.0)}), after_warmup=True)
    assert health.state == 0.0


def test_a_router_z_loss_growing_after_the_warm_up_is_a_collapse():
    health = RouterHealth(RouterHealthConfig(), num_experts=64, top_k=8)
    for step, z in ((10, 18.0), (20, 30.0), (30, 50.0), (40, 90.0)):  # grows 5x, rising, but in the warm-up
        assert health.update(step, _point(**{"0": (1.3, z)}), after_warmup=False) is None
    event = health.update(50, _point(**{"0": (1.3, 150.0)}), after_warmup=True)
    assert "router z-loss of layer 0 150.0 (x8.3), still rising" in event.message(0.003, 40)
    healthy = RouterHealth(RouterHealthConfig(), num_experts=64, top_k=8)
    for step, z in ((10, 18.0), (20, 17.0), (30, 17.5), (40, 17.2), (50, 17.9)):
        assert healthy.update(step, _point(**{"0": (1.05, z)}), after_warmup=True) is None


def test_config_is_validated():
    with pytest.raises(ConfigError, match="train.router_health.lb_fraction"):
        ExperimentConfig.load({"train": {"router_health": {"lb_fraction": 0}}})
    with pytest.raises(ConfigError, match="train.router_health.z_growth"):
        ExperimentConfig.load({"train": {"router_health": {"z_growth": 1.0}}})


def test_a_real_collapse_is_reported_once_tagged_and_logged(tmp_path, corpus, caplog):
    """A threshold every real router passes stands in for a collapsed run (the real one needs an
    OLMoE-width model: the GPU run in the issue's closing note)."""
    cfg = tiny_config(corpus, tmp_path / "ck", train={"max_steps": 4, "router_health": {"lb_fraction": 1e-6}})
    sink = TagSink()
    with caplog.at_level(logging.WARNING, logger="moe.train"):
        Trainer(cfg, sinks=[sink]).fit()
    lines = [r.getMessage() for r in caplog.records if "router collapse" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("router collapse at step 1: balance loss of layer")
    assert sink.tags["moe.router_health"] == "collapse" and sink.tags["moe.router_health.message"] == lines[0]
    assert all(m["router_collapse"] == 1.0 for _, m in sink.rows if "router_collapse" in m)
    assert "z_loss/layer_0" in sink.rows[-1][1]


def test_a_healthy_run_reports_nothing(tmp_path, corpus, caplog):
    cfg = tiny_config(corpus, tmp_path / "ck", train={"max_steps": 6})
    sink = TagSink()
    with caplog.at_level(logging.WARNING, logger="moe.train"):
        Trainer(cfg, sinks=[sink]).fit()
    assert not [r for r in caplog.records if "router collapse" in r.getMessage()]
    assert "moe.router_health" not in sink.tags and sink.rows[-1][1]["router_collapse"] == 0.0


def test_the_load_alarm_does_not_watch_the_warm_up(tmp_path, corpus):
    """A ceiling every real load exceeds fires at the first step after the warm-up, not in it
    (and in it with during_warmup)."""
    for during, first in ((False, 4), (True, 1)):
        cfg = tiny_config(
            corpus,
            tmp_path / f"ck{during}",
            train={"max_steps": 5, "load_alarm": {"ceiling": 1.0001, "confirm": 1, "during_warmup": during}},
            schedule={"warmup_steps": 3},
        )
        sink = TagSink()
        Trainer(cfg, sinks=[sink]).fit()
        fired = [s for s, m in sink.rows if m.get("load_alarm")]
        assert fired and fired[0] == first, (during, fired)
