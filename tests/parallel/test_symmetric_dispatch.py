"""The sync-free symmetric-buffer EP dispatcher (gloo-emulated transport) against one process.

Offsets and layout are checked directly; the layer at EP=2 and EP=4 must match the
single-process layer (gradients 1e-5) and follow it over ten optimizer steps (losses 1e-4),
including routing skewed so that every token picks experts of one rank: nothing dropped."""

import pytest
import torch

from moe.config import MoEConfig
from moe.layers import MoELayer
from moe.parallel.expert_parallel import apply_expert_parallel
from moe.parallel.mesh import build_mesh
from moe.parallel.symmetric_dispatch import SymmetricDispatcher, plan_routes
from tests.parallel.dist_utils import run_ranks

D, H, E, K, T = 16, 8, 8, 2, 24


def test_plan_routes_is_expert_major_and_inverts():
    # 2 sources with 4 slots each, 4 experts (2 per rank); counts[source, global expert]
    counts = torch.tensor([[1, 2, 0, 1], [2, 0, 1, 1]])
    routes = [plan_routes(counts, me, 4, 8) for me in range(2)]
    # receiver 0: expert 0 <- src0 (row 0), src1 (rows 1-2); expert 1 <- src0 (rows 3-4)
    assert routes[0][0].rank.tolist() == [0, 0, 0, 1] and routes[0][0].row.tolist() == [0, 3, 4, 1]
    assert routes[1][0].rank.tolist() == [0, 0, 1, 1] and routes[1][0].row.tolist() == [1, 2, 0, 2]
    back0 = routes[0][1]
    assert back0.rank.tolist() == [0, 1, 1, 0, 0, -1, -1, -1]
    assert back0.row.tolist()[:5] == [0, 0, 1, 1, 2]
    assert routes[0][2].tolist() == [3, 2] and routes[1][2].tolist() == [1, 2]
    assert [int(r[3]) for r in routes] == [5, 3] and not routes[0][4]
    # forward then back is the identity on every source slot
    for s in range(2):
        fwd = routes[s][0]
        for i in range(4):
            r, row = int(fwd.rank[i]), int(fwd.row[i])
            back = routes[r][1]
            assert (int(back.rank[row]), int(back.row[row])) == (s, i)


def test_capacity_overflow_is_flagged_not_written():
    counts = torch.tensor([[4, 0, 0, 0], [4, 0, 0, 0]])  # everything to rank 0
    fwd, _, rows, received, overflow = plan_routes(counts, 1, 4, 6)
    assert bool(overflow) and int(received) == 0
    fwd0, _, rows0, received0, _ = plan_routes(counts, 0, 4, 6)
    assert int(received0) == 8 and rows0.tolist() == [6, 0]
    assert fwd.rank.tolist() == [0, 0, -1, -1]  # rows past the capacity go nowhere


