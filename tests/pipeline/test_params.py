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
