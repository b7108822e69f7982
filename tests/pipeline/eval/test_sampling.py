"""Issue 40: a limit is a seeded, stratified random sample (the same in every process, whatever
Python's hash seed); contexts the model cannot hold are counted, warned about, cut or dropped;
the tokenizer's BOS token starts every context, as OLMo's evaluator puts it."""

import collections
import json
import logging
import os
import subprocess
import sys

import pytest

from pipeline.errors import PipelineError
from pipeline.eval.requests import bos_id, cut_line, prepare_tasks, sample_documents
from pipeline.eval.tasks import TASKS, Doc, mmlu_subjects
from tests.workspace import REPO


@pytest.fixture(scope="module")
def byte_tokenizer():
    """A small byte-level BPE (it encodes any text): no download, no trained workspace."""
    from pipeline.tokenizer import describe, train_bpe

    return describe(train_bpe(["Question: what is the answer? Answer: the expert router sends each token."] * 20, 300))


def _docs(groups):
    """Documents in file order, one group per entry of ``groups`` (a list of (group, count))."""
    out = []
    for g, n in groups:
        out += [Doc(len(out) + i, ("ctx",), (" a", " b"), 0, g) for i in range(n)]
    return out


def test_the_sample_is_seeded_in_file_order_and_keeps_the_mix_of_groups():
    docs = _docs([("a", 500), ("b", 300), ("c", 150), ("d", 50)])
    got = sample_documents(docs, 100, 0, "task")
    ids = [d.doc_id for d in got]
    assert ids == sorted(ids) and len(set(ids)) == 100
    assert collections.Counter(d.group for d in got) == {"a": 50, "b": 30, "c": 15, "d": 5}  # proportional
    assert [d.doc_id for d in sample_documents(docs, 100, 0, "task")] == ids  # the same seed: the same documents
    assert [d.doc_id for d in sample_documents(docs, 100, 1, "task")] != ids
    assert [d.doc_id for d in sample_documents(docs, 100, 0, "other")] != ids  # tasks are not sampled in lockstep
    assert ids != list(range(100))
    assert sample_documents(docs, None, 0, "task") is docs and sample_documents(docs, 5000, 0, "task") is docs


def test_each_group_gives_its_share_rounded_down_or_up_and_every_group_can_be_small():
    docs = _docs([("a", 7), ("b", 2), ("c", 1)])
    for seed in range(20):
        counts = collections.Counter(d.group for d in sample_documents(docs, 5, seed, "t"))
        assert counts["a"] in (3, 4) and counts["b"] == 1 and counts["c"] in (0, 1) and sum(counts.values()) == 5  # 3.5, 1.0, 0.5
    ungrouped = [Doc(i, ("c",), (" x",), 0) for i in range(40)]
    assert len(sample_documents(ungrouped, 10, 0, "t")) == 10  # no group field: a simple random sample


# Issue 51: strata whose share's fraction never came out on top under largest-remainder rounding
# (a lone document beside 50, a task of many small subjects) were never drawn, and a sample's mean
# was biased the same way under every seed.
CASES = [[("a", 50), ("b", 1)], [("a", 7), ("b", 2), ("c", 1)], [("a", 3), ("b", 3), ("c", 3), ("d", 2), ("e", 1)]]


@pytest.mark.parametrize("groups", CASES)
def test_every_document_has_the_same_chance_of_being_drawn_by_design(groups):
    """Exact, from the design: a group of n documents gives floor + (1 with chance p) of them,
    uniformly, so each of its documents is drawn with chance (floor + p) / n = limit / N."""
    from fractions import Fraction

    from pipeline.eval.requests import stratum_takes

    sizes = dict(groups)
    total = sum(sizes.values())
    for limit in range(1, total):
        takes = stratum_takes(sizes, limit)
        assert sum(floor + p for floor, p in takes.values()) == limit  # the counts' expectations sum to the limit
        assert all(0 <= p < 1 and (floor + p) / sizes[g] == Fraction(limit, total) for g, (floor, p) in takes.items())


