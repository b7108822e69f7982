"""Standard errors beside the metrics, against independent formulas (statistics.stdev, the
binomial by hand); the truncation counts against the requests' own lengths; the tokenised
requests file keeps a sample's document ids."""

import math
import statistics

import pytest

from moe.eval.metrics import LOG2_E, combined_stderr, stderr, task_metrics
from moe.eval.requests import Request, TaskRequests, dump_task_requests, load_task_requests, truncation
from moe.eval.suite import headline


def _docs(n, seed=0):
    """n two-way documents with varied scores and byte lengths."""
    import random

    rnd = random.Random(seed)
    reqs, scores = [], {}
    for d in range(n):
        for c in range(2):
            reqs.append(Request(d, c, (1,), (2,), d % 2, 3 + c + d % 5, 4 + c + d % 7, 2 + c, 3 + c))
            scores[len(reqs) - 1] = -rnd.uniform(0.5, 6.0)
    return reqs, scores


def test_accuracy_stderr_is_binomial_and_bpb_stderr_the_sample_standard_error():
    reqs, scores = _docs(40)
    m = task_metrics(reqs, scores, "acc")
    n = 40
    correct = [float((scores[2 * d] >= scores[2 * d + 1]) == (d % 2 == 0)) for d in range(n)]
    p = sum(correct) / n
    assert m["acc_v2"] == pytest.approx(p)
    assert m["acc_v2/stderr"] == pytest.approx(math.sqrt(p * (1 - p) / n))
    gold_bpb = [-scores[2 * d + d % 2] / reqs[2 * d + d % 2].cont_bytes * LOG2_E for d in range(n)]
    assert m["bpb_v2"] == pytest.approx(statistics.fmean(gold_bpb))
    assert m["bpb_v2/stderr"] == pytest.approx(statistics.stdev(gold_bpb) / math.sqrt(n))
    for key in ("acc_v1", "len_norm_v2", "ce_loss_v1", "bpb_v1", "soft_v2", "soft_log_v1"):
        if key in m:
            assert f"{key}/stderr" in m, key
    assert "docs/stderr" not in m


def test_stderr_edge_cases():
    assert stderr([1.0], binary=True) == 0.0 and stderr([], binary=False) == 0.0
    assert stderr([1.0, 1.0, 1.0], binary=True) == 0.0  # p = 1: no spread
    assert stderr([0.0, 1.0], binary=True) == pytest.approx(math.sqrt(0.25 / 2))
    assert combined_stderr([0.3, 0.4]) == pytest.approx(0.25) and combined_stderr([]) == 0.0


def test_headline_carries_the_standard_errors():
    reqs, scores = _docs(10)
    m = task_metrics(reqs, scores, "len_norm")
    m.update({k: v for k, v in task_metrics(reqs, scores, "acc").items() if k.startswith("acc")})
    h = headline(m, "len_norm")
    assert h["len_norm/stderr"] == m["len_norm_v2/stderr"] and h["acc/stderr"] == m["acc_v2/stderr"]
    assert h["bpb/stderr"] == m["bpb_v2/stderr"]


def test_truncation_counts_the_context_tokens_the_window_cuts():
    reqs = [
        Request(0, 0, tuple(range(10)), (1, 2, 3), 0, 1, 1, 0, 0),  # 10 + 3 - 1 = 12 > 8: 4 cut
        Request(0, 1, tuple(range(10)), (1,), 0, 1, 1, 0, 0),  # 10 > 8: 2 cut
        Request(1, 0, (1, 2, 3), (4, 5), 0, 1, 1, 0, 0),  # fits
        Request(2, 0, tuple(range(9)), (1,), 0, 1, 1, 0, 0),  # 1 cut
    ]
    got = truncation(reqs, 8)
    assert got == {"truncated_docs": 2.0, "truncated_requests": 3.0, "truncated_tokens_max": 4.0, "truncated_tokens_total": 7.0}
    for r in reqs:  # the count is what query() drops
        ids, _ = r.query(8)
        assert r.cut(8) == len(r.ctx) + len(r.cont) - 1 - len(ids)
    assert truncation(reqs, 100)["truncated_docs"] == 0


def test_the_requests_file_keeps_the_sample_and_the_dropped_documents(tmp_path):
    reqs, _ = _docs(3)
    task = TaskRequests("t", "acc", tuple(reqs), 50, (4, 9, 30), (9,))
    path = tmp_path / "r.json.gz"
    path.write_bytes(dump_task_requests([task, TaskRequests("u", "acc", tuple(reqs), 3)], {"limit": 3}))
    (a, b), meta = load_task_requests(path)
    assert a == task and b.sample is None and b.dropped == () and meta["limit"] == 3


# ---------------------------------------------------------------- issue 51: baselines and subject means


def test_majority_is_the_share_of_the_most_frequent_gold_answer():
    """BoolQ-like: 66 of 100 documents answer " yes" (label 0): a model that always says " no"
    scores 0.34, under chance (0.5) but not under the majority baseline's complement."""
    from moe.eval.metrics import chance, majority

    reqs = [Request(d, c, (1,), (2,), 0 if d < 66 else 1, 3, 3, 2, 2) for d in range(100) for c in range(2)]
    assert majority(reqs) == pytest.approx(0.66) and chance(reqs) == pytest.approx(0.5)
    always_no = {i: (0.0 if r.cont_id == 1 else -1.0) for i, r in enumerate(reqs)}
    assert task_metrics(reqs, always_no, "acc")["acc_v2"] == pytest.approx(1 - majority(reqs))
    assert majority([]) == 0.0


def test_a_task_of_subjects_is_averaged_over_its_subjects_with_the_document_mean_beside():
    """Subject a: 8 documents, all right; subject b: 2 documents, all wrong. Over documents 0.8,
    over subjects (as OLMES averages MMLU) 0.5; the macro's standard error combines the subjects'."""
    from moe.eval.metrics import macro_mean, subject_metrics
    from moe.eval.suite import headline, subject_means

    reqs, scores = [], {}
    for d in range(10):
        for c in range(2):
            reqs.append(Request(d, c, (1,), (2,), 0, 3, 3, 2, 2))
            scores[len(reqs) - 1] = (-1.0 if c == 0 else -2.0) * (1 if d < 8 else -1)
    subject_of = {d: "a" if d < 8 else "b" for d in range(10)}
    per = subject_metrics(reqs, scores, "acc", subject_of)
    assert {s: m["acc_v2"] for s, m in per.items()} == {"a": 1.0, "b": 0.0} and per["a"]["docs"] == 8
    assert task_metrics(reqs, scores, "acc")["acc_v2"] == pytest.approx(0.8)
    assert macro_mean(per, "acc_v2") == (0.5, combined_stderr([per["a"]["acc_v2/stderr"], per["b"]["acc_v2/stderr"]]))
    task = TaskRequests("mmlu_stem_mc_5shot", "acc", tuple(reqs), 10, subjects=tuple(subject_of.items()))
    got = subject_means(task, scores)
    assert got["subjects"] == 2 and got["acc_v2_macro"] == 0.5 and "bpb_v2_macro" in got and "bpb_v2_macro/stderr" in got
    m = {**task_metrics(reqs, scores, "acc"), **task_metrics(reqs, scores, "len_norm"), **got}
    assert headline(m, "acc")["acc_macro"] == 0.5 and headline(m, "acc")["acc"] == pytest.approx(0.8)
    assert "acc_macro" not in headline(task_metrics(reqs, scores, "len_norm") | task_metrics(reqs, scores, "acc"), "acc")
