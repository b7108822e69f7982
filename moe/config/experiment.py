"""The root config of one training run: every section the library reads."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from moe.config.base import Config, ConfigError, _join, apply_overrides, deep_merge, require
from moe.config.model import ModelConfig
from moe.config.recipes import recipe
from moe.config.training import (
    CheckpointConfig,
    DataConfig,
    OptimizerConfig,
    ParallelConfig,
    PrecisionConfig,
    ScheduleConfig,
    TrainConfig,
)


@dataclasses.dataclass
class ExperimentConfig(Config):
    # A training recipe (moe.config.recipes: tiny, olmoe-1b-7b, paper-8l): the model preset,
    # optimizer, schedule, batch, sequence length and loss weights; explicit keys win.
    recipe: str | None = None
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    optim: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = dataclasses.field(default_factory=ScheduleConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    precision: PrecisionConfig = dataclasses.field(default_factory=PrecisionConfig)

    @classmethod
    def load(cls, data: Mapping[str, Any], overrides: Iterable[str] = ()) -> ExperimentConfig:
        """Build from params.yaml sections plus ``a.b=c`` overrides, and validate."""
        return cls.from_dict(apply_overrides(data, overrides)).validate()

    @classmethod
    def _expand(cls, data: dict[str, Any], prefix: str) -> dict[str, Any]:
        name = data.get("recipe")
        if name is None:
            return data
        return deep_merge(recipe(name, _join(prefix, "recipe")), data)

    def _check(self, p: str) -> None:
        m, moe, par, tr = self.model, self.model.moe, self.parallel, self.train
        require(
            moe.num_experts % par.ep == 0,
            "parallel.ep",
            f"model.moe.num_experts={moe.num_experts} is not divisible by parallel.ep={par.ep}",
        )
        require(
            m.n_layers % par.pp == 0,
            "parallel.pp",
            f"model.n_layers={m.n_layers} is not divisible by parallel.pp={par.pp}",
        )
        if par.pp > 1 and par.pp_schedule == "interleaved_1f1b":
            stages = par.pp * par.pp_virtual_stages
            require(
                m.n_layers % stages == 0,
                "parallel.pp_virtual_stages",
                f"model.n_layers={m.n_layers} is not divisible by pp * pp_virtual_stages = {stages}",
            )
        if par.data_parallel == "fsdp":
            require(
                par.pp == 1 and par.ep == 1 and not par.shard_optimizer,
                "parallel.data_parallel",
                "fsdp is the baseline layout; it takes pp=1, ep=1 and shard_optimizer=false",
            )
            require(
                par.grad_reduce_dtype == "fp32",
                "parallel.grad_reduce_dtype",
                "fsdp reduces its fp32 shards in fp32; bf16 applies to data_parallel=ddp only",
            )
        if self.precision.fp8_dense:
            # FSDP2 re-gathers weights into the same storage without a new version: the FP8
            # copies (keyed on the version) would go stale
            require(par.data_parallel != "fsdp", "precision.fp8_dense", "not with parallel.data_parallel=fsdp (use ddp)")
        if tr.eval_every and par.pp > 1:
            raise ConfigError("train.eval_every: in-loop evaluation runs with parallel.pp=1 (evaluate pipeline runs with `moe evaluate`)")
        if par.pp > 1:
            require(not m.tie_embeddings, "model.tie_embeddings", "tied embeddings cannot be split over pipeline stages (parallel.pp > 1)")
        require(
            tr.global_batch_size % tr.micro_batch_size == 0,
            "train.global_batch_size",
            f"{tr.global_batch_size} is not divisible by train.micro_batch_size={tr.micro_batch_size}",
        )
        require(
            self.data.seq_len <= m.max_seq_len,
            "data.seq_len",
            f"{self.data.seq_len} is longer than model.max_seq_len={m.max_seq_len}",
        )
        require(
            self.schedule.warmup_steps <= tr.max_steps,
            "schedule.warmup_steps",
            f"{self.schedule.warmup_steps} is longer than train.max_steps={tr.max_steps}",
        )

    def check_world(self, world_size: int) -> ResolvedLayout:
        """Validate the layout against a world size; return the resolved sizes."""
        par, tr = self.parallel, self.train
        if world_size % par.pp:
            raise ConfigError(f"parallel.pp: world size {world_size} is not divisible by pp={par.pp}")
        dp = world_size // par.pp
        if par.dp not in (-1, dp):
            raise ConfigError(f"parallel.dp: {par.dp} does not match world size {world_size} / pp={par.pp} = {dp}")
        if dp % par.ep:
            raise ConfigError(f"parallel.ep: data-parallel size {dp} (world {world_size} / pp {par.pp}) is not divisible by ep={par.ep}")
        per_step = tr.micro_batch_size * dp
        if tr.global_batch_size % per_step:
            raise ConfigError(
                f"train.global_batch_size: {tr.global_batch_size} is not divisible by "
                f"micro_batch_size * data-parallel size = {tr.micro_batch_size} * {dp}"
            )
        accum = tr.global_batch_size // per_step
        if par.pp > 1 and par.pp_schedule == "interleaved_1f1b" and accum % par.pp:
            raise ConfigError(
                f"parallel.pp_schedule: interleaved_1f1b needs the micro-batches per step ({accum} = global_batch_size / "
                f"(dp * micro_batch_size)) to be a multiple of pp={par.pp}"
            )
        return ResolvedLayout(world_size=world_size, pp=par.pp, dp=dp, ep=par.ep, grad_accum=accum)


@dataclasses.dataclass(frozen=True)
class ResolvedLayout:
    world_size: int
    pp: int
    dp: int
    ep: int
    grad_accum: int
