"""bench.layer on CPU: the optional SonicMoE peer is skipped with a note where it does not
import, and its weight views follow SonicMoE's documented layout (checked by a per-expert
emulation against our layer). Timing itself needs the GPU machine."""

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from bench.layer import GroupedGemmOnly, PeerUnavailable, Shape, build_ours, build_sonic, make_weights, run_shape, sonic_weights

SHAPE = Shape(d=16, h=8, experts=4, top_k=2)
CPU = torch.device("cpu")
no_sonic = pytest.mark.skipif(importlib.util.find_spec("sonicmoe") is not None, reason="sonic-moe is installed here")


@no_sonic
def test_sonic_is_skipped_with_a_note_where_it_does_not_import(capsys):
    with pytest.raises(PeerUnavailable, match="sonic-moe does not import here"):
        build_sonic(SHAPE, make_weights(SHAPE, CPU), torch.bfloat16)
    rows = run_shape(SHAPE, 8, ["sonic"], iters=1, device=CPU)
    assert len(rows) == 1 and "skipped" in rows[0] and "error" not in rows[0] and "tflops" not in rows[0]
    assert "note: skipping sonic" in capsys.readouterr().out


def test_sonic_weight_views_match_our_layer():
    """SonicMoE computes, per token, sum over its top-k experts (of softmax over all) of
    p * w2[:, :, e] @ (silu(w1[:h, :, e] @ x) * w1[h:, :, e] @ x) with concat_layout=True."""
    w = make_weights(SHAPE, CPU)
    ours = build_ours(SHAPE, w, torch.float32)
    x = torch.randn(10, SHAPE.d)
    gate_up = torch.cat([w["w1"], w["w3"]], dim=1).contiguous()
    w1, w2 = sonic_weights(gate_up, w["w2"].contiguous())
    assert w1.shape == (2 * SHAPE.h, SHAPE.d, SHAPE.experts) and w2.shape == (SHAPE.d, SHAPE.h, SHAPE.experts)
    assert w1.stride(2) > w1.stride(0) > w1.stride(1) and w2.stride(2) > w2.stride(0) > w2.stride(1)  # order (2, 0, 1)
    probs, experts = F.softmax(x @ w["router"].t(), dim=-1).topk(SHAPE.top_k, dim=-1)
    expected = torch.zeros_like(x)
    h = SHAPE.h
    for t in range(x.shape[0]):
        for p, e in zip(probs[t], experts[t], strict=True):
            act = F.silu(w1[:h, :, e] @ x[t]) * (w1[h:, :, e] @ x[t])
            expected[t] += p * (w2[:, :, e] @ act)
    with torch.no_grad():
        got = ours(x[None])[0]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_the_gemm_only_peer_runs_our_routing_group_sizes_and_checks_itself():
    """The ceiling peer times the six expert GEMMs on the rows our router picks; its self-check
    (fp32 per-expert loop) passes, and a wrong result would not."""
    w = make_weights(SHAPE, CPU)
    peer = GroupedGemmOnly(SHAPE, w, torch.bfloat16)
    x = torch.randn(1, 24, SHAPE.d).bfloat16()
    peer.prepare(x)
    assert peer.rows.shape == (24 * SHAPE.top_k, SHAPE.d) and int(peer.offsets[-1]) == 24 * SHAPE.top_k
    peer.bench_step()
    err_out, err_dx = peer.bench_check()
    assert err_out < 1e-2 and err_dx < 1e-2
    assert peer.layer.experts.gate_up.grad is not None and peer.layer.experts.down.grad is not None
    assert peer.bench_flops(24) == 6 * 24 * SHAPE.top_k * 3 * SHAPE.d * SHAPE.h
    peer.last[1].add_(1.0)  # a corrupted output is caught
    assert peer.bench_check()[0] > 0.1
