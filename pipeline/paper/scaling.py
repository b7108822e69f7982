"""The scaling rule: the paper's configuration, shrunk only as far as the hardware forces.

The paper's benchmark model is ``paper-8l`` (d_model 4096, 64 experts of hidden 4096, top-4,
sequence 8192, 8 layers, random routing). On the hardware at hand the rule keeps that and, only
while the largest variant of a stage is predicted not to fit in ``paper.memory_fraction`` of a
GPU's memory, gives up in this order: layers (down to one dense + one MoE layer), sequence
length (down to 2048), then width (d_model, expert hidden and the dense layer halved together).
Every variant of a stage uses the same scaled shape, so a ratio compares like with like; the
report prints each step the rule took next to the figure (``Scaled.notes``).

On CPUs the stages run a tiny shape of the same structure (it proves the plumbing, not speed).

Memory prediction: bytes per parameter of the resident layout (bf16 weights, bf16 + fp32
gradients, fp32 masters and AdamW moments, the latter two sharded by ZeRO-1) plus activations
per token and layer and the fp32 logits, plus a fixed workspace allowance. It is a planning
estimate with a safety margin, not a measurement; each stage reports the measured peak.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from moe.config import ModelConfig
from moe.config.presets import model_preset
from moe.train.accounting import param_counts
from pipeline.paper.hardware import Hardware

WORKSPACE_GB = 4.0
PAPER_MODEL = "paper-8l"
PAPER_SEQ = 8192


@dataclasses.dataclass
class Scaled:
    model: dict[str, Any]  # a full `model:` section
    seq_len: int
    micro_batch_size: int
    notes: list[str]

    def describe(self) -> str:
        m = self.model
        moe = m["moe"]
        shape = (f"d={m['d_model']} layers={m['n_layers']} E={moe['num_experts']} h={moe['expert_hidden']} "
                 f"k={moe['top_k']} seq={self.seq_len} micro={self.micro_batch_size}")
        return shape + ("; " + "; ".join(self.notes) if self.notes else "; the paper's shape")


def _expert_params(cfg: ModelConfig) -> int:
    moe_layers = sum(1 for i in range(cfg.n_layers) if cfg.is_moe_layer(i))
    return moe_layers * cfg.moe.num_experts * 3 * cfg.d_model * cfg.moe.expert_hidden


def predict_peak_gb(model: dict[str, Any], seq_len: int, micro: int, world: int, layout: dict[str, Any],
                    recompute: str = "none") -> float:
    """Predicted peak GPU memory (GB) of one rank of a training step (see the module docstring)."""
    cfg = ModelConfig.from_dict(model).validate()
    counts = param_counts(cfg)
    expert = _expert_params(cfg)
    dense = counts.total - expert
    ep = layout.get("ep", 1)
    if layout.get("data_parallel") == "fsdp":
        resident = (dense + expert) / world
        state = resident * (2 + 6 + 12)
        # one gathered layer (weights + gradients) at a time
        state += (dense + expert) / cfg.n_layers * 2 * 2
    else:
        resident = dense + expert / ep
        shard_dense = world if layout.get("shard_optimizer") else 1
        shard_expert = world // ep if layout.get("shard_optimizer") else 1
        state = resident * (2 + 6) + 12 * (dense / shard_dense + expert / ep / shard_expert)
    d, h, k, e = cfg.d_model, cfg.moe.expert_hidden, cfg.moe.top_k, cfg.moe.num_experts
    per_token_layer = 2 * (10 * d + k * (2 * d + 3 * h)) + 8 * e
    if recompute == "full":
        per_token_layer = 2 * d
    elif recompute != "none":
        per_token_layer -= 2 * k * 3 * h
    tokens = seq_len * micro
    act = tokens * (cfg.n_layers * per_token_layer + 10 * cfg.vocab_size)
    if recompute == "full":
        act += tokens * 2 * (10 * d + k * (2 * d + 3 * h))  # the one block being recomputed
    return (state + act) / 2**30 + WORKSPACE_GB


def _halve_width(model: dict[str, Any]) -> dict[str, Any]:
    m = {**model, "moe": {**model["moe"]}}
    m["d_model"] //= 2
    m["n_heads"] = max(1, m["n_heads"] // 2)
    m["moe"]["expert_hidden"] //= 2
    if m.get("dense_hidden"):
        m["dense_hidden"] //= 2
    return m


def paper_shape(hw: Hardware, num_experts: int, seq: int | None, micro: int | None,
                layouts: list[dict[str, Any]], memory_fraction: float, recompute: str = "none") -> Scaled:
    """The paper's model at ``num_experts`` experts, scaled so every layout in ``layouts`` fits."""
    if hw.kind == "cpu":
        model = {**model_preset("tiny"), "n_layers": 2, "max_seq_len": 64,
                 "moe": {**model_preset("tiny")["moe"], "num_experts": num_experts, "top_k": min(4, num_experts),
                         "expert_hidden": 64, "routing": "random"}}
        return Scaled(model, 64, micro or 2, ["CPU scale: a tiny model of the same structure (plumbing, not speed)"])
    model = model_preset(PAPER_MODEL)
    model["moe"] = {**model["moe"], "num_experts": num_experts, "routing": "random"}
    seq_len, micro = seq or PAPER_SEQ, micro or 1
    budget = hw.memory_gb * memory_fraction
    notes: list[str] = []

    def fits(m: dict[str, Any], s: int) -> bool:
        return all(predict_peak_gb(m, s, micro, hw.count, lay, recompute) <= budget for lay in layouts)

    width_halvings = 0
    seqs = [seq_len] + ([x for x in (4096, 2048) if x < seq_len] if seq is None else [])
    while True:
        for s in seqs:
            for layers in range(model["n_layers"], 1, -1):
                cand = {**model, "n_layers": layers, "max_seq_len": s}
                if fits(cand, s):
                    if layers < 8:
                        notes.append(f"layers 8 -> {layers} (memory)")
                    if s != seq_len:
                        notes.append(f"sequence {seq_len} -> {s} (memory)")
                    if width_halvings:
                        notes.append(f"width / {2 ** width_halvings} (d_model, expert hidden, dense hidden: memory)")
                    return Scaled(cand, s, micro, notes)
        if model["d_model"] <= 256:
            raise ValueError(f"the paper's model does not fit {hw.describe()} even at d_model {model['d_model']}")
        model = _halve_width(model)
        width_halvings += 1
