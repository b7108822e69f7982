"""The scaling rule: the paper's configuration, shrunk only as far as the hardware forces.

The paper's benchmark model is ``paper-8l`` (d_model 4096, 64 experts of hidden 4096, top-4,
sequence 8192, 8 layers, random routing). On the hardware at hand the rule keeps that and, only
while the largest variant of a stage is predicted not to fit in ``paper.memory_fraction`` of a
GPU's memory, gives up in this order: layers (down to one dense + one MoE layer), sequence
length (down to 2048), then width (d_model, expert hidden and the dense layer halved together).
Every variant of a stage uses the same scaled shape, so a ratio compares like with like; the
report prints each step the rule took next to the figure (``Scaled.notes``).

On CPUs the stages run a tiny shape of the same structure (it proves the plumbing, not speed).

The regime (issue 29), chosen by ``pipeline/paper/stages.py`` from ``paper:`` in params.yaml:
- Tokens per optimizer step: ``paper.tokens_per_step`` per GPU (262,144 by default), reached by
  accumulating micro-batches of the shape below (the micro-batch is what memory decides; the
  accumulation costs no memory). The paper does not state its benchmark batch; Olmo-core's
  OLMoE-1B-7B script steps on 1024 x 4096 tokens, and a step of one 8,192-token sequence per GPU
  would be dominated by the optimizer over every expert weight, which a real batch amortises.
- Routing: random, as the paper's system benchmarks; the stages in ``paper.learned_routing``
  (default: experts) add learned-routing rows, labelled as such.
- Dropless: no capacity bound anywhere; the dropped fraction is measured every run (routed
  slots no expert computed, ``moe.train.telemetry``) and printed beside each figure.
- Expert-weight gradients accumulate in bf16 and fold into fp32 once per step
  (``paper.expert_grad_accum``, as Olmo-core 3.0.0 ships) where the weights are bf16 over fp32
  masters; FSDP2's fp32 shards (amp_bf16) and CPU runs accumulate in fp32.
- Profile: each variant runs one more step under torch.profiler (``paper.profile``), outside
  the timed steps, so the report splits every claim's gap into measured parts.

Memory prediction: ``moe plan`` (moe/plan/): exact weight, master, gradient and
optimizer bytes of every rank from the model built on the meta device, calibrated activation
bytes per token and layer for the recompute mode, and a workspace allowance.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from moe.config.presets import model_preset
from pipeline.paper.hardware import Hardware

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
        shape = (
            f"d={m['d_model']} layers={m['n_layers']} E={moe['num_experts']} h={moe['expert_hidden']} "
            f"k={moe['top_k']} seq={self.seq_len} micro={self.micro_batch_size}"
        )
        return shape + ("; " + "; ".join(self.notes) if self.notes else "; the paper's shape")


def predict_peak_gib(model: dict[str, Any], seq_len: int, micro: int, world: int, layout: dict[str, Any], recompute: str = "none") -> float:
    """``moe plan``'s predicted peak (GiB) of the worst rank of one training step."""
    from moe.config import ExperimentConfig
    from moe.plan.planner import make_plan

    cfg = ExperimentConfig.from_dict(
        {
            "model": model,
            "data": {"seq_len": seq_len},
            "train": {"micro_batch_size": micro, "global_batch_size": micro * world, "recompute": recompute},
            "parallel": layout,
            "precision": {"recipe": "amp_bf16" if layout.get("data_parallel") == "fsdp" else "bf16"},
        }
    ).validate()
    # The peak does not depend on the GPU kind (only the capacity, which the caller compares).
    return make_plan(cfg, "h200", world, knobs=False).peak_gib


def _halve_width(model: dict[str, Any]) -> dict[str, Any]:
    m = {**model, "moe": {**model["moe"]}}
    m["d_model"] //= 2
    m["n_heads"] = max(1, m["n_heads"] // 2)
    m["moe"]["expert_hidden"] //= 2
    if m.get("dense_hidden"):
        m["dense_hidden"] //= 2
    return m


def paper_shape(
    hw: Hardware, num_experts: int, seq: int | None, micro: int | None, layouts: list[dict[str, Any]], memory_fraction: float, recompute: str = "none"
) -> Scaled:
    """The paper's model at ``num_experts`` experts, scaled so every layout in ``layouts`` fits."""
    if hw.kind == "cpu":
        model = {
            **model_preset("tiny"),
            "n_layers": 2,
            "max_seq_len": 64,
            "moe": {
                **model_preset("tiny")["moe"],
                "num_experts": num_experts,
                "top_k": min(4, num_experts),
                "expert_hidden": 64,
                "routing": "random",
            },
        }
        return Scaled(model, 64, micro or 2, ["CPU scale: a tiny model of the same structure (plumbing, not speed)"])
    model = model_preset(PAPER_MODEL)
    model["moe"] = {**model["moe"], "num_experts": num_experts, "routing": "random"}
    seq_len, micro = seq or PAPER_SEQ, micro or 1
    budget = hw.memory_gib * memory_fraction
    notes: list[str] = []

    def fits(m: dict[str, Any], s: int) -> bool:
        return all(predict_peak_gib(m, s, micro, hw.count, lay, recompute) <= budget for lay in layouts)

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
                        notes.append(f"width / {2**width_halvings} (d_model, expert hidden, dense hidden: memory)")
                    return Scaled(cand, s, micro, notes)
        if model["d_model"] <= 256:
            raise ValueError(f"the paper's model does not fit {hw.describe()} even at d_model {model['d_model']}")
        model = _halve_width(model)
        width_halvings += 1
