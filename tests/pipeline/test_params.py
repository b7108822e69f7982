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
