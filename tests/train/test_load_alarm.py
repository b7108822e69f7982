"""The token-gerrymandering alarm on constructed and real routing histories."""

import json
import logging
import math
import random
from pathlib import Path

import pytest

from moe.config import ConfigError, ExperimentConfig
from moe.config.load_alarm import LoadAlarmConfig
from moe.train.load_alarm import LoadAlarm, fit_trend
from moe.train.trainer import Trainer
from tests.helpers import TagSink, tiny_config

DEFAULT_RUN = Path(__file__).parent / "data" / "default_run_load.json"


def point(step, **layers):
    """layers: name -> (balance loss, max/mean)."""
    out = {}
    for name, (lb, load) in layers.items():
        out[f"lb_loss/layer_{name}"] = lb
        out[f"expert_load_max_over_mean/layer_{name}"] = load
    return step, out


def feed(alarm, history):
    events = []
    for step, metrics in history:
        events += alarm.update(step, metrics)
    return events


def gerrymandered(n=16):
    """Layer 1: the balance loss falls 1.12 -> 1.02 while max/mean climbs 1.3 -> 2.3 (with
    noise); layer 0 stays balanced. The paper's case, at log points 10 steps apart."""
    rng = random.Random(0)
    hist = []
    for i in range(n):
        t = i / (n - 1)
        hist.append(
            point(
                10 * (i + 1),
                **{
                    "0": (1.01 + 0.005 * rng.random(), 1.2 + 0.1 * rng.random()),
                    "1": (1.12 - 0.10 * t + 0.005 * rng.random(), 1.3 + 1.0 * t + 0.1 * rng.random()),
                },
            )
        )
    return hist


def test_falling_balance_loss_with_rising_load_fires(caplog):
    alarm = LoadAlarm(LoadAlarmConfig())
    events = feed(alarm, gerrymandered())
    assert [e.layer for e in events] == ["1"]
    e = events[0]
    assert e.reason == "trend" and e.lb.change < 0 and e.load.change >= 0.3
    msg = e.message()
    assert "layer 1" in msg and "balance loss" in msg and "max/mean tokens per expert" in msg
    assert alarm.metrics() == {"load_alarm/layer_0": 0.0, "load_alarm/layer_1": 1.0, "load_alarm": 1.0}
    print(msg)  # the alarm's output on the constructed case


def test_balanced_history_stays_quiet():
    rng = random.Random(1)
    alarm = LoadAlarm(LoadAlarmConfig())
    hist = [point(10 * i, **{str(la): (1.0 + 0.03 * rng.random(), 1.1 + 0.4 * rng.random()) for la in range(4)}) for i in range(1, 60)]
    assert feed(alarm, hist) == []
    assert alarm.metrics()["load_alarm"] == 0.0


def test_default_run_stays_quiet():
    """The real per-layer numbers of the default params.yaml run (max/mean wanders 1.1-1.9)."""
    rows = json.loads(DEFAULT_RUN.read_text())["rows"]
    alarm = LoadAlarm(LoadAlarmConfig())
    assert feed(alarm, [(r["step"], r) for r in rows]) == []
    assert max(r["expert_load_max_over_mean/layer_1"] for r in rows) > 1.8  # noisy, not trending


def test_an_honest_balance_loss_rising_with_the_load_is_not_gerrymandering():
    alarm = LoadAlarm(LoadAlarmConfig())
    hist = [point(10 * i, **{"0": (1.1 + 0.03 * i, 1.2 + 0.08 * i)}) for i in range(16)]
    assert feed(alarm, hist) == []


def test_a_sustained_ceiling_fires_once_and_clears():
    alarm = LoadAlarm(LoadAlarmConfig(ceiling=2.0, confirm=3, window=4))
    assert feed(alarm, [point(10, **{"0": (1.0, 2.6)}), point(20, **{"0": (1.0, 2.7)})]) == []  # not yet sustained
    (e,) = feed(alarm, [point(30, **{"0": (1.0, 2.6)})])
    assert e.reason == "ceiling" and "over the ceiling" in e.message()
    assert feed(alarm, [point(40, **{"0": (1.0, 1.2)})]) == []
    assert alarm.metrics()["load_alarm"] == 0.0 and "0" in alarm.fired


def test_a_load_hovering_at_the_ceiling_is_one_event():
    """Per-step telemetry of a small batch crosses the ceiling on and off: one warning, again
    only after a window of quiet log points."""
    alarm = LoadAlarm(LoadAlarmConfig(ceiling=2.0, confirm=1, window=4))
    hovering = [point(s, **{"0": (1.0, 2.6 if s % 2 else 1.5)}) for s in range(1, 12)]
    assert len(feed(alarm, hovering)) == 1
    quiet = [point(s, **{"0": (1.0, 1.2)}) for s in range(12, 16)]
    assert feed(alarm, quiet) == [] and len(feed(alarm, [point(16, **{"0": (1.0, 2.6)})])) == 1


def test_fit_trend():
    t = fit_trend([0, 10, 20], [1.0, 2.0, 3.0])
    assert math.isclose(t.first, 1.0) and math.isclose(t.last, 3.0) and math.isclose(t.corr, 1.0)
    assert fit_trend([0, 10, 20], [1.0, 1.0, 1.0]).corr == 0.0


def test_config_is_validated():
    with pytest.raises(ConfigError, match="train.load_alarm.window"):
        ExperimentConfig.load({"train": {"load_alarm": {"window": 2}}})
    with pytest.raises(ConfigError, match="train.load_alarm.ceiling"):
        ExperimentConfig.load({"train": {"load_alarm": {"ceiling": 0.5}}})
    with pytest.raises(ConfigError, match="train.load_alarm.windw"):
        ExperimentConfig.load({"train": {"load_alarm": {"windw": 5}}})


def test_trainer_warns_tags_and_logs_the_alarm(tmp_path, corpus, caplog):
    """A ceiling every real load exceeds: one warning per layer, the tag, the metrics."""
    cfg = tiny_config(corpus, tmp_path / "ck", train={"max_steps": 6, "load_alarm": {"ceiling": 1.0001}})
    sink = TagSink()
    with caplog.at_level(logging.WARNING, logger="moe.train"):
        Trainer(cfg, sinks=[sink]).fit()
    warnings = [r.getMessage() for r in caplog.records if "token gerrymandering alarm" in r.getMessage()]
    layers = {k.rsplit("_", 1)[1] for k in sink.rows[-1][1] if k.startswith("load_alarm/layer_")}
    assert len(warnings) == len(layers) >= 1
    assert sink.tags["moe.load_alarm"] == "fired" and all(f"moe.load_alarm.layer_{la}" in sink.tags for la in layers)
    last = sink.rows[-1][1]
    assert last["load_alarm"] == len(layers)
    for la in layers:  # the figures of the real load ride along
        assert 0 <= last[f"expert_load_min_over_mean/layer_{la}"] <= 1 <= last[f"expert_load_max_over_mean/layer_{la}"]
        assert 0 < last[f"expert_load_entropy/layer_{la}"] <= 1
        assert "ep_rows_max_over_mean/layer_" + la not in last  # no expert parallelism here
