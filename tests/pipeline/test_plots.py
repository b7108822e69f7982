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


def test_in_loop_standard_errors_keep_their_metric_and_draw_a_band(tmp_path):
    """eval/<task>/<metric>/stderr is its own series (not merged into one "stderr" row per task)."""
    from pipeline.plots import eval_curve, eval_curve_rows

    rows = [
        {"step": s, "eval/val_loss": 3.0 - s / 10, "eval/arc_easy/acc": 0.25, "eval/arc_easy/acc/stderr": 0.05, "eval/arc_easy/bpb/stderr": 0.1}
        for s in (2, 4)
    ]
    got = {(task, metric) for _, task, metric, _ in eval_curve_rows(rows)}
    assert got == {("val", "loss"), ("arc_easy", "acc"), ("arc_easy", "acc/stderr"), ("arc_easy", "bpb/stderr")}
    assert eval_curve(rows, tmp_path, tmp_path / "curve.csv").read_bytes().startswith(PNG)


def test_the_evaluate_table_prints_standard_errors_and_truncation():
    from pipeline.cli import task_line

    r = {"primary": "acc", "acc_v2": 0.412, "acc_v2/stderr": 0.0349, "chance": 0.25, "bpb_v2": 1.5, "bpb_v2/stderr": 0.02}
    r |= {"docs": 200, "docs_total": 570, "truncated_docs": 3, "truncated_tokens_max": 17, "dropped_docs": 0}
    assert task_line(r) == "acc 0.412 ± 0.035 (chance 0.250), bpb 1.500 ± 0.020 over 200 of 570 documents; 3 cut to fit (up to 17 tokens)"
