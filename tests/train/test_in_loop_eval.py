"""In-loop evaluation on real gloo ranks: sharded over the data-parallel ranks, the same numbers
as one process; its time kept out of the step's throughput; its step a log point."""

import re
from pathlib import Path

import pytest
import torch

from moe.eval.requests import Request, TaskRequests
from moe.eval.suite import evaluate_suite
from moe.train.callbacks.in_loop_eval import InLoopEvalCallback
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
    cb = InLoopEvalCallback(cfg.train.in_loop_eval.replace(batch_tokens=64), _tasks(), val, max_len=cfg.model.max_seq_len)
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


def test_a_requests_file_tokenised_for_another_config_is_refused(tmp_path):
    from moe.errors import ConfigError
    from moe.eval.requests import dump_task_requests
    from moe.train.callbacks.in_loop_eval import load_in_loop_requests

    cfg = tiny_config(tmp_path, tmp_path / "ck", train={"eval_every": 2, "eval_tasks": ["synthetic"], "eval_limit": 10})
    path = tmp_path / "r.json.gz"
    for meta, said in [
        ({"task_names": ["core"]}, "train.eval_tasks: ['synthetic'], but"),
        ({"limit": None}, "train.eval_limit: 10, but"),
        ({"max_len": 7}, f"model.max_seq_len: {cfg.model.max_seq_len}, but"),
    ]:
        path.write_bytes(dump_task_requests(_tasks(), meta))
        with pytest.raises(ConfigError, match=re.escape(said)):
            load_in_loop_requests(cfg, path)
    path.write_bytes(dump_task_requests(_tasks(), {"task_names": ["synthetic"], "limit": 10, "pad_id": 3}))
    assert load_in_loop_requests(cfg, path) == (_tasks(), {"format": "moe-eval-requests/1", "task_names": ["synthetic"], "limit": 10, "pad_id": 3})


def test_what_the_window_cuts_is_logged_with_each_evaluation(tmp_path, corpus):
    """A task whose contexts the model's window cuts (or whose documents were left out for it)
    logs the counts beside its scores, as the evaluate stage does; one that fits logs none."""
    from moe.config.in_loop_eval import InLoopEvalConfig

    long = [Request(d, 0, tuple(range(2, 40)), (5,), 0, 2, 2, 1, 1) for d in range(3)]
    short = [Request(d, 0, (2, 3), (5,), 0, 2, 2, 1, 1) for d in range(2)]
    tasks = [TaskRequests("long", "acc", tuple(long), 4, dropped=(3,)), TaskRequests("short", "acc", tuple(short), 2)]
    cb = InLoopEvalCallback(InLoopEvalConfig(every=1), tasks, [], max_len=16)
    assert cb.cut == {"long": (3.0, 1.0), "short": (0.0, 0.0)}
    trainer = Trainer(tiny_config(Path(corpus), tmp_path / "ck", train={"max_steps": 4}))
    metrics = cb.after_step(trainer, 1)
    assert metrics["eval/long/truncated_docs"] == 3 and metrics["eval/long/dropped_docs"] == 1
    assert "eval/long/acc" in metrics and "eval/short/acc" in metrics
    assert not any(k.startswith("eval/short/") and k.endswith("_docs") for k in metrics)
