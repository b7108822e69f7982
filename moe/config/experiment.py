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
        if par.interleaved:
            stages = par.pp * par.virtual_stages
            require(
                m.n_layers % stages == 0,
                "parallel.pp_virtual_stages",
                f"model.n_layers={m.n_layers} is not divisible by pp * pp_virtual_stages = {stages}",
            )
        self._check_fsdp()
        if tr.layout_invariant:
            self._check_layout_invariant()
        if tr.cuda_graph:
            self._check_cuda_graph()
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

    def _check_layout_invariant(self) -> None:
        """What train.layout_invariant cannot make layout-independent, refused by name."""
        par, moe, key = self.parallel, self.model.moe, "train.layout_invariant"
        conflicts = [
            # an expert's GEMMs run on the rows of several ranks' micro-batches at once
            (par.ep > 1, f"not with parallel.ep={par.ep} (expert GEMMs mix the micro-batches of {par.ep} ranks; use ep=1)"),
            (par.pp > 1, f"not with parallel.pp={par.pp} (pipeline parallelism; use pp=1)"),
            (par.overlap_grad_reduce, "not with parallel.overlap_grad_reduce (integer sums are reduced after the backward)"),
            (par.grad_reduce_dtype != "fp32", f"not with parallel.grad_reduce_dtype={par.grad_reduce_dtype} (gradients travel as int64)"),
            (self.optim.expert_grad_accum != "fp32", "not with optim.expert_grad_accum=bf16 (a bf16 sum over a rank's micro-batches)"),
            (self.optim.expert_wgrad == "paired", "not with optim.expert_wgrad=paired (a sum over two micro-batches before it is counted)"),
            # its token counts are summed over the micro-batches the ranks run at once: the layout's
            (moe.lb_loss_scope != "micro_batch", f"not with model.moe.lb_loss_scope={moe.lb_loss_scope} (use micro_batch)"),
        ]
        for conflict, message in conflicts:
            require(not conflict, key, message)

    def _check_cuda_graph(self) -> None:
        """What train.cuda_graph has not been run with, refused by name."""
        tr, par, key = self.train, self.parallel, "train.cuda_graph"
        conflicts = [
            (tr.device == "cpu", "needs a CUDA GPU (train.device=cpu)"),
            (
                self.precision.recipe not in ("auto", "bf16", "fp8_rowwise"),
                f"runs with precision.recipe bf16 or fp8_rowwise (or auto), not {self.precision.recipe}",
            ),
            (tr.recompute != "none", f"not with train.recompute={tr.recompute} (use none)"),
            (self.optim.step_kernel != "triton", "needs optim.step_kernel=triton (the step that reads its learning rate on the device)"),
            (tr.layout_invariant, "not with train.layout_invariant (its micro-batches are seeded from the host)"),
            (par.pp > 1 or par.ep > 1 or par.dp not in (-1, 1), "runs on one GPU (parallel.pp, ep and dp of 1)"),
            (par.data_parallel == "fsdp", "not with parallel.data_parallel=fsdp (one GPU, ddp)"),
        ]
        for conflict, message in conflicts:
            require(not conflict, key, message)

    def _check_fsdp(self) -> None:
        """The FSDP baseline's shape: validate() and resolve() both refuse what it cannot run
        (resolve() for a config that was built or changed without validate())."""
        par = self.parallel
        if par.data_parallel != "fsdp":
            return
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

    def resolve(self, world_size: int) -> ResolvedLayout:
        """The layout on ``world_size`` processes, checked against it: call it once per run and
        hand the result on (a training job carries it; the layouts and the planner take it)."""
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
        if par.interleaved and accum % par.pp:
            raise ConfigError(
                f"parallel.pp_schedule: interleaved_1f1b needs the micro-batches per step ({accum} = global_batch_size / "
                f"(dp * micro_batch_size)) to be a multiple of pp={par.pp}"
            )
        self._check_fsdp()
        if par.data_parallel == "fsdp" and tr.loss_chunk_tokens:
            raise ConfigError("train.loss_chunk_tokens: the chunked loss runs with parallel.data_parallel=ddp only (set it to 0 for fsdp)")
        return ResolvedLayout(
            world_size=world_size,
            pp=par.pp,
            dp=dp,
            ep=par.ep,
            grad_accum=accum,
            virtual_stages=par.virtual_stages,
            data_parallel=par.data_parallel,
        )


@dataclasses.dataclass(frozen=True)
class ResolvedLayout:
    """A config's layout on one world size (ExperimentConfig.resolve): what every rank builds.
    Plain data, so it travels in a training job (``to_dict``/``from_dict``)."""

    world_size: int
    pp: int
    dp: int
    ep: int
    grad_accum: int  # micro-batches per step: global_batch_size / (dp * micro_batch_size)
    virtual_stages: int = 1  # pipeline stages on every rank (interleaved_1f1b: pp_virtual_stages)
    data_parallel: str = "ddp"  # ddp (the paper's layout) or fsdp (the baseline)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "layout") -> ResolvedLayout:
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)} (expected {', '.join(fields)})")
        missing = [n for n, f in fields.items() if n not in data and f.default is dataclasses.MISSING]
        if missing:
            raise ConfigError(f"{where}: missing {', '.join(missing)}")
        for name, value in data.items():
            kind = str if name == "data_parallel" else int
            if type(value) is not kind:
                raise ConfigError(f"{where}.{name}: expected {kind.__name__}, got {value!r}")
        return cls(**data)

    def check_master_weights(self, master_weights: bool) -> None:
        """FSDP keeps fp32 shards: a recipe with fp32 master weights (bf16 on a GPU) is refused."""
        if self.data_parallel == "fsdp" and master_weights:
            raise ConfigError("parallel.data_parallel=fsdp: use precision.recipe fp32 or amp_bf16 (FSDP keeps fp32 shards)")
