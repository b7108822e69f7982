"""What the paper claims, in numbers (``shared/docs/paper.md``), one entry per stage.

The report puts our figure next to each of these; nothing here is measured."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Claim:
    stage: str
    title: str
    paper: str  # the paper's figure, in its words
    paper_hardware: str
    # The paper's number(s) the report divides by, keyed like our derived figures.
    reference: dict[str, float]
    gpus: int = 8  # GPUs the paper measured this claim on (the projections' target)


CLAIMS: dict[str, Claim] = {
    c.stage: c
    for c in (
        Claim(
            "resident",
            "Resident experts (DDP + EP + ZeRO-1) against the FSDP2 baseline",
            "52,000 vs 19,400 tokens/s/GPU (about 2.7x), 47B-parameter MoE",
            "8x NVIDIA B300",
            {"speedup": 52000 / 19400},
        ),
        Claim(
            "experts",
            "Experts 8 -> 128 at constant active parameters (top-4)",
            "throughput drops < 5% from 8 to 128 experts (4.6B -> 47B total, ~3.2B active)",
            "NVIDIA B300",
            {"drop": 0.05},
        ),
        Claim(
            "fp8",
            "FP8 (MXFP8 on Blackwell, rowwise FP8 on Hopper) against BF16",
            "+21% throughput, peak memory 103 -> 95 GB with MXFP8",
            "4x NVIDIA B300",
            {"speedup": 1.21, "peak_ratio": 95 / 103},
            gpus=4,
        ),
        Claim(
            "recompute",
            "Activation recompute",
            "-2/3 activation memory, -1/4 peak memory, -1/5 throughput",
            "NVIDIA B300",
            {"activation_ratio": 1 / 3, "peak_ratio": 3 / 4, "throughput_ratio": 4 / 5},
        ),
        Claim(
            "ep",
            "Expert parallelism: NCCL all-to-all against NVSHMEM rowwise dispatch",
            "synchronisation-free rowwise EP on NVSHMEM (no host sync; drops tokens over a 1.1875-1.5 capacity)",
            "NVIDIA B300",
            {},
        ),
        Claim(
            "gerrymander",
            "Token gerrymandering: the balance loss against the measured expert load",
            "the load-balancing loss improved while the real per-expert load became less balanced",
            "NVIDIA B300",
            {},
        ),
    )
}

STAGES = tuple(CLAIMS)
