"""Continuation log-likelihoods: batched, grouped and sharded scoring against one request at a
time through the model; the metrics against their definitions by hand."""

import math

import pytest
import torch
import torch.nn.functional as F

from moe.config import ModelConfig
from moe.eval.metrics import chance, task_metrics
from moe.eval.requests import Request
from moe.eval.scoring import score_requests
from moe.model import Transformer


def _model():
    torch.manual_seed(0)
    cfg = ModelConfig.from_dict(
        {
            "preset": "tiny",
            "vocab_size": 97,
            "d_model": 32,
            "n_heads": 2,
            "max_seq_len": 64,
            "moe": {"num_experts": 4, "top_k": 2, "expert_hidden": 16},
        }
    ).validate()
    return Transformer(cfg).eval()


def _requests(n_docs=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for d in range(n_docs):
        ctx = tuple(torch.randint(2, 97, (int(torch.randint(3, 40, (1,), generator=g)),), generator=g).tolist())
        for c in range(3):
            length = 1 if d % 3 == 0 else int(torch.randint(1, 6, (1,), generator=g))  # letters share their context
            cont = tuple(torch.randint(2, 97, (length,), generator=g).tolist())
            out.append(Request(d, c, ctx, cont, d % 3, 2 + c, 3 + c, 1 + c, 2 + c))
    return out


def _one_by_one(model, requests, max_len):
    out = {}
    for i, r in enumerate(requests):
        ids, start = r.query(max_len)
        with torch.no_grad():
            logp = F.log_softmax(model(torch.tensor([ids]))[0].float(), -1)
        out[i] = float(sum(logp[start + j, t] for j, t in enumerate(r.cont)))
    return out


@pytest.mark.parametrize("batch_tokens", [1, 64, 100_000])
def test_batched_scores_equal_one_request_at_a_time(batch_tokens):
    model, requests = _model(), _requests()
    ref = _one_by_one(model, requests, 64)
    got = score_requests(lambda x: model(x), requests, max_len=64, device=torch.device("cpu"), batch_tokens=batch_tokens)
    assert got.keys() == ref.keys()
    for i in ref:
        assert got[i] == pytest.approx(ref[i], rel=1e-5, abs=1e-5)


def test_left_truncation_keeps_the_continuation():
    model, requests = _model(), _requests()
    ref = _one_by_one(model, requests, 16)
    got = score_requests(lambda x: model(x), requests, max_len=16, device=torch.device("cpu"))
    assert all(got[i] == pytest.approx(ref[i], rel=1e-5, abs=1e-5) for i in ref)


def test_shards_together_cover_every_request_once():
    model, requests = _model(), _requests(20)
    full = score_requests(lambda x: model(x), requests, max_len=64, device=torch.device("cpu"), batch_tokens=80)
    calls = []

    def counting(x):
        calls.append(x.shape[0])
        return model(x)

    parts = [
        score_requests(
            counting, requests, max_len=64, device=torch.device("cpu"), batch_tokens=80, shard=s, num_shards=3, equal_calls=lambda n: n + 2
        )
        for s in range(3)
    ]
    merged = {}
    for p in parts:
        assert not set(p) & set(merged)
        merged.update(p)
    assert merged.keys() == full.keys() and all(merged[i] == pytest.approx(full[i], rel=1e-6) for i in full)


def test_a_continuation_longer_than_the_context_window_is_refused():
    from moe.errors import ConfigError

    r = Request(0, 0, (1, 2), tuple(range(2, 40)), 0, 1, 1, 0, 0)
    with pytest.raises(ConfigError, match="longer than the model's context"):
        score_requests(lambda x: torch.zeros(*x.shape, 97), [r], max_len=16, device=torch.device("cpu"))


def _doc(doc_id, label, specs):
    """specs: (chars, bytes) per continuation."""
    return [Request(doc_id, c, (1,), (2,), label, ch, by, ch - 1, by - 1) for c, (ch, by) in enumerate(specs)]


def test_metrics_follow_their_definitions():
    reqs = _doc(0, 0, [(5, 5), (10, 12)]) + _doc(1, 1, [(4, 4), (2, 2)])
    scores = {0: -3.0, 1: -4.0, 2: -1.0, 3: -1.5}  # doc 0: argmax 0 (right); per char -0.6 vs -0.4 (wrong)
    acc = task_metrics(reqs, scores, "acc")
    assert acc["acc_v2"] == 0.5 and acc["docs"] == 2  # doc 1: argmax 0, label 1
    ln = task_metrics(reqs, scores, "len_norm")
    assert ln["len_norm_v2"] == 0.0  # per character: doc 0 picks -0.4 (wrong), doc 1 picks -0.25 (wrong)
    assert acc["bpb_v2"] == pytest.approx((3.0 / 5 + 1.5 / 2) / 2 / math.log(2))
    assert acc["ce_loss_v1"] == pytest.approx((3.0 / 4 + 1.5 / 1) / 2)
    soft0 = math.exp(-3) / (math.exp(-3) + math.exp(-4))
    soft1 = math.exp(-1.5) / (math.exp(-1) + math.exp(-1.5))
    assert acc["soft_v2"] == pytest.approx((soft0 + soft1) / 2)
    assert chance(reqs) == 0.5


def test_ties_go_to_the_lowest_index_and_incomplete_documents_are_left_out():
    reqs = _doc(0, 1, [(3, 3), (3, 3)]) + _doc(1, 0, [(3, 3), (3, 3)])
    got = task_metrics(reqs, {0: -2.0, 1: -2.0, 3: -1.0}, "acc")  # doc 1 lacks continuation 0: left out, as ICLMetric does
    assert got["docs"] == 1 and got["acc_v2"] == 0.0
