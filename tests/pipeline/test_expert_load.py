"""The expert-load heatmap data (CSV), its PNG, and the alarm fields of the final metrics."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import expert_load
from pipeline.stages.train import load_alarm_metrics
from tests.helpers import committed_params

REPO = Path(__file__).resolve().parents[2]

ROWS = [
    {
        "step": 10,
        "loss": 5.0,
        "expert_load/layer_0/expert_0": 1.5,
        "expert_load/layer_0/expert_1": 0.5,
        "expert_load/layer_1/expert_0": 1.0,
        "expert_load/layer_1/expert_1": 1.0,
        "load_alarm/layer_0": 0.0,
    },
    {"step": 11, "loss": 4.9},  # a loss-only row
    {
        "step": 20,
        "expert_load/layer_0/expert_0": 2.0,
        "expert_load/layer_0/expert_1": 0.0,
        "expert_load/layer_1/expert_0": 0.8,
        "expert_load/layer_1/expert_1": 1.2,
        "load_alarm/layer_0": 1.0,
    },
]


def test_csv_is_long_format_per_step_layer_expert(tmp_path):
    table = expert_load.load_table(ROWS)
    assert len(table) == 8 and table[0] == (10, 0, 0, 1.5)
    expert_load.write_csv(tmp_path / "load.csv", table)
    with open(tmp_path / "load.csv") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == expert_load.COLUMNS
    assert rows[-1] == {"step": "20", "layer": "1", "expert": "1", "row": "L01 E001", "load": "1.2"}


def test_png_is_written_and_nothing_without_data(tmp_path):
    assert expert_load.write_png(tmp_path / "h.png", expert_load.load_table(ROWS))
    assert (tmp_path / "h.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not expert_load.write_png(tmp_path / "none.png", [])
    assert not (tmp_path / "none.png").exists()


def test_final_metrics_count_the_layers_that_fired():
    assert load_alarm_metrics(ROWS) == {"load_alarm": 1, "load_alarm_first_step": 20}
    assert load_alarm_metrics(ROWS[:2]) == {"load_alarm": 0, "load_alarm_first_step": None}


@pytest.mark.slow
def test_default_params_run_is_quiet_and_draws_the_heatmap(tmp_path):
    """`moe tokenize` + `moe train` with the repository's params.yaml as shipped: the alarm stays
    quiet on this healthy run, and the heatmap data and PNG are written."""
    (tmp_path / "params.yaml").write_text(committed_params())
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("MLFLOW_TRACKING_URI", None)
    moe = [sys.executable, "-m", "pipeline.cli"]
    for cmd in (["tokenize"], ["train", "--no-mlflow"]):
        r = subprocess.run([*moe, *cmd], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1200)
        assert r.returncode == 0, f"{cmd}: {r.stdout[-2000:]}\n{r.stderr[-2000:]}"
        assert "token gerrymandering alarm" not in r.stdout + r.stderr
    metrics = json.loads((tmp_path / "metrics/train.json").read_text())
    assert metrics["steps"] == 150 and metrics["load_alarm"] == 0 and "load_alarm_first_step" not in metrics  # never fired: no column
    with open(tmp_path / "plots/expert_load.csv") as f:
        table = list(csv.DictReader(f))
    assert len(table) == 15 * 2 * 8  # log points x layers x experts of the default model
    assert (tmp_path / "runs/train/expert_load.png").is_file()
