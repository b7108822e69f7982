"""The evaluate stage's suite means (pipeline.stages.evaluate.suite_summary), from task records
alone (issue 51): each mean is over one kind of figure, with its baselines beside it, and MMLU
is averaged over its subjects as OLMES reports it, the document mean beside."""

import pytest

from pipeline.stages.evaluate import suite_summary


def _record(primary, value, chance, majority, docs=100.0, **extra):
    """One task's record as compare_downstream writes it (the figures the suite means read)."""
    key = f"{primary}_v2"
    figures = {key: value, f"{key}/stderr": 0.04, "bpb_v2": 2.0, "bpb_v2/stderr": 0.1}
    return {"primary": primary, **figures, "chance": chance, "majority": majority, "docs": docs, "seconds": 1.0, **extra}


def test_each_suite_mean_is_over_one_kind_of_accuracy_with_its_chance_and_majority_beside():
    downstream = {
        "boolq": _record("acc", 0.34, 0.5, 0.66),
        "arc_easy": _record("acc", 0.30, 0.25, 0.27),
        "hellaswag": _record("len_norm", 0.26, 0.25, 0.26),
        "piqa": _record("len_norm", 0.52, 0.5, 0.51),
    }
    got = suite_summary(downstream)
    assert "primary_mean" not in got and "chance_mean" not in got  # a mean of acc and len_norm is neither
    assert got["acc_mean"] == pytest.approx(0.32) and got["acc_tasks"] == 2
    assert got["acc_chance_mean"] == pytest.approx(0.375) and got["acc_majority_mean"] == pytest.approx(0.465)
    assert got["len_norm_mean"] == pytest.approx(0.39) and got["len_norm_chance_mean"] == pytest.approx(0.375)
    assert got["len_norm_mean/stderr"] == pytest.approx((2 * 0.04**2) ** 0.5 / 2)
    assert got["bpb_mean"] == 2.0 and got["tasks"] == 4 and got["docs"] == 400


def test_mmlu_is_averaged_over_all_its_subjects_across_the_category_tasks():
    """Two categories: stem's 3 subjects average 0.4, humanities' 1 subject 0.8 -> over the 4
    subjects 0.5 (not 0.6, the mean of the two tasks); over documents, the tasks' means weighted
    by their documents."""
    stem = _record("len_norm", 0.30, 0.25, 0.3, docs=60.0, subjects=3.0, len_norm_v2_macro=0.4)
    stem["len_norm_v2_macro/stderr"] = 0.06
    hum = _record("len_norm", 0.90, 0.25, 0.3, docs=40.0, subjects=1.0, len_norm_v2_macro=0.8)
    hum["len_norm_v2_macro/stderr"] = 0.12
    got = suite_summary({"mmlu_stem_mc_5shot": stem, "mmlu_humanities_mc_5shot": hum, "piqa": _record("acc", 0.5, 0.5, 0.5)})
    assert got["mmlu_mc_5shot_macro"] == pytest.approx(0.5) and got["mmlu_mc_5shot_subjects"] == 4
    assert got["mmlu_mc_5shot_docs_mean"] == pytest.approx((60 * 0.3 + 40 * 0.9) / 100)
    assert got["mmlu_mc_5shot_macro/stderr"] == pytest.approx(((3 * 0.06) ** 2 + (1 * 0.12) ** 2) ** 0.5 / 4)
    assert not any(k.startswith("mmlu_") and "piqa" in k for k in got)
