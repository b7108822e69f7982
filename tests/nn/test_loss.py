"""The output-logit z-loss (train.logit_z_loss_weight, Olmo-core's z_loss_multiplier): in the
gradient exactly as CE + w * mean(logsumexp^2), unfused and through the chunked head; the
returned value stays the cross-entropy."""

import pytest
import torch
import torch.nn.functional as F

from moe.nn.chunked_ce import IGNORE_INDEX
from moe.nn.loss import lm_loss


def _reference(hidden, weight, target, w):
    logits = (hidden @ weight.t()).flatten(0, 1).float()
    flat = target.reshape(-1)
    ce = F.cross_entropy(logits, flat)
    valid = flat != IGNORE_INDEX
    z = torch.logsumexp(logits, -1).square()[valid].mean()
    return ce, ce + w * z


@pytest.mark.parametrize("chunk", [0, 3, 100])
def test_logit_z_loss_gradient_and_value(chunk):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 7, 8, generator=g, requires_grad=True)
    weight = torch.randn(13, 8, generator=g, requires_grad=True)
    target = torch.randint(0, 13, (2, 7), generator=g)
    target[0, 2] = IGNORE_INDEX
    w = 0.05
    ce, total = _reference(hidden, weight, target, w)
    total.backward()
    expected = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    got = lm_loss(hidden, target, weight, chunk, w) if chunk else lm_loss(hidden @ weight.t(), target, z_weight=w)
    assert got.item() == pytest.approx(ce.item(), abs=1e-6)  # the value: cross-entropy only
    got.backward()
    torch.testing.assert_close(hidden.grad, expected[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(weight.grad, expected[1], atol=1e-6, rtol=1e-5)


def test_logit_z_loss_backward_holds_one_vocabulary_gradient():
    """The unfused CE + z-loss keeps no second fp32 logits copy and writes one [N, V] gradient
    (issue 36: autograd on the two losses apart held three at the peak)."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 1000, generator=g, requires_grad=True)
    target = torch.randint(0, 1000, (1, 64), generator=g)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = lm_loss(logits.unsqueeze(0), target, z_weight=1e-5)
    vocab_sized = [t for t in saved if t.numel() >= 64 * 1000]
    assert len(vocab_sized) == 1  # the fp32 logits (the input here), once
    loss.backward()
    assert logits.grad.shape == logits.shape


def test_logit_z_loss_changes_training(tmp_path, corpus):
    from moe.train.trainer import Trainer
    from tests.helpers import tiny_config

    runs = [Trainer(tiny_config(corpus, tmp_path / f"c{w}", train={"max_steps": 3, "logit_z_loss_weight": w})).fit() for w in (0.0, 0.1)]
    # the same first step: the value logged is the cross-entropy, not cross-entropy + z-loss (0.1 x mean(lse^2), far above rounding);
    # the two paths sum it in different orders (F.cross_entropy against logsumexp - picked), so to rounding
    assert runs[0].losses[1] == pytest.approx(runs[1].losses[1], rel=1e-6, abs=0)
    assert runs[0].final_loss != runs[1].final_loss  # the gradient differs
