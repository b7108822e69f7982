"""``bench/paper/params.yaml``: the ``paper:`` section plus the pipeline sections it reuses.

The paper section says how to measure (steps, which variants); the reused sections say where
(``executor``, ``slurm``, ``container``), what to record into (``mlflow``) and which corpus
the learned-routing stage reads (``tokenize``). Library sections (model, train, ...) are not
read from this file: every stage builds its models from the paper's configuration and the
scaling rule (``pipeline/paper/scaling.py``), so nothing silently changes meaning.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

from moe.config import ConfigError, apply_overrides
from moe.config.base import Config, require
from pipeline.params import LIBRARY_SECTIONS, PipelineConfig, read_params_file


@dataclasses.dataclass
class PaperConfig(Config):
    # cpu: tiny shapes that prove the plumbing; gpu: the paper's shapes scaled to the GPUs at
    # hand; auto: gpu where the executor has GPUs, else cpu.
    scale: Literal["auto", "cpu", "gpu"] = "auto"
    # The GPU model when it cannot be detected here (Slurm jobs): h100 | h200 | b200 | b300.
    gpu: Literal["auto", "h100", "h200", "b200", "b300"] = "auto"
    # Steps per measurement: the first `steps` are warm-up, the next `steps` are timed.
    steps: int = 5
    # Sequences per micro-batch on each GPU (null: the scaling rule's choice).
    micro_batch_size: int | None = None
    # Sequence length (null: the paper's 8192 where it fits, else halved until it does).
    seq_len: int | None = None
    # Tokens per optimizer step on each GPU, reached by accumulating micro-batches (the paper's
    # benchmarks step on large batches: Olmo-core's OLMoE-1B-7B script on 1024 x 4096 tokens),
    # so work that grows with the parameter count (optimizer step, gradient folds) is paid once
    # per this many tokens, as there. On CPUs: two micro-batches (plumbing, not speed).
    tokens_per_step: int = 262144
    # Expert-weight gradients over micro-batches: bf16, folded into fp32 once per step (as
    # Olmo-core 3.0.0 ships), or fp32 every micro-batch (optim.expert_grad_accum).
    expert_grad_accum: Literal["fp32", "bf16"] = "bf16"
    # Stages that add learned-routing rows (labelled) next to the paper's random routing.
    learned_routing: list[str] = dataclasses.field(default_factory=lambda: ["experts"])
    # Every variant runs one more step under torch.profiler: where the time goes, per claim.
    profile: bool = True
    experts: list[int] = dataclasses.field(default_factory=lambda: [8, 32, 64, 128])
    recompute: list[str] = dataclasses.field(default_factory=lambda: ["none", "selective", "full"])
    # FP8 recipe to compare with bf16 (auto: mxfp8 on compute capability >= 10, else fp8_rowwise).
    fp8_recipe: str = "auto"
    ep_backends: list[str] = dataclasses.field(default_factory=lambda: ["nccl", "nvshmem"])
    # Learned-routing steps on the tokenised corpus for the gerrymandering stage.
    gerrymander_steps: int = 120
    # Fraction of GPU memory the scaling rule may plan for (the rest: fragmentation, workspaces).
    memory_fraction: float = 0.8
    results: str = "results"
    work_dir: str = "runs"

    def _check(self, p: str) -> None:
        require(self.steps >= 2, f"{p}.steps", "must be >= 2")
        require(self.gerrymander_steps >= 20, f"{p}.gerrymander_steps", "must be >= 20 (the alarm needs a window)")
        require(bool(self.experts) and all(e >= 2 for e in self.experts), f"{p}.experts", "must list expert counts >= 2")
        require(bool(self.recompute) and self.recompute[0] == "none", f"{p}.recompute", "must start with 'none' (the baseline)")
        require(bool(self.ep_backends), f"{p}.ep_backends", "must name at least one backend")
        require(0.2 <= self.memory_fraction <= 1.0, f"{p}.memory_fraction", "must lie in [0.2, 1]")
        require(self.tokens_per_step >= 1, f"{p}.tokens_per_step", f"must be >= 1, got {self.tokens_per_step}")
        timed = ("resident", "experts", "fp8", "recompute", "ep")
        stray = [s for s in self.learned_routing if s not in timed]
        require(not stray, f"{p}.learned_routing", f"unknown stage {stray[0] if stray else ''!r}; known: {', '.join(timed)}")
        if self.micro_batch_size is not None:
            require(self.micro_batch_size >= 1, f"{p}.micro_batch_size", "must be >= 1")
        if self.seq_len is not None:
            require(self.seq_len >= 16, f"{p}.seq_len", "must be >= 16")


@dataclasses.dataclass
class PaperParams:
    paper: PaperConfig
    base: PipelineConfig  # executor, slurm, container, mlflow, tokenize
    path: Path


def load_paper_params(path: str | Path = "params.yaml", overrides: list[str] | tuple[str, ...] = ()) -> PaperParams:
    path = Path(path)
    try:
        data = apply_overrides(read_params_file(path), overrides)
        stray = [s for s in LIBRARY_SECTIONS if s in data]
        if stray:
            raise ConfigError(f"{stray[0]}: not read here (the stages build their models from the paper's configuration; see paper.*)")
        paper = PaperConfig.from_dict(data.pop("paper", {}), "paper").validate("paper")
        base = PipelineConfig.from_dict(data).validate()
    except ConfigError as exc:
        text = str(exc)
        raise ConfigError(text if text.startswith(f"{path}:") else f"{path}: {text}") from None
    return PaperParams(paper, base, path)