@pytest.mark.parametrize("groups", CASES)
def test_every_document_is_drawn_as_often_as_any_other_over_many_seeds_and_the_mean_is_unbiased(groups):
    """Empirical, over 3,000 seeds of the real sampler: each document's inclusion frequency is
    limit / N within 4.5 binomial standard errors (none is unreachable), and the mean over seeds
    of a sample's mean of per-document values is the task's mean."""
    docs = _docs(groups)
    total, limit, seeds = len(docs), 4, 3000
    values = [((7 * d.doc_id) % 11) / 10 + (d.group == "b") for d in docs]  # a value that differs by group
    drawn, means = collections.Counter(), []
    for seed in range(seeds):
        got = [d.doc_id for d in sample_documents(docs, limit, seed, "t")]
        assert len(got) == limit
        drawn.update(got)
        means.append(sum(values[i] for i in got) / limit)
    pi = limit / total
    sd = (pi * (1 - pi) / seeds) ** 0.5
    assert all(abs(drawn[d.doc_id] / seeds - pi) < 4.5 * sd for d in docs), {d: drawn[d] / seeds for d in range(total)}
    spread = (sum((m - sum(means) / seeds) ** 2 for m in means) / (seeds - 1) / seeds) ** 0.5
    assert abs(sum(means) / seeds - sum(values) / total) < 4.5 * spread


def test_the_sample_does_not_depend_on_python_s_hash_seed():
    code = (
        "from pipeline.eval.requests import sample_documents; from pipeline.eval.tasks import Doc;"
        "docs=[Doc(i,('c',),(' x',),0,'g%d' % (i % 7)) for i in range(300)];"
        "print([d.doc_id for d in sample_documents(docs, 40, 5, 'hellaswag')])"
    )
    outs = set()
    for seed in ("0", "1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(REPO)}
        outs.add(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True, cwd=REPO).stdout)
    assert len(outs) == 1


def test_real_tasks_are_stratified_by_their_subject(byte_tokenizer):
    (mmlu,) = prepare_tasks(["mmlu_stem"], byte_tokenizer, limit=60, data_dir=None, key="evaluate.tasks", max_len=4096)
    docs = TASKS["mmlu_stem"].build(__import__("pipeline.eval.data", fromlist=["data_root"]).data_root())
    by_id = {d.doc_id: d.group for d in docs}
    subjects = collections.Counter(by_id[i] for i in mmlu.sample)
    assert len(subjects) >= 15 and set(subjects) <= set(mmlu_subjects("stem"))  # a prefix would be abstract_algebra alone
    assert mmlu.docs_total == len(docs) and len(mmlu.sample) == 60 == len({r.doc_id for r in mmlu.requests})
    (again,) = prepare_tasks(["mmlu_stem"], byte_tokenizer, limit=60, data_dir=None, key="evaluate.tasks", max_len=4096)
    assert again.sample == mmlu.sample
    (hs,) = prepare_tasks(["hellaswag"], byte_tokenizer, limit=50, data_dir=None, key="evaluate.tasks", max_len=4096)
    assert hs.sample != tuple(range(50))
    (whole,) = prepare_tasks(["copa"], byte_tokenizer, limit=None, data_dir=None, key="evaluate.tasks", max_len=4096)
    assert whole.sample is None


def test_cut_contexts_are_counted_warned_about_and_dropped_on_request(byte_tokenizer, caplog):
    args = {"limit": 20, "data_dir": None, "key": "evaluate.tasks", "max_len": 300}
    with caplog.at_level(logging.WARNING, logger="pipeline.eval"):
        (cut,) = prepare_tasks(["sciq"], byte_tokenizer, **args)  # support passages: some longer than 300 tokens
    (line,) = [r.getMessage() for r in caplog.records if "sciq" in r.getMessage()]
    long_docs = {r.doc_id for r in cut.requests if r.cut(300)}
    assert 0 < len(long_docs) < 20 and cut.dropped == ()
    assert f"task sciq: {len(long_docs)} of 20 documents" in line and "do not fit model.max_seq_len=300" in line
    assert "evaluate.truncation=drop leaves them out" in line
    (dropped,) = prepare_tasks(["sciq"], byte_tokenizer, **args, truncation_mode="drop")
    assert set(dropped.dropped) == long_docs and dropped.sample == cut.sample  # the same sample, less the long ones
    assert {r.doc_id for r in dropped.requests} == set(cut.sample) - long_docs
    assert all(r.cut(300) == 0 for r in dropped.requests)
    with pytest.raises(PipelineError, match="evaluate.truncation=drop: every document of task sciq is longer than model.max_seq_len=60"):
        prepare_tasks(["sciq"], byte_tokenizer, **{**args, "max_len": 60}, truncation_mode="drop")


