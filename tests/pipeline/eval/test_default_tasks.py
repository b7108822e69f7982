"""Issue 51: the default evaluation fits the default model. The tasks params.yaml names for the
end of the run (evaluate.tasks) and for the loop (train.eval_tasks), sampled as it samples them,
tokenised by the tokenizer its tokenize section trains, cut no context of the model its recipe
builds: a cut context is another question, and the numbers would say nothing of the benchmark."""

from pathlib import Path

from tests.workspace import REPO


def _default_tokenizer(cfg):
    """The byte-level BPE the default tokenize stage trains (its corpus, its vocabulary), without
    encoding the corpus (what the stage does next, and these tests do not need)."""
    from pipeline.stages.tokenize import _iter_docs, plan_documents
    from pipeline.tokenizer import describe, train_bpe

    t = cfg.tokenize
    texts = (doc.text for item in plan_documents(t) for doc, val in _iter_docs(item, t.text_field, t.max_document_bytes) if not val)
    return describe(train_bpe(texts, t.vocab_size))


def test_the_default_tasks_cut_no_context_of_the_default_model():
    from moe.eval.requests import truncation
    from pipeline.eval.requests import prepare_tasks
    from pipeline.params import load_params

    cfg = load_params(REPO / "params.yaml", [])
    info = _default_tokenizer(cfg)
    max_len = cfg.model.max_seq_len
    assert (cfg.data.seq_len, max_len) == (128, 1024)  # the tiny recipe's model
    for tasks, limit, seed, key in (
        (cfg.evaluate.tasks, cfg.evaluate.limit, cfg.evaluate.seed, "evaluate.tasks"),
        (cfg.train.eval_tasks, cfg.train.eval_limit, cfg.train.eval_seed, "train.eval_tasks"),
    ):
        prepared = prepare_tasks(tasks, info, limit=limit, data_dir=None, key=key, max_len=max_len, seed=seed)
        assert len(prepared) == 11, key
        for t in prepared:
            cut = truncation(t.requests, max_len)
            assert cut["truncated_docs"] == 0 and not t.dropped, (key, t.name, cut)
            assert "5shot" not in t.name and len({r.doc_id for r in t.requests}) == limit, (key, t.name)
    # the final evaluation's accuracies, each task's gold-answer bpb beside them; the loop's bpb of the same benchmarks
    assert cfg.evaluate.tasks == ["core_short"] and cfg.train.eval_tasks == ["core_short_bpb"]


def test_the_excluded_benchmarks_are_those_longer_than_the_default_window():
    """The suites' comment names what was left out and why; the shorter suites are `core`'s and `core_bpb`'s less those."""
    from pipeline.eval.tasks import LONGER_THAN_1024, SUITES

    assert [t for t in SUITES["core"] if "5shot" not in t and t not in LONGER_THAN_1024] == SUITES["core_short"][:8]
    assert SUITES["core_short"][8:] == ["mmlu_stem", "mmlu_social_sciences", "mmlu_other"]
    assert SUITES["core_short_bpb"] == [t for t in SUITES["core_bpb"] if t not in LONGER_THAN_1024.values()]
    assert Path(REPO / "docs/evaluation.md").read_text().count("core_short") >= 2