def make_layer(skew):
    torch.manual_seed(0)
    layer = MoELayer(
        D, MoEConfig(num_experts=E, top_k=K, expert_hidden=H, lb_loss_weight=0.0, z_loss_weight=0.0, bias_update_rate=1e-9 if skew else 0.0)
    )
    layer.reset_parameters(0.3)
    if skew:  # every token's top-k among experts 0 .. E/world-1 (those of EP rank 0 at any world)
        layer.router.expert_bias[: E // 4] = 100.0
    return layer


def inputs(world, step):
    g = torch.Generator().manual_seed(1 + step)
    return torch.randn(world * T, D, generator=g), torch.randn(world * T, D, generator=g)


def train(layer, rows, world, steps=10, distributed=False):
    """Ten SGD steps of a regression loss; first-step output/gradients and every loss."""
    opt = torch.optim.SGD(layer.parameters(), lr=2.0)
    losses, first = [], None
    for step in range(steps):
        x_all, target_all = inputs(world, step)
        x = x_all[rows].clone().requires_grad_(True)
        out = layer(x)
        loss = (out - target_all[rows]).square().sum() / (world * T * D)
        loss.backward()
        if distributed:  # the dense router is replicated: sum its gradient (experts are complete)
            torch.distributed.all_reduce(layer.router.weight.grad)
        if first is None:
            first = {
                "out": out.detach(),
                "dx": x.grad,
                "router": layer.router.weight.grad.clone(),
                "gate_up": layer.experts.gate_up.grad.clone(),
                "down": layer.experts.down.grad.clone(),
            }
        losses.append(loss.detach())
        opt.step()
        opt.zero_grad()
    return first, torch.stack(losses)


def ep_rank(rank, world, skew, factor):
    layer = make_layer(skew)
    mesh = build_mesh(1, world, world)
    apply_expert_parallel(layer, mesh, "nvshmem", factor)
    assert isinstance(layer.dispatcher, SymmetricDispatcher)
    first, losses = train(layer, slice(rank * T, (rank + 1) * T), world, distributed=True)
    # the step's loss over all ranks, as one process sees it
    torch.distributed.all_reduce(losses)
    stats = layer.dispatcher.telemetry()
    return {**first, "losses": losses, "use": float(stats["ep_buffer_use"]), "overflows": int(stats["ep_overflows"])}


@pytest.mark.distributed
@pytest.mark.parametrize(
    "world, skew",
    [(2, False), (2, True), pytest.param(4, False, marks=pytest.mark.slow), pytest.param(4, True, marks=pytest.mark.slow)],
    ids=["ep2", "ep2-skewed", "ep4", "ep4-skewed"],
)
def test_symmetric_ep_matches_single_process(world, skew):
    results = run_ranks(ep_rank, world, skew, None)
    ref, ref_losses = train(make_layer(skew), slice(0, world * T), world)
    local = E // world
    for rank, r in enumerate(results):
        rows = slice(rank * T, (rank + 1) * T)
        torch.testing.assert_close(r["out"], ref["out"][rows], rtol=1e-5, atol=1e-8)
        torch.testing.assert_close(r["dx"], ref["dx"][rows], rtol=1e-5, atol=1e-8)
        experts = slice(rank * local, (rank + 1) * local)
        torch.testing.assert_close(r["gate_up"], ref["gate_up"][experts], rtol=1e-5, atol=1e-8)
        torch.testing.assert_close(r["down"], ref["down"][experts], rtol=1e-5, atol=1e-8)
        torch.testing.assert_close(r["losses"], ref_losses, rtol=1e-4, atol=1e-5)
        assert r["overflows"] == 0
    for r in results:  # already summed over ranks
        torch.testing.assert_close(r["router"], ref["router"], rtol=1e-5, atol=1e-8)
    if skew:  # rank 0 took every slot of every source: the worst case, and it fitted
        assert results[0]["use"] == pytest.approx(1.0) and all(r["use"] == 0.0 for r in results[1:])


def overflow_rank(rank, world):
    layer = make_layer(True)
    apply_expert_parallel(layer, build_mesh(1, world, world), "nvshmem", 1.0)
    out = layer(inputs(world, 0)[0][rank * T : (rank + 1) * T])
    return {"nan": bool(out.isnan().all()), "overflows": int(layer.dispatcher.telemetry()["ep_overflows"])}


@pytest.mark.distributed
def test_capacity_overflow_poisons_the_output_and_is_counted():
    for r in run_ranks(overflow_rank, 2):
        assert r["nan"] and r["overflows"] == 1


def uneven_rank(rank, world):
    layer = make_layer(False)
    apply_expert_parallel(layer, build_mesh(1, world, world), "nvshmem")
    try:
        layer(torch.randn(T + rank, D))
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.distributed
def test_uneven_token_counts_fail_clearly():
    for message in run_ranks(uneven_rank, 2):
        assert "needs the same tokens x top_k on every expert-parallel rank, got [48, 50]" in message


PUT_CHECK = """
import torch
from moe.parallel.transport import copy_valid_rows, put_rows
x = torch.randn(10, 24)
idx, rank, row = torch.tensor([3, 1, 4, 1, 5, 9]), torch.tensor([0, 1, 0, -1, 1, 0]), torch.tensor([2, 0, 0, 0, 1, 1])
outs = [torch.zeros(3, 24) for _ in range(2)]
for r in range(2):
    put_rows(x, idx, rank, row, outs[r], r)
assert torch.equal(outs[0][[2, 0, 1]], x[[3, 4, 9]]) and torch.equal(outs[1][:2], x[[1, 5]]) and not outs[1][2].any()
plain = torch.zeros(3, 24)
put_rows(x, None, rank, row, plain, 1)
assert torch.equal(plain[:2], x[[1, 4]])
assert torch.equal(copy_valid_rows(x, torch.tensor(7))[:7], x[:7])
print("put ok")
"""


def test_put_rows_kernel_under_the_interpreter():
    """The NVSHMEM transport's row-store kernel (there it stores into peer GPUs' memory)."""
    from tests.helpers import run_under_triton_interpreter

    run_under_triton_interpreter(["-c", PUT_CHECK], "put ok", timeout=300)


@pytest.mark.slow
@pytest.mark.distributed
def test_trainer_with_nvshmem_backend_matches_single_process(tmp_path, tmp_path_factory):
    """The whole training step (dp2-ep2, ep_backend=nvshmem emulated): first-step gradients and
    ten steps' losses against one process, as for every other layout (tests/parallel/test_layouts.py)."""
    from tests.helpers import make_corpus
    from tests.parallel.layout_runs import reference, train_rank

    corpus = tmp_path_factory.mktemp("tokens")
    make_corpus(corpus, files=2, tokens=6000)
    ref_grads, ref_losses = reference(tmp_path, corpus, 8, 0.01)
    results = run_ranks(train_rank, 2, str(corpus), str(tmp_path / "run"), {"ep": 2, "ep_backend": "nvshmem"}, 4, 10, 0.01, None)
    got = {k: g for r in results for k, g in r["grads"].items()}
    assert got.keys() == ref_grads.keys()
    for k in ref_grads:
        torch.testing.assert_close(got[k], ref_grads[k], rtol=1e-5, atol=1e-7, msg=lambda m, k=k: f"{k}: {m}")
    for step in ref_losses:
        assert results[0]["losses"][step] == pytest.approx(ref_losses[step], rel=1e-4), step
