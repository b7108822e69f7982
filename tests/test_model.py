import pytest
import torch

from moe.config import ModelConfig
from moe.layers import MoELayer
from moe.model import Transformer
from moe.nn import SwiGLU


def tiny(**over):
    return Transformer(ModelConfig.from_dict({"preset": "tiny", **over}).validate())


def test_logits_shape_and_causality():
    model = tiny().eval()
    x = torch.randint(0, 512, (2, 20))
    logits = model(x)
    assert logits.shape == (2, 20, 512)
    y = x.clone()
    y[:, 12:] = (y[:, 12:] + 7) % 512
    torch.testing.assert_close(model(y)[:, :12], logits[:, :12])
    assert not torch.allclose(model(y)[:, 12:], logits[:, 12:])


def test_tied_embeddings_share_one_tensor():
    model = tiny(tie_embeddings=True)
    assert model.lm_head.weight is model.embed.weight


def test_dense_layers_by_config():
    model = tiny(dense_layers=[0], dense_hidden=48, n_layers=3)
    kinds = [type(b.mlp) for b in model.layers.values()]
    assert kinds == [SwiGLU, MoELayer, MoELayer]
    assert [name for name, _ in model.moe_layers()] == ["1", "2"]


def test_grouped_query_attention_runs():
    model = tiny(n_kv_heads=2)
    assert model.layers["0"].attn.k_proj.weight.shape == (32, 64)
    model(torch.randint(0, 512, (1, 8))).sum().backward()


def test_sequence_longer_than_max_is_refused():
    model = tiny(max_seq_len=16)
    with pytest.raises(ValueError, match="exceeds model.max_seq_len=16"):
        model(torch.randint(0, 512, (1, 17)))


def test_pipeline_stage_can_drop_modules():
    model = tiny(n_layers=4).eval()
    x = torch.randint(0, 512, (1, 10))
    full = model(x)
    first = tiny(n_layers=4).eval()
    first.load_state_dict(model.state_dict())
    second = tiny(n_layers=4).eval()
    second.load_state_dict(model.state_dict())
    del first.layers["2"], first.layers["3"]
    first.norm = first.lm_head = None
    del second.layers["0"], second.layers["1"]
    second.embed = None
    torch.testing.assert_close(second(first(x)), full)


def test_the_residual_add_folded_into_the_combine_changes_nothing_on_the_cpu(monkeypatch):
    """MOE_RESIDUAL_ADD (moe.layers.moe_layer.RESIDUAL_IN_COMBINE): the blocks hand their
    residual to the MoE layers; on the CPU the same logits and gradients bit for bit (dense layer kept)."""
    from moe.layers import moe_layer

    torch.manual_seed(0)
    model = tiny(dense_layers=[0], dense_hidden=48, n_layers=3)
    x = torch.randint(0, 512, (2, 12))
    runs = []
    for folded in (False, True):
        monkeypatch.setattr(moe_layer, "RESIDUAL_IN_COMBINE", folded)
        logits = model(x)
        logits.float().pow(2).mean().backward()
        runs.append([logits.detach(), *(p.grad.clone() for p in model.parameters())])
        model.zero_grad()
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)
