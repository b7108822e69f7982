"""dvc.yaml held against the stages' own declarations (each pipeline/stages/<name>.py's STAGE):
the command, the params sections, the data it reads, every path it writes, and code deps that
cover the stage module's whole import closure inside pipeline/ (read with ast, lazy imports too)."""

from __future__ import annotations

import ast
import importlib
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