def test_documents_whose_continuation_cannot_fit_are_left_out_and_said(byte_tokenizer, caplog):
    """A sampled document whose continuation alone is longer than the model's window cannot be
    scored (a continuation is never cut): it is left out with one line and recorded, the rest of
    the sample is scored; a task left with nothing is one error."""
    args = {"limit": 30, "data_dir": None, "key": "train.eval_tasks", "seed": 0}
    (full,) = prepare_tasks(["hellaswag"], byte_tokenizer, **args, max_len=4096)
    longest = {d: max(len(r.cont) for r in full.requests if r.doc_id == d) for d in full.sample}
    limit = sorted(longest.values())[len(longest) // 2]  # about half the documents have a longer ending
    with caplog.at_level(logging.WARNING, logger="pipeline.eval"):
        (some,) = prepare_tasks(["hellaswag"], byte_tokenizer, **args, max_len=limit)
    unfit = {d for d, n in longest.items() if n > limit}
    assert 0 < len(unfit) < 30 and set(some.dropped) == unfit and some.sample == full.sample
    assert {r.doc_id for r in some.requests} == set(full.sample) - unfit
    assert any(f"task hellaswag: {len(unfit)} of 30 documents have a continuation longer than" in r.getMessage() for r in caplog.records)
    with pytest.raises(PipelineError, match="every sampled document of task hellaswag has a continuation longer"):
        prepare_tasks(["hellaswag"], byte_tokenizer, **args, max_len=2)


def test_a_bos_token_starts_every_context(byte_tokenizer):
    from tokenizers import AddedToken, Tokenizer, processors

    from pipeline.tokenizer import describe

    assert bos_id(byte_tokenizer.build()) is None  # ours has none: contexts unchanged
    (plain,) = prepare_tasks(["arc_easy"], byte_tokenizer, limit=4, data_dir=None, key="k", max_len=1024)

    tok = Tokenizer.from_str(byte_tokenizer.json_text)
    tok.add_special_tokens([AddedToken("<s>", special=True)])
    bos = tok.token_to_id("<s>")
    named = describe(tok)  # a special token named as a BOS, no post-processor
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    template = describe(tok)  # the post-processor puts it first (Llama-style tokenizers)
    for info in (named, template):
        assert bos_id(info.build()) == bos
        (with_bos,) = prepare_tasks(["arc_easy"], info, limit=4, data_dir=None, key="k", max_len=1024)
        assert with_bos.sample == plain.sample
        for a, b in zip(plain.requests, with_bos.requests, strict=True):
            assert b.ctx == (bos, *a.ctx) and b.cont == a.cont  # OLMo prepends it to the context only

    spelled = Tokenizer.from_str(byte_tokenizer.json_text)
    spelled.add_tokens(["<s>"])  # an ordinary token that spells <s> is no BOS
    assert bos_id(spelled) is None


@pytest.mark.parametrize(
    ("section", "values", "message"),
    [
        ("evaluate", {"seed": -1}, "evaluate.seed: must be >= 0"),
        ("evaluate", {"truncation": "trim"}, "evaluate.truncation"),
        ("train", {"eval_seed": -2}, "train.eval_seed: must be >= 0"),
        ("train", {"eval_truncation": "trim"}, "train.eval_truncation"),
    ],
)
def test_bad_sampling_and_truncation_keys_are_one_error_naming_the_key(section, values, message):
    from moe.config import ConfigError
    from pipeline.params import PipelineConfig

    with pytest.raises(ConfigError, match=message):
        PipelineConfig.load(json.loads(json.dumps({section: values})))


def test_several_tasks_cut_are_one_warning_line():
    cut = {"truncated_docs": 2.0, "truncated_requests": 4.0, "truncated_tokens_max": 187.0, "truncated_tokens_total": 410.0}
    sciq = {**cut, "truncated_docs": 1.0, "truncated_tokens_max": 255.0}
    line = cut_line([("boolq", cut, 100), ("sciq", sciq, 100)], 1024, "cut", "evaluate.truncation")
    assert line == (
        "2 tasks have documents that do not fit model.max_seq_len=1024 by up to 255 tokens (boolq 2 of 100, sciq 1 of 100): "
        "their context is cut from the left; evaluate.truncation=drop leaves them out"
    )
