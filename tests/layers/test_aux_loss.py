import torch

from moe.layers.aux_loss import attach_aux_loss


def test_attach_adds_scaled_gradient_and_leaves_value():
    w = torch.tensor(2.0, requires_grad=True)
    a = torch.ones(3, requires_grad=True)
    aux = w * w  # d/dw = 2w = 4
    out = attach_aux_loss(a * 3, aux, 0.25)
    assert torch.equal(out, torch.full((3,), 3.0))
    out.sum().backward()
    assert w.grad.item() == 0.25 * 4
    assert torch.equal(a.grad, torch.full((3,), 3.0))
