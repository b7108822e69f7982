"""The evaluate stage's detail file is read field by field (pipeline.stages.evaluate.read_detail):
the release puts its numbers on a model card, so a malformed value is one error naming the
field, never a traceback or a number on the card (issue 50 item 9)."""

import copy
import json

import pytest

from moe.reader import FileFormatError
from pipeline.stages.evaluate import DETAIL_FORMAT, MAX_DETAIL_TASKS, read_detail

TASK = {
    "primary": "acc",
    "docs": 8.0,
    "chance": 0.25,
    "acc_v1": 0.25,
    "acc_v1/stderr": 0.15,
    "bpb_v1": 7.9,
    "about": "ARC-Easy, grade-school science",
    "hf": {"acc": 0.25, "acc/stderr": 0.15},
    "majority": 0.5,
    "ours_on_hf_docs": {"acc": 0.25, "bpb": 7.9, "docs": 8.0},
    "sample_seed": 0,
    "doc_ids": [8, 44],
}
SUITE = {"acc_mean": 0.25, "acc_majority_mean": 0.5, "mmlu_mc_5shot_macro": 0.3}
DETAIL = {"format": DETAIL_FORMAT, "step": 8, "tasks": {"arc_easy": TASK}, "suite": SUITE, "val_loss": 5.2}


def _with(change):
    d = copy.deepcopy(DETAIL)
    change(d)
    return d


@pytest.mark.parametrize(
    "detail, message",
    [
        (_with(lambda d: d["tasks"]["arc_easy"].update(docs=-1)), r"tasks.arc_easy.docs: expected a finite number in \[0"),
        (_with(lambda d: d["tasks"]["arc_easy"].update(chance=7)), r"tasks.arc_easy.chance: expected a finite number in \[0, 1\]"),
        (_with(lambda d: d["tasks"]["arc_easy"].update(majority=1.5)), r"tasks.arc_easy.majority: expected a finite number in \[0, 1\]"),
        (_with(lambda d: d["tasks"]["arc_easy"].update(ours_on_hf_docs={"bpb": "x"})), "tasks.arc_easy.ours_on_hf_docs.bpb: expected a finite"),
        (_with(lambda d: d["tasks"]["arc_easy"].update(acc_v1="high")), "tasks.arc_easy.acc_v1: expected a finite number"),
        (_with(lambda d: d["tasks"]["arc_easy"].update(hf=[1])), "tasks.arc_easy.hf: expected a mapping"),
        (_with(lambda d: d["tasks"].update({f"t{i}": TASK for i in range(MAX_DETAIL_TASKS + 1)})), "tasks: expected at most"),
        (_with(lambda d: d["tasks"].update({"# Heading <img src=x>": TASK})), "tasks key: expected a string matching"),
        (_with(lambda d: d.update(step=-3)), r"step: expected an integer in \[0"),
        (_with(lambda d: d.pop("tasks")), "tasks: missing"),
        (_with(lambda d: d.update(surprise=1)), "surprise: unknown key"),
    ],
)
def test_a_malformed_detail_is_one_error_naming_the_field(tmp_path, detail, message):
    path = tmp_path / "eval_detail.json"
    path.write_text(json.dumps(detail))
    with pytest.raises(FileFormatError, match=message):
        read_detail(path)


def test_non_finite_numbers_are_refused_and_a_good_detail_reads(tmp_path):
    path = tmp_path / "eval_detail.json"
    path.write_text(json.dumps(DETAIL))
    assert read_detail(path)["tasks"]["arc_easy"]["docs"] == 8.0
    path.write_text(json.dumps(DETAIL).replace("5.2", "NaN"))
    with pytest.raises(FileFormatError, match="not valid JSON .NaN"):
        read_detail(path)
