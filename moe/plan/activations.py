"""Activation bytes per token, calibrated: an analytic count of what autograd keeps for one block
in each recompute mode (and around the loss), and the factors measured on a GPU that scale it
(``calibration.json``, written by ``bench/memory.py`` with the device and torch version it came
from)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from moe.config.model import ModelConfig
from moe.errors import PlanError

CALIBRATION = Path(__file__).with_name("calibration.json")


def _norm(dim: int, act: int = 2) -> int:
    """The fused RMSNorm (moe.kernels.rmsnorm, on CUDA) keeps only its bf16 input and one fp32
    rstd per row (the eager norm kept an fp32 copy of the input and its bf16 output: 6 * dim + 4)."""
    return act * dim + 4


def analytic_layer_bytes(m: ModelConfig, mode: str, moe_layer: bool, act: int = 2) -> float:
    """Bytes per token autograd keeps for one block (bf16 activations; counted from the ops'
    saved tensors, see moe.parallel.recompute for what each mode keeps)."""
    d, kv, h = m.d_model, m.kv_heads * m.head_dim, m.n_heads
    moe = m.moe
    k, hid, e = moe.top_k, moe.expert_hidden, moe.num_experts
    hs = moe.shared_hidden_total
    hd = m.dense_hidden or 0
    if mode == "full":
        return act * d
    if mode == "none":
        attn = _norm(d, act) + (_norm(d, act) + _norm(kv, act) if m.qk_norm else 0) + act * (d + kv) + act * kv + act * d + 4 * h + act * d
        if moe_layer:
            mlp = _norm(d, act) + 8 * e + 8 * k + 24 * k + act * k * d + 2 * act * k * hid + act * k * hid + act * k * d + 4 * k + 4 * act * hs
        else:
            mlp = _norm(d, act) + 4 * act * hd
        return attn + mlp
    attention = act * d + 4 * h  # the attention kernel's output and log-sum-exp
    experts = 4 * e + (2 * act * k * hid + act * k * d if moe_layer else 0)  # router logits, gate_up, down
    if mode == "selective":
        return act * d + attention + experts
    if mode == "matmuls":
        dense = act * (d + 2 * kv) + act * d  # q, k, v and o projections
        mlp_dense = (2 * act * hs + act * d) if moe_layer and hs else (2 * act * hd + act * d if not moe_layer else 0)
        return act * d + attention + dense + experts + mlp_dense
    raise PlanError(f"train.recompute: unknown mode {mode!r}")


def analytic_head_bytes(m: ModelConfig) -> float:
    """Bytes per token around torch's loss at the start of backward: fp32 log-softmax output, its
    gradient and the fp32 logits' gradient, plus the bf16 logits' gradient and the final norm."""
    return 14 * m.vocab_size + _norm(m.d_model)


def fused_head_bytes(m: ModelConfig) -> float:
    """Bytes per token around the fused loss (moe.kernels.cross_entropy): the bf16 gradient it
    wrote over the logits, and the final norm. Exact sizes: not scaled by the calibration."""
    return 2 * m.vocab_size + _norm(m.d_model)


def load_calibration(path: Path = CALIBRATION) -> dict[str, Any]:
    """The measured factors (``layer_factor`` per recompute mode, ``head_factor``, ``source``);
    without the table, the analytic count as it is."""
    if not path.is_file():
        return {"source": "analytic (no measured table)", "layer_factor": {}, "head_factor": 1.0}
    return json.loads(path.read_text())
