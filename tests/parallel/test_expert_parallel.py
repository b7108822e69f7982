"""The all-to-all expert-parallel MoE layer against the single-process layer."""

import pytest
import torch

from moe.config import MoEConfig
from moe.layers import MoELayer
from moe.parallel.expert_parallel import apply_expert_parallel
from moe.parallel.mesh import build_mesh
from tests.parallel.dist_utils import run_ranks

pytestmark = pytest.mark.distributed
D, H, E, K, T = 16, 8, 8, 2, 24


def make_layer():
    torch.manual_seed(0)
    layer = MoELayer(D, MoEConfig(num_experts=E, top_k=K, expert_hidden=H, lb_loss_weight=0.0, z_loss_weight=0.0))
    layer.reset_parameters(0.3)
    return layer


def inputs(world):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(world * T, D, generator=g)
    probe = torch.randn(world * T, D, generator=g)
    return x, probe


def ep_rank(rank, world):
    layer = make_layer()
    mesh = build_mesh(1, world, world)
    apply_expert_parallel(layer, mesh)
    x_all, probe_all = inputs(world)
    x = x_all[rank * T : (rank + 1) * T].clone().requires_grad_(True)
    out = layer(x)
    (out * probe_all[rank * T : (rank + 1) * T]).sum().backward()
    return {
        "out": out.detach(),
        "dx": x.grad,
        "router": layer.router.weight.grad,
        "gate_up": layer.experts.gate_up.grad,
        "offset": layer.experts.expert_offset,
        "local_counts": layer.last_stats.tokens_per_expert,
    }


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_layer_matches_single_process(world):
    results = run_ranks(ep_rank, world)
    layer = make_layer()
    x_all, probe_all = inputs(world)
    x = x_all.clone().requires_grad_(True)
    out = layer(x)
    (out * probe_all).sum().backward()
    local = E // world
    for rank, r in enumerate(results):
        rows = slice(rank * T, (rank + 1) * T)
        torch.testing.assert_close(r["out"], out[rows].detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r["dx"], x.grad[rows], rtol=1e-5, atol=1e-6)
        assert r["offset"] == rank * local
        # all tokens of the experts this rank holds came to it: the expert gradient is complete
        torch.testing.assert_close(r["gate_up"], layer.experts.gate_up.grad[rank * local : (rank + 1) * local], rtol=1e-5, atol=1e-6)
    # the router gradient is split over the ranks' tokens
    torch.testing.assert_close(sum(r["router"] for r in results), layer.router.weight.grad, rtol=1e-5, atol=1e-6)
