"""The fused, chunked lm_head + cross-entropy against the unfused head and fp32 loss."""

import pytest
import torch

from moe.config import ModelConfig
from moe.model import Transformer, run_stack
from moe.nn.chunked_ce import IGNORE_INDEX, chunked_linear_cross_entropy, unfused_linear_cross_entropy


def _inputs(n=37, d=16, v=101, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g).to(dtype).requires_grad_(True)
    weight = (torch.randn(v, d, generator=g) * 0.5).to(dtype).requires_grad_(True)
    target = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, target


def _loss_and_grads(fn, hidden, weight, target):
    h, w = hidden.detach().clone().requires_grad_(True), weight.detach().clone().requires_grad_(True)
    loss = fn(h, w, target)
    loss.backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("chunk", [1, 8, 37, 1000])
def test_fp32_matches_unfused(chunk):
    hidden, weight, target = _inputs()
    target[3] = IGNORE_INDEX  # ignored tokens count as in F.cross_entropy
    ref = _loss_and_grads(unfused_linear_cross_entropy, hidden, weight, target)
    got = _loss_and_grads(lambda h, w, t: chunked_linear_cross_entropy(h, w, t, chunk), hidden, weight, target)
    for r, g in zip(ref, got, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


def test_bf16_matches_unfused_within_bf16_rounding():
    hidden, weight, target = _inputs(n=64, d=32, v=257, dtype=torch.bfloat16)
    ref = _loss_and_grads(unfused_linear_cross_entropy, hidden, weight, target)
    got = _loss_and_grads(lambda h, w, t: chunked_linear_cross_entropy(h, w, t, 16), hidden, weight, target)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-5)  # fp32 log-sum-exp on the same bf16 logits
    for r, g in zip(ref[1:], got[1:], strict=True):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g.float(), r.float(), rtol=2e-2, atol=2e-3)


def test_autocast_casts_like_linear():
    hidden, weight, target = _inputs()

    def under_autocast(fn):
        def run(h, w, t):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return fn(h, w, t)

        return run

    ref = _loss_and_grads(under_autocast(unfused_linear_cross_entropy), hidden, weight, target)
    got = _loss_and_grads(under_autocast(lambda h, w, t: chunked_linear_cross_entropy(h, w, t, 8)), hidden, weight, target)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-5)
    for r, g in zip(ref[1:], got[1:], strict=True):
        assert g.dtype == torch.float32  # fp32 leaves get fp32 gradients through the cast
        torch.testing.assert_close(g, r, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("tie", [False, True])
def test_model_gradients_match_unfused(tie):
    cfg = ModelConfig.from_dict({"preset": "tiny", "vocab_size": 97, "n_layers": 2, "tie_embeddings": tie}).validate()
    torch.manual_seed(0)
    model = Transformer(cfg)
    tokens = torch.randint(0, 97, (3, 11))

    def grads(chunk):
        model.zero_grad(set_to_none=True)
        if chunk:
            hidden = run_stack(model, tokens[:, :-1], head=False)
            loss = chunked_linear_cross_entropy(hidden, model.lm_head.weight, tokens[:, 1:], chunk)
        else:
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].reshape(-1))
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ref_loss, ref = grads(0)
    loss, got = grads(7)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert got.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")


def test_bad_chunk_size_fails_clearly():
    hidden, weight, target = _inputs()
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1"):
        chunked_linear_cross_entropy(hidden, weight, target, 0)


def test_saves_no_logits_for_backward():
    """Only the inputs and per-token numbers are kept for backward: nothing of [tokens, vocab]."""
    hidden, weight, target = _inputs(n=64, d=8, v=500)
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = chunked_linear_cross_entropy(hidden, weight, target, 16)
    loss.backward()
    assert saved and max(saved) <= weight.numel() and all(n < 64 * 500 for n in saved)


def test_negative_chunk_is_a_config_error():
    from moe.config import ConfigError, TrainConfig

    with pytest.raises(ConfigError, match=r"loss_chunk_tokens: must be >= 0 \(0: off\), got -1"):
        TrainConfig.from_dict({"loss_chunk_tokens": -1}).validate()


def test_fsdp_layout_refuses_the_chunked_loss(tmp_path):
    from moe.config import ConfigError
    from moe.parallel.env import DistEnv
    from moe.parallel.layout import FsdpLayout
    from tests.helpers import tiny_config

    cfg = tiny_config(tmp_path, tmp_path / "ck", parallel={"data_parallel": "fsdp"}, train={"loss_chunk_tokens": 16})
    with pytest.raises(ConfigError, match="train.loss_chunk_tokens: the chunked loss runs with parallel.data_parallel=ddp only"):
        FsdpLayout(cfg, DistEnv(0, 1, 0, torch.device("cpu")))
