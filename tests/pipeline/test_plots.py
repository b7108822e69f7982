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
    from pipeline.stage_commands.evaluate import task_line

    r = {"primary": "acc", "acc_v2": 0.412, "acc_v2/stderr": 0.0349, "chance": 0.25, "bpb_v2": 1.5, "bpb_v2/stderr": 0.02}
    r |= {"docs": 200, "docs_total": 570, "truncated_docs": 3, "truncated_tokens_max": 17, "dropped_docs": 0}
    assert task_line(r) == "acc 0.412 ± 0.035 (chance 0.250), bpb 1.500 ± 0.020 over 200 of 570 documents; 3 cut to fit (up to 17 tokens)"
    r |= {"majority": 0.66, "subjects": 19, "acc_v2_macro": 0.4, "acc_v2_macro/stderr": 0.05}  # issue 51
    assert task_line(r).startswith("acc 0.412 ± 0.035 (chance 0.250, majority 0.660), acc over its 19 subjects 0.400 ± 0.050, bpb 1.500")


# ---------------------------------------------------------------- issue 51: figures that say what they plot


def _drawn(monkeypatch):
    """The figures the plot functions save, kept to be read back (their axes, titles, artists)."""
    import pipeline.plots as plots

    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig) or path)
    return figures


def _titles(fig):
    return [ax.get_title() for ax in fig.axes]


def test_many_tasks_get_distinct_styles():
    from pipeline.plots import task_styles

    styles = task_styles([f"task{i}" for i in range(45)] + ["task0"])
    assert len(styles) == 45 and len(set(styles.values())) == 45  # the default cycle repeats from the 11th


def test_the_default_in_loop_curve_has_no_empty_panel_and_no_claim_in_its_titles(monkeypatch, tmp_path):
    """The default in-loop suite logs bpb only: two panels (validation, bpb), each with its lines."""
    from pipeline.plots import eval_curve

    figures = _drawn(monkeypatch)
    from pipeline.eval.tasks import CORE_BPB

    tasks = CORE_BPB  # fourteen tasks, bpb only
    rows = [{"step": s, "eval/val_loss": 3.0, **{f"eval/{t}/bpb": 2.0 + i / 10 for i, t in enumerate(tasks)}} for s in (2, 4)]
    eval_curve(rows, tmp_path, tmp_path / "curve.csv")
    (fig,) = figures
    assert len(fig.axes) == 2 and all(ax.lines for ax in fig.axes)
    assert "accuracy" not in " ".join(_titles(fig)) and "chance" not in " ".join(_titles(fig))
    colours = {tuple(line.get_color()) + (line.get_marker(),) for line in fig.axes[1].lines}
    assert len(colours) == 14  # fourteen tasks, fourteen styles


def test_the_downstream_figure_sets_transformers_beside_ours_on_the_same_documents(monkeypatch, tmp_path):
    from pipeline.plots import downstream_figure

    figures = _drawn(monkeypatch)

    def task(primary, value, ours_20, hf_20):
        r = {"primary": primary, "bpb_v2": 3.0, "bpb_v2/stderr": 0.1, "docs": 100.0, "chance": 0.5, "majority": 0.66}
        r |= {f"{primary}_v2": value, f"{primary}_v2/stderr": 0.05} if primary != "bpb" else {}
        return r | {"hf": {"bpb": hf_20, "docs": 20.0}, "ours_on_hf_docs": {"bpb": ours_20, "docs": 20.0}}

    downstream = {"boolq": task("acc", 0.34, 2.5, 2.5), "hellaswag": task("len_norm", 0.26, 3.5, 3.5), "lambada_bpb_0shot": task("bpb", 0, 4.0, 4.0)}
    downstream_figure(downstream, tmp_path)
    (fig,) = figures
    acc, bpb, check = fig.axes
    assert [t.get_text() for t in acc.get_yticklabels()] == ["boolq (acc)", "hellaswag (len_norm)"]  # no empty bar for a bpb task
    assert acc.get_title() == "primary accuracy over 100 documents per task" and "chance" not in acc.get_title()
    assert {t.get_text() for t in acc.get_legend().get_texts()} >= {"chance (uniform guess)", "majority (one fixed answer)"}
    assert [p.get_width() for p in check.patches] == [2.5, 3.5, 4.0]  # our bars over transformers' 20 documents
    assert "same 20 documents" in check.get_title() and bpb.get_title() == "bpb over 100 documents per task"
