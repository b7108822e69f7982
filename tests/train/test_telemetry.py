"""Telemetry under expert parallelism (EP=2, gloo) equals a single-process count of the same tokens."""

import pytest
import torch
from torch import nn

from moe.config import MoEConfig
from moe.layers import MoELayer
from moe.parallel.expert_parallel import apply_expert_parallel
from moe.parallel.mesh import build_mesh
from moe.train.telemetry import MoETelemetry
from tests.parallel.dist_utils import run_ranks

D, H, E, K, T, LAYERS = 16, 8, 8, 2, 24, 2


def make_model():
    """Two MoE layers named like the Transformer's (blocks.<i>.<module>); a sharp router so
    the load is uneven."""
    torch.manual_seed(0)
    model = nn.Module()
    model.blocks = nn.ModuleList()
    for _ in range(LAYERS):
        layer = MoELayer(D, MoEConfig(num_experts=E, top_k=K, expert_hidden=H))
        layer.reset_parameters(1.0)
        model.blocks.append(nn.ModuleDict({"ffn": layer}))
    return model.train()


def batches(world, steps=2):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(world * T, D, generator=g) for _ in range(steps)]


def run(model, xs):
    with torch.no_grad():
        for x in xs:
            for block in model.blocks:
                x = block["ffn"](x)


def ep_rank(rank, world):
    model = make_model()
    mesh = build_mesh(1, world, world)
    for block in model.blocks:
        apply_expert_parallel(block["ffn"], mesh)
    tele = MoETelemetry(model, torch.device("cpu"), mesh.dp_group)
    run(model, [x[rank * T : (rank + 1) * T] for x in batches(world)])
    return tele.reduce()


def test_ep2_per_rank_rows_and_load_match_single_process():
    world = 2
    results = run_ranks(ep_rank, world)
    assert results[0] == results[1]  # every rank reports the same figures
    got = results[0]

    # single process over the same tokens: per source rank, count what each expert shard gets
    model = make_model()
    tele = MoETelemetry(model, torch.device("cpu"))
    rows = torch.zeros(LAYERS, world, dtype=torch.int64)
    totals = torch.zeros(LAYERS, E, dtype=torch.int64)
    for x in batches(world):
        h = x
        for i, block in enumerate(model.blocks):
            layer = block["ffn"]
            with torch.no_grad():
                for src in range(world):
                    counts = layer.router(h[src * T : (src + 1) * T]).tokens_per_expert
                    rows[i] += counts.view(world, E // world).sum(1)
                    totals[i] += counts
                h = layer(h)
    want = tele.reduce()
    for i in range(LAYERS):
        r = rows[i].double()
        assert got[f"ep_rows_max_over_mean/layer_{i}"] == pytest.approx((r.max() / r.mean()).item(), abs=1e-12)
        assert got[f"ep_rows_max_over_mean/layer_{i}"] > 1.0  # the uneven load shows per rank
        c = totals[i].double()
        assert want[f"expert_load_max_over_mean/layer_{i}"] == pytest.approx((c.max() / c.mean()).item(), abs=1e-12)
    for key, value in want.items():  # every figure of the load equals the single-process one
        if key.startswith("expert_load"):
            assert got[key] == pytest.approx(value, abs=1e-12), key
    assert "ep_rows_max_over_mean" not in want and got["ep_rows_max_over_mean"] == max(got[f"ep_rows_max_over_mean/layer_{i}"] for i in range(LAYERS))
    # Dropless both ways: every routed slot was computed by some rank's experts.
    assert got["tokens_dropped_fraction"] == want["tokens_dropped_fraction"] == 0.0


def trainer_rank(rank, world, corpus, ckpt):
    from pathlib import Path

    from moe.train.trainer import Trainer
    from tests.helpers import tiny_config

    cfg = tiny_config(
        Path(corpus),
        Path(ckpt),
        model={"n_layers": 4},
        parallel={"pp": 2, "ep": 2},
        train={"global_batch_size": 8, "micro_batch_size": 2, "max_steps": 2, "log_every": 1},
    )
    return Trainer(cfg).fit().last_metrics


def test_pipeline_and_expert_parallel_trainer_reports_every_layer(tmp_path, corpus):
    """pp=2 x dp=2 (ep=2): each stage reduces its own layers, rows per rank come from the
    all-to-all, and the logging rank sees all four layers."""
    results = run_ranks(trainer_rank, 4, str(corpus), str(tmp_path / "ck"))
    m = results[0]
    for i in range(4):
        assert m[f"ep_rows_max_over_mean/layer_{i}"] >= 1.0
        assert 0 < m[f"expert_load_entropy/layer_{i}"] <= 1
        assert sum(m[f"expert_load/layer_{i}/expert_{e}"] for e in range(8)) == pytest.approx(8.0)
    assert all(r["load_alarm"] == 0 for r in results)
