"""Offline figures (pipeline/plots.py) from a real training run's metric rows."""

from moe.train.sinks import read_metric_rows
from pipeline.outputs import LEDGER
from pipeline.plots import expert_load_matrix, train_figures, validation_figure

PNG = b"\x89PNG\r\n\x1a\n"


def test_training_and_validation_figures(trained_dir, tmp_path):
    rows = read_metric_rows(trained_dir / "runs/train/metrics.jsonl")
    written = train_figures(rows, tmp_path / "train")
    assert sorted(p.name for p in written) == ["expert_load.png", "loss.png", "lr.png", "throughput_mfu.png"]
    assert all(p.read_bytes().startswith(PNG) for p in written)
    left = [p.name for p in (tmp_path / "train").iterdir() if p.name.startswith(".")]
    assert left == [LEDGER]  # no temporaries left; the ledger of what was written (pipeline.outputs)
    assert validation_figure(rows, 3.0, 3.0, tmp_path / "eval").read_bytes().startswith(PNG)


def test_expert_load_heatmap_data_is_layers_by_steps(trained_dir, tmp_path):
    rows = read_metric_rows(trained_dir / "runs/train/metrics.jsonl")
    steps, layers, m = expert_load_matrix(rows)
    assert layers == [0, 1] and steps == [4, 8]
    assert len(m) == 2 and all(len(r) == 2 and all(v >= 1.0 for v in r) for r in m)
