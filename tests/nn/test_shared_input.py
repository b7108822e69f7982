"""Projections of one input with their input gradients summed in the GEMMs (moe.nn.shared_input),
against autograd over separate ``nn.Linear`` calls."""

import pytest
import torch
from torch import nn

from moe.nn import shared_input
from moe.nn.shared_input import shared_input_linear


@pytest.fixture(autouse=True)
def _on(monkeypatch):
    """The fused backward on for these tests, whatever MOE_SHARED_INPUT_GRAD says (it is the default)."""
    monkeypatch.setattr(shared_input, "SUM_IN_GEMM", True)


def _linears(dtype, d=48, outs=(48, 16, 16)):
    torch.manual_seed(0)
    return [nn.Linear(d, o, bias=False).to(dtype) for o in outs]


def _grads(fn, x, linears):
    x = x.detach().clone().requires_grad_(True)
    for m in linears:
        m.weight.grad = None
    outs = fn(x)
    sum((o.float() * (i + 1)).sin().sum() for i, o in enumerate(outs)).backward()
    return [o.detach() for o in outs], x.grad, [m.weight.grad for m in linears]


def test_forward_and_gradients_match_separate_linears_in_float64():
    linears = _linears(torch.float64)
    x = torch.randn(3, 5, 48, dtype=torch.float64)
    want = _grads(lambda t: tuple(m(t) for m in linears), x, linears)
    got = _grads(lambda t: shared_input_linear(t, *linears), x, linears)
    assert torch.equal(torch.cat([o.flatten() for o in got[0]]), torch.cat([o.flatten() for o in want[0]]))
    torch.testing.assert_close(got[1], want[1], rtol=1e-12, atol=1e-12)
    for g, w in zip(got[2], want[2], strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_fused_backward_runs_and_bf16_agrees_to_rounding():
    linears = _linears(torch.bfloat16)
    x = torch.randn(4, 7, 48, dtype=torch.bfloat16)
    ran = []
    original = shared_input._SharedInputLinear.backward

    def spy(ctx, *grads):
        ran.append(True)
        return original(ctx, *grads)

    shared_input._SharedInputLinear.backward = staticmethod(spy)
    try:
        got = _grads(lambda t: shared_input_linear(t, *linears), x, linears)
    finally:
        shared_input._SharedInputLinear.backward = staticmethod(original)
    want = _grads(lambda t: tuple(m(t) for m in linears), x, linears)
    assert ran == [True]
    torch.testing.assert_close(got[1].float(), want[1].float(), rtol=2e-2, atol=2e-2)
    for g, w in zip(got[2], want[2], strict=True):
        assert torch.equal(g, w)  # the weight gradients are F.linear's own GEMMs


def test_unused_output_and_plain_fallbacks():
    linears = _linears(torch.float64)
    x = torch.randn(2, 3, 48, dtype=torch.float64, requires_grad=True)
    q, k, v = shared_input_linear(x, *linears)
    q.sum().backward()  # k and v unused: their weights get no gradient
    torch.testing.assert_close(x.grad, linears[0].weight.sum(0).expand_as(x))
    assert linears[1].weight.grad is None and linears[2].weight.grad is None
    with torch.no_grad():  # not recorded: each module's own call
        outs = shared_input_linear(x, *linears)
    assert [o.shape[-1] for o in outs] == [48, 16, 16]
    with_bias = nn.Linear(48, 8).double()
    out = shared_input_linear(x, linears[0], with_bias)
    torch.testing.assert_close(out[1], with_bias(x))


def test_hooks_and_autocast_keep_each_modules_own_call():
    linears = _linears(torch.float32)
    x = torch.randn(2, 3, 48, requires_grad=True)
    seen = []
    handle = linears[1].register_forward_hook(lambda m, i, o: seen.append(o.shape[-1]))
    try:
        shared_input_linear(x, *linears)
    finally:
        handle.remove()
    assert seen == [16]  # the module's hook ran: the fused Function was not used
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = shared_input_linear(x, *linears)
    assert all(o.dtype == torch.bfloat16 for o in outs)
    sum(o.float().sum() for o in outs).backward()  # autograd's own backward, operands of one dtype
    assert x.grad is not None and all(m.weight.grad is not None for m in linears)


def test_off_by_default_each_module_is_called(monkeypatch):
    monkeypatch.setattr(shared_input, "SUM_IN_GEMM", False)
    linears = _linears(torch.float64)
    x = torch.randn(2, 3, 48, dtype=torch.float64, requires_grad=True)
    outs = shared_input_linear(x, *linears)
    assert all(o.grad_fn is not None and "SharedInput" not in type(o.grad_fn).__name__ for o in outs)


def test_an_autocast_to_the_inputs_own_dtype_keeps_the_fused_backward():
    """The bf16 recipe runs under a bf16 autocast on bf16 weights: nothing is cast, so the sum in
    the GEMMs applies there (it fell back before 2026-12-07, so no step had used it); the values are
    the separate calls' under the same autocast."""
    linears = _linears(torch.bfloat16)
    x = torch.randn(2, 7, 48, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = shared_input_linear(x.requires_grad_(), *linears)
        assert all("SharedInput" in type(o.grad_fn).__name__ for o in outs)
        want = _grads(lambda t: tuple(m(t) for m in linears), x, linears)
        got = _grads(lambda t: shared_input_linear(t, *linears), x, linears)
    assert all(torch.equal(a, b) for a, b in zip(got[0], want[0], strict=True))
    for g, w in zip(got[2], want[2], strict=True):
        assert torch.equal(g, w)  # the weight gradients are the same GEMMs
    torch.testing.assert_close(got[1].float(), want[1].float(), rtol=2e-2, atol=2e-2)  # one rounding fewer per sum


def _node_names(root) -> set[str]:
    seen, stack, names = set(), [root], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack.extend(fn for fn, _ in node.next_functions)
    return names


def test_the_bf16_recipes_attention_takes_the_fused_backward():
    """Where the product runs it: a bf16 model under the bf16 recipe's autocast (the trainer's
    forward) builds q, k and v through the fused Function."""
    from moe.config import ModelConfig
    from moe.model import Transformer
    from moe.precision import RECIPES

    model = Transformer(ModelConfig.from_dict({"preset": "tiny"}).validate()).to(torch.bfloat16)
    with RECIPES["bf16"].autocast(torch.device("cpu")):
        logits = model(torch.randint(0, 512, (1, 8)))
    assert "_SharedInputLinearBackward" in _node_names(logits.grad_fn)
