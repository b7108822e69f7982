import pytest
import yaml

from moe.config import ConfigError
from tests.workspace import load


def test_loads_library_and_pipeline_sections(workspace):
    cfg = load(["model.moe.num_experts=8", "tokenize.workers=2"])
    assert cfg.model.moe.num_experts == 8 and cfg.tokenize.workers == 2
    assert cfg.experiment().model == cfg.model
    assert "mlflow.experiment" in cfg.flatten()


@pytest.mark.parametrize(
    "content, message",
    [
        ({"tokenise": {}}, "params.yaml: tokenise: unknown key (did you mean 'tokenize'?)"),
        ({"train": {"max_steps": "many"}}, "params.yaml: train.max_steps: expected an integer, got str 'many'"),
        ({"model": {"moe": {"top_k": 99}}}, "params.yaml: model.moe.top_k: top_k=99 is larger than num_experts=8"),
        ({"executor": {"kind": "slurmm"}}, "params.yaml: executor.kind: 'slurmm' is not one of"),
        ([1, 2], "params.yaml: expected a mapping of sections"),
    ],
)
def test_bad_params_name_file_and_key(workspace, content, message):
    (workspace / "params.yaml").write_text(yaml.safe_dump(content))
    with pytest.raises(ConfigError) as info:
        load()
    assert message in str(info.value)


def test_invalid_yaml_and_missing_file(workspace):
    (workspace / "params.yaml").write_text("train: [\n")
    with pytest.raises(ConfigError, match="params.yaml: line .* not valid YAML"):
        load()
    (workspace / "params.yaml").unlink()
    with pytest.raises(ConfigError, match="params.yaml: params file not found"):
        load()


def test_params_files_read_numbers_as_yaml_1_2():
    """No base 60 (`1:20` is not 80), no implicit octal (`012` is twelve), `1e-3` is a number
    (issue 37: YAML 1.1 read a schedule typo as a step count)."""
    from pipeline.params import parse_params_text

    got = parse_params_text("a: 1:20\nb: 012\nc: 0x1f\nd: 1e-3\ne: 1_000\nf: .inf\ng: -5\nh: true\n", "p.yaml")
    assert got == {"a": "1:20", "b": 12, "c": 31, "d": 0.001, "e": 1000, "f": float("inf"), "g": -5, "h": True}


@pytest.mark.parametrize(
    ("text", "said"),
    [("? [a, b]\n: 1\n", "a key must be a plain name"), ("{a: 1}: 2\n", "a key must be a plain name"), ("a: !!int 1:20\n", "not valid YAML")],
)
def test_a_complex_key_or_an_unreadable_tagged_number_is_one_error(text, said):
    from moe.config import ConfigError
    from pipeline.params import parse_params_text

    with pytest.raises(ConfigError, match=f"p.yaml: .*{said}"):
        parse_params_text(text, "p.yaml")


@pytest.mark.parametrize(
    ("override", "limit"), [("train.max_steps=9223372036854775808", "1000000000"), ("schedule.warmup_steps=10000000000", "1000000000")]
)
def test_numbers_no_run_means_are_refused_with_the_limit(workspace, override, limit):
    from moe.config import ConfigError
    from pipeline.params import load_params

    with pytest.raises(ConfigError, match=f"--set {override.split('=')[0]}: .*at most {limit}"):
        load_params("params.yaml", [override, "train.max_steps=1000"] if "warmup" in override else [override])


