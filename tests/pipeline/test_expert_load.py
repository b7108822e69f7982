"""The expert-load heatmap data (CSV), its PNG, and the alarm fields of the final metrics."""

import csv

from pipeline import expert_load
from pipeline.stages.train import load_alarm_metrics

ROWS = [
    {"step": 10, "loss": 5.0, "expert_load/layer_0/expert_0": 1.5, "expert_load/layer_0/expert_1": 0.5,
     "expert_load/layer_1/expert_0": 1.0, "expert_load/layer_1/expert_1": 1.0, "load_alarm/layer_0": 0.0},
    {"step": 11, "loss": 4.9},  # a loss-only row
    {"step": 20, "expert_load/layer_0/expert_0": 2.0, "expert_load/layer_0/expert_1": 0.0,
     "expert_load/layer_1/expert_0": 0.8, "expert_load/layer_1/expert_1": 1.2, "load_alarm/layer_0": 1.0},
]


def test_csv_is_long_format_per_step_layer_expert(tmp_path):
    table = expert_load.load_table(ROWS)
    assert len(table) == 8 and table[0] == (10, 0, 0, 1.5)
    expert_load.write_csv(tmp_path / "load.csv", table)
    rows = list(csv.DictReader(open(tmp_path / "load.csv")))
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
