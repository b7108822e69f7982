"""Run under TRITON_INTERPRET=1: two gloo ranks with ZeRO-1 and the gradient reduction overlapped
with the backward, bf16 weights, two micro-batches, and the expert weight gradient accumulated
inside its GEMM (optim.expert_wgrad: gemm) against the separate path. The GEMM returns no
gradient for the expert weights, so the buckets must still learn that they are ready (the
post-accumulate hooks) and launch inside the backward; the losses must agree."""

import os
import sys
import tempfile
from pathlib import Path

from tests.helpers import make_corpus
from tests.parallel.dist_utils import run_ranks
from tests.parallel.test_grad_sync import train_rank


def both_ways(rank, world, corpus, tmp, parallel, train):
    """The two variants one after the other in the same rank processes (one spawn, one import).
    The norms and RoPE take their eager paths (what they are is not the question here; their
    kernels under the interpreter would take most of the test's time)."""
    import moe.nn.norm
    from moe.kernels import rmsnorm, rope

    moe.nn.norm.rms_norm = rmsnorm.rms_norm_reference
    rope.fusable = lambda *a: False
    return {w: train_rank(rank, world, corpus, f"{tmp}/{w}", parallel, train, 64 * 1024, "bf16", {"expert_wgrad": w}) for w in ("gemm", "separate")}


def main() -> int:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run under TRITON_INTERPRET=1"
    parallel = {"shard_optimizer": True, "overlap_grad_reduce": True}
    train = {"micro_batch_size": 2, "max_steps": 2}
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus"
        corpus.mkdir()
        make_corpus(corpus)
        ranks = run_ranks(both_ways, 2, str(corpus), tmp, parallel, train)
        runs = {w: [r[w] for r in ranks] for w in ("gemm", "separate")}
    for r in runs["gemm"]:
        early, total = r["early"]
        assert r["overlapped"] and early >= 1 and total > 2, r["early"]
    for a, b in zip(runs["gemm"], runs["separate"], strict=True):
        for x, y in zip(a["losses"], b["losses"], strict=True):
            assert abs(x - y) <= 2e-3 * abs(y), (a["losses"], b["losses"])
    print("fused wgrad ranks ok", runs["gemm"][0]["losses"], runs["separate"][0]["losses"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
