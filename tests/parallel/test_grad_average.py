"""Gradient averaging on NCCL (ReduceOp.AVG inside the collective, no division pass) against
the mean computed by hand, for all-reduce and ZeRO-1, fp32 and bf16 traffic, and with an
expert group smaller than dp (sum, then divide by dp). Needs two GPUs (run on the H200 pair)."""

import pytest
import torch

from tests.parallel.dist_utils import run_ranks

two_gpus = [pytest.mark.cuda, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]
pytestmark = pytest.mark.distributed
CASES = [(False, "float32", 1), (True, "float32", 1), (False, "bfloat16", 1), (False, "float32", 2)]


def _gradients(seed: int, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}


def average_on_rank(rank, world, zero, reduce_dtype, ep, device="cuda"):
    from moe.config import ModelConfig, OptimizerConfig
    from moe.model import Transformer
    from moe.optim import MasterWeightAdamW
    from moe.parallel.expert_parallel import apply_expert_parallel
    from moe.parallel.grad_sync import GradSync
    from moe.parallel.mesh import build_mesh

    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_dict({"preset": "tiny", "vocab_size": 256}).validate()).to(device).bfloat16()
    mesh = build_mesh(1, world, ep)
    model = apply_expert_parallel(model, mesh, "nccl", None)
    sync = GradSync(model, mesh, zero, getattr(torch, reduce_dtype))
    opt = MasterWeightAdamW(model, OptimizerConfig(), master_weights=True, owns=sync.owns)
    mine = _gradients(rank, model)
    for p in opt.params:
        p.grad_holder.grad = mine[p.name].to(device)
    sync.reduce(opt)
    every = [_gradients(r, model) for r in range(world)]
    out = {}
    for p in opt.params:
        spec = sync.specs[sync.kind_of(p.name)]
        if zero and not sync.owns(p.name, p.param):
            continue
        group = [every[r][p.name] for r in spec.ranks]
        expect = torch.stack([g.to(getattr(torch, reduce_dtype)).float() for g in group]).sum(0) / world
        out[p.name] = (p.grad.cpu(), expect)
    return out


@pytest.mark.parametrize("zero, reduce_dtype, ep", CASES)
def test_gloo_sum_then_divide_is_the_mean(zero, reduce_dtype, ep):
    """The same check on CPU ranks (gloo has no AVG): the test's own arithmetic holds."""
    check(run_ranks(average_on_rank, 2, zero, reduce_dtype, ep, "cpu"), reduce_dtype)


@pytest.mark.parametrize("zero, reduce_dtype, ep", CASES)
@two_gpus[0]
@two_gpus[1]
def test_nccl_average_is_the_mean(zero, reduce_dtype, ep):
    check(run_ranks(average_on_rank, 2, zero, reduce_dtype, ep, backend="nccl"), reduce_dtype)


def check(results, reduce_dtype):
    for rank_out in results:
        assert rank_out
        for name, (got, expect) in rank_out.items():
            # fp32: exact up to summation order; bf16: the sum is rounded once more
            tol = 1e-6 if reduce_dtype == "float32" else 2**-7
            torch.testing.assert_close(got, expect, rtol=tol, atol=tol, msg=lambda m, n=name: f"{n}: {m}")
