"""dvc.yaml held against the stages' own declarations (each pipeline/stages/<name>.py's STAGE):
the command, the params sections, the data it reads, every path it writes, and code deps that
cover the stage module's whole import closure inside pipeline/ (read with ast, lazy imports too)."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
STAGE_MODULES = sorted(p.stem for p in (REPO / "pipeline/stages").glob("*.py") if p.stem != "__init__")
# Declaration only: it changes no stage's output, so it invalidates none.
NOT_CODE = {"pipeline/stage_spec.py"}


def _dvc_stages() -> dict:
    return yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]


def _module_file(name: str) -> Path | None:
    path = REPO / Path(*name.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imports(module: str, path: Path) -> set[str]:
    """The pipeline modules ``module`` imports (to the deepest one that exists)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")[: len(module.split(".")) - node.level + (path.name == "__init__.py")]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for name in names:
            while name and _module_file(name) is None:
                name = name.rpartition(".")[0]
            if name.split(".")[0] == "pipeline":
                found.add(name)
    return found


def import_closure(module: str) -> set[str]:
    """Every pipeline file ``module`` reaches through its imports, as repository paths."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(_imports(name, _module_file(name)))
    return {str(_module_file(m).relative_to(REPO)) for m in seen}


def _covered(path: str, code: tuple[str, ...]) -> bool:
    return any(path == c or path.startswith(c.rstrip("/") + "/") for c in code)


def _paths(entries: list) -> list[str]:
    return [next(iter(e)) if isinstance(e, dict) else e for e in entries or []]


def test_every_dvc_stage_has_its_module():
    assert sorted(_dvc_stages()) == STAGE_MODULES


@pytest.mark.parametrize("name", STAGE_MODULES)
def test_dvc_yaml_matches_the_declaration(name):
    stage = importlib.import_module(f"pipeline.stages.{name}").STAGE
    entry = _dvc_stages()[name]
    assert stage.name == name
    assert entry["cmd"] == stage.command
    assert entry["params"] == list(stage.params)
    assert entry["deps"] == [*stage.deps, *stage.code]
    written = [*_paths(entry.get("outs")), *_paths(entry.get("metrics")), *_paths(entry.get("plots"))]
    assert sorted(written) == sorted(o.path for o in stage.outputs)
    missing = sorted(p for p in import_closure(f"pipeline.stages.{name}") - NOT_CODE if not _covered(p, stage.code))
    assert not missing, f"{name}: code deps miss what the stage imports: {missing}"


def test_the_closure_follows_imports():
    closure = import_closure("pipeline.stages.train")
    assert {"pipeline/worker.py", "pipeline/plots.py", "pipeline/expert_load.py", "pipeline/outputs.py"} <= closure


def test_every_stage_is_a_command_made_from_its_module():
    """`moe <stage>` for every stage, in dvc.yaml's order, each the ``command`` of its module in
    pipeline/stage_commands; cli.py writes none of them."""
    from typer.main import get_command

    from pipeline.cli import app
    from pipeline.stage_commands import STAGE_COMMANDS

    names = [m.__name__.rpartition(".")[2] for m in STAGE_COMMANDS]
    assert names == list(_dvc_stages()) and sorted(names) == STAGE_MODULES
    commands = get_command(app).commands
    for module, name in zip(STAGE_COMMANDS, names, strict=True):
        assert inspect.unwrap(commands[name].callback) is module.command
    order = list(commands)
    assert [c for c in order if c in names] == names and order[order.index("train") + 1] == "submit"  # the Slurm commands follow train
    defined = {n.name for n in ast.walk(ast.parse((REPO / "pipeline/cli.py").read_text())) if isinstance(n, ast.FunctionDef)}
    assert not defined & set(names), "cli.py writes a stage's command itself"


def test_a_new_stage_module_becomes_a_command():
    """A stage module's ``command`` is all a new stage's command needs: its name, help, options
    and body; the one error policy comes with it."""
    import types

    import typer
    from typer.testing import CliRunner

    from pipeline.cli import add_stage_commands

    publish = types.ModuleType("pipeline.stage_commands.publish")  # a new stage's command module
    source = """
from __future__ import annotations
from pathlib import Path
from typing import Annotated
from pipeline.console import ParamsOpt, typer
from pipeline.errors import PipelineError

def command(params: ParamsOpt = Path("params.yaml"), hub: Annotated[str, typer.Option(help="where to")] = "hf") -> None:
    \"\"\"Publish the released model.\"\"\"
    if hub == "nowhere":
        raise PipelineError("hub: nowhere to publish")
    print(f"published {params} to {hub}")
"""
    exec(compile(source, "publish.py", "exec"), publish.__dict__)
    app = typer.Typer()
    app.callback()(lambda: None)
    add_stage_commands(app, [publish])
    runner = CliRunner()
    r = runner.invoke(app, ["publish", "--help"])
    assert r.exit_code == 0 and "Publish the released model." in r.output and "--hub" in r.output and "--params" in r.output
    r = runner.invoke(app, ["publish", "--hub", "there"])
    assert r.exit_code == 0 and "published params.yaml to there" in r.output
    r = runner.invoke(app, ["publish", "--hub", "nowhere"])
    assert r.exit_code == 2 and "error:" in r.output and "nowhere to publish" in r.output
