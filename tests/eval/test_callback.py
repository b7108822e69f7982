"""In-loop evaluation on real gloo ranks: sharded over the data-parallel ranks, the same numbers
as one process; its time kept out of the step's throughput; its step a log point."""

from pathlib import Path

import pytest
import torch

from moe.eval.callback import EvalCallback
from moe.eval.requests import Request, TaskRequests
from moe.eval.suite import evaluate_suite
from moe.train.trainer import Trainer
from tests.helpers import make_corpus, tiny_config
from tests.parallel.dist_utils import run_ranks

pytestmark = pytest.mark.distributed


def _tasks():
    g = torch.Generator().manual_seed(3)
    reqs = []
    for d in range(10):
        ctx = tuple(torch.randint(2, 250, (int(torch.randint(4, 30, (1,), generator=g)),), generator=g).tolist())
        for c in range(4):
            cont = tuple(torch.randint(2, 250, (1 + (d + c) % 3,), generator=g).tolist())
            reqs.append(Request(d, c, ctx, cont, d % 4, 3 + c, 3 + c, 2 + c, 2 + c))
    return [TaskRequests("synthetic", "acc", tuple(reqs), 10)]


def _cfg(corpus, ckpt, parallel):
    return tiny_config(
        Path(corpus),
        Path(ckpt),
        parallel=parallel,
        train={"max_steps": 4, "log_every": 4, "eval_every": 2, "global_batch_size": 4, "micro_batch_size": 2},
    )


def eval_rank(rank, world, corpus, ckpt, parallel):
    cfg = _cfg(corpus, ckpt, parallel)
    val = [torch.randint(0, 256, (2, cfg.data.seq_len + 1), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    cb = EvalCallback(2, _tasks(), val, max_len=cfg.model.max_seq_len, batch_tokens=64)
    trainer = Trainer(cfg, callbacks=[cb])
    rows = []
    trainer.sinks = [type("Rows", (), {"log": lambda self, s, m: rows.append((s, dict(m))), "close": lambda self, s: None})()]
    trainer.fit()
    evals = {
        s: {k: v for k, v in m.items() if k.startswith("eval/") and k not in ("eval/seconds", "eval/time_fraction")}
        for s, m in rows
        if any(k.startswith("eval/") for k in m)
    }
    alone = None
    if parallel.get("ep", 1) == 1:  # replicated weights: rank 0 can score everything on its own
        trainer.model.eval()
        with torch.no_grad():
            alone, _ = evaluate_suite(lambda x: trainer.model(x), _tasks(), max_len=cfg.model.max_seq_len, device=torch.device("cpu"))
    return {"evals": evals, "alone": alone}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("tokens")
    make_corpus(d, files=2, tokens=6000)
    return d


def test_sharded_evaluation_equals_one_process(tmp_path, corpus):
    one = run_ranks(eval_rank, 1, str(corpus), str(tmp_path / "a"), {})
    two = run_ranks(eval_rank, 2, str(corpus), str(tmp_path / "b"), {})
    ep2 = run_ranks(eval_rank, 2, str(corpus), str(tmp_path / "c"), {"ep": 2})
    assert sorted(one[0]["evals"]) == [2, 4]  # eval steps are log points (log_every=4)
    for run in (two, ep2):
        for step, ref in one[0]["evals"].items():
            for r in run:  # every rank logs the same gathered numbers
                for k, v in ref.items():
                    assert r["evals"][step][k] == pytest.approx(v, rel=1e-3, abs=1e-4), (step, k)
    last = two[0]["evals"][4]
    assert last["eval/synthetic/bpb"] == pytest.approx(two[0]["alone"]["synthetic"]["bpb_v2"], rel=1e-5)
    assert last["eval/synthetic/acc"] == pytest.approx(two[0]["alone"]["synthetic"]["acc_v2"])
