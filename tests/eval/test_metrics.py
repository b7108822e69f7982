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