# Issue 50, item 3: every slurm.* and container.* value that reaches the sbatch script is checked
# in range and form, so `moe params`, `moe job` and `moe submit` refuse it naming the key.
SLURM_REFUSED = [
    ("slurm.cpus_per_task=-4", "slurm.cpus_per_task: must be between 1 and 4096, got -4"),
    ("slurm.mem=-5G", "slurm.mem: '-5G' must be a positive whole number of megabytes"),
    ("slurm.mem=0", "slurm.mem: '0' must be a positive"),
    ("slurm.mem=5 G", "slurm.mem: '5 G' must be"),
    ("slurm.time_min=1000000000000", "slurm.time_min: must be between 1 and 525600, got 1000000000000"),
    ("slurm.time_min=0", "slurm.time_min: must be between 1 and 525600"),
    ("slurm.nodes=0", "slurm.nodes: must be between 1"),
    ("slurm.tasks_per_node=100000", "slurm.tasks_per_node: must be between 1 and 1024"),
    ("slurm.gpus_per_node=-1", "slurm.gpus_per_node: must be between 0 and 64"),
    ("slurm.signal_delay_s=70000", "slurm.signal_delay_s: must be between 0 and 65535"),
    ("slurm.max_requeues=-1", "slurm.max_requeues: must be between 0"),
    ("slurm.poll_s=0", "slurm.poll_s: must be > 0"),
    ("slurm.job_name=ab\u202ecd", "slurm.job_name: 'ab\\u202ecd' contains U+202E (a format character"),
    ("slurm.job_name=a\u200bb", "slurm.job_name: 'a\\u200bb' contains U+200B"),
    ("slurm.job_name=a;b", "slurm.job_name: 'a;b' must be letters, digits and ._- (at most 64)"),
    ("slurm.job_name=" + "x" * 65, "slurm.job_name: '" + "x" * 65 + "' must be letters"),
    ("slurm.job_name=", "slurm.job_name: '' must be letters"),
    ("slurm.partition=gpu a", "slurm.partition: 'gpu a' must be names"),
    ("slurm.account=$(id)", "slurm.account: '$(id)' must be letters"),
    ("slurm.qos=h\u00e9", "slurm.qos: 'hé' must be letters"),
    ("slurm.constraint=a100;rm", "slurm.constraint: 'a100;rm' must be features"),
    ('slurm.extra_sbatch=["--comment=a b"]', "slurm.extra_sbatch: '--comment=a b' must be a long option"),
    ('slurm.extra_sbatch=["reservation=x"]', "slurm.extra_sbatch: 'reservation=x' must be a long option"),
    ('slurm.extra_sbatch=["--x=\u202e"]', "slurm.extra_sbatch[0]: '--x=\\u202e' contains U+202E"),
    ('slurm.setup=["echo \u202eok"]', "slurm.setup[0]: 'echo \\u202eok' contains U+202E"),
    ('slurm.setup=["echo a\u2028rm -rf x"]', "slurm.setup[0]: 'echo a\\u2028rm -rf x' contains U+2028 (a line separator)"),
    ("slurm.folder=runs/\u202eslurm", "slurm.folder: 'runs/\\u202eslurm' contains U+202E"),
    ("container.image=img\u202e.sif", "container.image: 'img\\u202e.sif' contains U+202E"),
    ('container.mounts=["/data:/data,/etc:/etc"]', "container.mounts: '/data:/data,/etc:/etc' must be one mount"),
    ("container.workdir=/w:/x", "container.workdir: '/w:/x' must not contain ',' or ':'"),
]


@pytest.mark.parametrize(("override", "said"), SLURM_REFUSED, ids=[o for o, _ in SLURM_REFUSED])
def test_slurm_and_container_values_are_refused_naming_the_key(workspace, override, said):
    with pytest.raises(ConfigError) as info:
        load([override])
    assert str(info.value).startswith(f"--set {said}"), str(info.value)


def test_slurm_values_of_real_clusters_are_accepted(workspace):
    cfg = load(
        [
            "slurm.mem=200G",
            "slurm.cpus_per_task=16",
            "slurm.time_min=2880",
            "slurm.partition=gpu,gpu-long",
            "slurm.account=proj_123",
            "slurm.qos=high",
            "slurm.constraint=a100&(ib|roce)",
            "slurm.job_name=moe-8l.v2",
            'slurm.extra_sbatch=["--reservation=big", "--mail-type=END", "--mail-user=me@example.org", "--requeue"]',
            'slurm.setup=["module load cuda/12.4", "export NCCL_DEBUG=WARN"]',
            'container.mounts=["/data:/data:ro"]',
        ]
    )
    assert cfg.slurm.mem == "200G" and cfg.slurm.constraint == "a100&(ib|roce)"


def test_unsafe_char_finds_controls_bidi_invisibles_and_separators():
    from pipeline.params import unsafe_char

    assert unsafe_char("plain/path-1.2_x é 中") is None
    for c in ("\n", "\t", "\x7f", "\x85", "\u202e", "\u2066", "\u200b", "\ufeff", "\u2028", "\u2029", "\ue000"):
        assert unsafe_char(f"a{c}b") == c, repr(c)


def test_params_checks_init_from_as_the_trainer_does(workspace):
    """Issue 50, item 5: `moe params` refuses an init_from the worker would refuse, with the
    trainer's own check (pipeline.params.check_init_from)."""
    from pipeline.params import check_init_from

    cfg = load(["checkpoint.init_from=/nonexistent"])
    with pytest.raises(ConfigError, match="^checkpoint.init_from: /nonexistent: no complete checkpoint found"):
        check_init_from(cfg.experiment())
    (workspace / "empty").mkdir()
    with pytest.raises(ConfigError, match="^checkpoint.init_from: empty: no complete checkpoint found"):
        check_init_from(load(["checkpoint.init_from=empty"]).experiment())
    check_init_from(load([]).experiment())  # none set: nothing to check
