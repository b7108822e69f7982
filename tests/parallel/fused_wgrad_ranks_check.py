"""Run under TRITON_INTERPRET=1: two gloo ranks with ZeRO-1 and the gradient reduction overlapped
with the backward, bf16 weights, two micro-batches, and the expert weight gradient accumulated
inside its GEMM (optim.expert_wgrad: gemm) against the separate path. The GEMM returns no
gradient for the expert weights, so the buckets must still learn that they are ready (the
post-accumulate hooks) and launch inside the backward; the synchronised gradients must agree."""

import os
import sys
import tempfile
from pathlib import Path

from tests.helpers import make_corpus
from tests.parallel.dist_utils import run_ranks


def both_ways(rank, world, corpus, tmp):
    """The first step's synchronised gradients both ways, one after the other in the same rank
    processes (one spawn, one import). The norms and RoPE take their eager paths (what they are is
    not the question here; their kernels under the interpreter would take most of the time)."""
    import moe.nn.norm
    from moe.kernels import grouped_wgrad as gw
    from moe.kernels import rmsnorm, rope
    from moe.train.trainer import Trainer
    from tests.parallel.layout_runs import first_step_grads
    from tests.parallel.test_grad_sync import config

    moe.nn.norm.rms_norm = rmsnorm.rms_norm_reference
    rope.fusable = lambda *a: False
    launches = []
    kernel = gw.grouped_wgrad
    gw.grouped_wgrad = lambda *a, **k: launches.append(1) or kernel(*a, **k)
    parallel = {"shard_optimizer": True, "overlap_grad_reduce": True, "grad_bucket_mb": 1 / 16}
    out = {}
    for wgrad in ("gemm", "separate"):
        cfg = config(Path(corpus), Path(tmp) / wgrad, parallel, {"micro_batch_size": 2}, recipe="bf16", optim={"expert_wgrad": wgrad})
        trainer = Trainer(cfg)
        grads = first_step_grads(trainer)
        sync = trainer.layout.sync
        out[wgrad] = {"grads": grads, "early": (sync.launched_in_backward, len(sync.buckets)), "launches": len(launches)}
        launches.clear()
    return out


def main() -> int:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run under TRITON_INTERPRET=1"
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus"
        corpus.mkdir()
        make_corpus(corpus)
        ranks = run_ranks(both_ways, 2, str(corpus), tmp)
    for r in ranks:
        early, total = r["gemm"]["early"]
        assert early >= 1 and total > 2, r["gemm"]["early"]
        # 4 layers x 2 expert weights x 2 micro-batches through the kernel; none on the separate path
        assert r["gemm"]["launches"] == 16 and r["separate"]["launches"] == 0, r
        fused, separate = r["gemm"]["grads"], r["separate"]["grads"]
        assert fused.keys() == separate.keys() and fused
        for name, g in fused.items():
            # the separate path rounds each micro-batch's expert gradient to bf16 before adding it
            err = ((g - separate[name]).norm() / separate[name].norm().clamp_min(1e-30)).item()
            assert err < 1e-2, (name, err)
    print("fused wgrad ranks ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
