"""The floors of the house (../shared/docs/architecture.md), read from the code's own imports:
no import circle, and no import from a lower floor to a higher one.

Every ``import`` statement counts, a lazy one inside a function too: it is a dependency all
the same. Packages: ``moe`` < ``pipeline``; ``bench`` stands beside ``pipeline`` (neither
imports the other). Inside ``moe`` the floors are, from the ground: config/data/kernels/errors/
hardware, nn/interop/eval, layers, model/precision/optim, parallel, plan, train. Inside
``pipeline``: the rest (helpers, executors, tracking, eval, the worker), stages, the paper's
pipeline, and the command lines on top (the stages' own among them, pipeline/stage_commands;
nothing below imports ``pipeline/cli.py``).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("moe", "pipeline", "bench")
MOE_FLOORS = [
    {"moe", "moe.config", "moe.data", "moe.kernels", "moe.errors", "moe.hardware"},
    {"moe.nn", "moe.interop", "moe.eval"},  # eval scores through a forward callable: it knows no model, no trainer
    {"moe.layers"},
    {"moe.model", "moe.precision", "moe.optim"},
    {"moe.parallel"},
    {"moe.plan"},  # the memory plan applies the real layouts to a meta model
    {"moe.train"},  # the loop and its side jobs (moe.train.callbacks, the in-loop evaluation among them)
]
# The pipeline's floors, from the ground (a module is on the highest floor one of its prefixes names).
PIPELINE_FLOORS = [
    {"pipeline"},  # helpers, executors, tracking, eval, the worker
    {"pipeline.stages"},
    {"pipeline.paper"},
    {
        "pipeline.cli",
        "pipeline.stage_commands",  # each stage's `moe` command, made a command by pipeline/cli.py
        "pipeline.slurm_cli",
        "pipeline.bench_cli",
        "pipeline.mlflow_cli",
        "pipeline.paper.cli",
        "pipeline.paper.__main__",
    },
]


def module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _resolve(current: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = current.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def dynamic_imports(call: ast.Call) -> list[str]:
    """``importlib.import_module("a.b")`` / ``import_module(f"a.{x}")`` / ``__import__("a")``: the
    module named, or the constant prefix of an f-string (an import all the same)."""
    fn = call.func
    name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
    if name not in ("import_module", "__import__") or not call.args:
        return []
    arg = call.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return [arg.value]
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        return [str(arg.values[0].value).rstrip(".")]
    return []


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (to the deepest module that exists)."""
    files = {module_name(p): p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(mod, path.name == "__init__.py", node)
                names = [f"{base}.{a.name}" for a in node.names] + [base]
            elif isinstance(node, ast.Call):
                names = dynamic_imports(node)
            for name in names:
                while name and name not in files:
                    name = name.rpartition(".")[0]
                if name and name != mod and name.split(".")[0] in PACKAGES:
                    targets.add(name)
        graph[mod] = targets
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _faces(graph: dict[str, set[str]]) -> set[str]:
    return {m for m in graph if (REPO / Path(*m.split("."))).is_dir()}


def test_no_import_circle():
    graph = import_graph()
    faces = _faces(graph)
    # A package face (__init__) re-exports its modules: an arrow to it stands for an arrow to them.
    found = [c for c in circles({m: t - faces for m, t in graph.items() if m not in faces})]
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def _floor(module: str) -> int | None:
    for i, floor in enumerate(MOE_FLOORS):
        for prefix in floor:
            if module == prefix or module.startswith(prefix + ".") and prefix != "moe":
                return i
    return 0 if module == "moe" else None


def _pipeline_floor(module: str) -> int:
    for i in reversed(range(len(PIPELINE_FLOORS))):
        if any(module == p or module.startswith(p + ".") for p in PIPELINE_FLOORS[i]):
            return i
    raise AssertionError(f"{module}: not in the pipeline package")


def test_no_import_runs_back_up():
    graph = import_graph()
    bad = []
    for mod, targets in graph.items():
        top = mod.split(".")[0]
        for t in targets:
            ttop = t.split(".")[0]
            if top == "moe" and ttop != "moe":
                bad.append(f"{mod} -> {t} (the library imports {ttop})")
            elif {top, ttop} == {"pipeline", "bench"}:
                bad.append(f"{mod} -> {t} (pipeline and bench stand beside each other)")
            elif top == ttop == "moe" and mod != "moe" and t != "moe":
                mf, tf = _floor(mod), _floor(t)
                if mf is not None and tf is not None and tf > mf:
                    bad.append(f"{mod} -> {t} (floor {mf} imports floor {tf})")
            elif top == ttop == "pipeline" and mod != "pipeline" and t != "pipeline":
                mf, tf = _pipeline_floor(mod), _pipeline_floor(t)
                if tf > mf:
                    bad.append(f"{mod} -> {t} (pipeline floor {mf} imports floor {tf})")
    assert not bad, "imports that run back up:\n" + "\n".join(sorted(bad))


def test_the_walk_sees_known_arrows():
    """The graph is read right: a few arrows that must be there."""
    graph = import_graph()
    assert "moe.config.base" in graph["moe.config.model"]
    assert "moe.model" in graph["moe.train.trainer"]
    assert any(t.startswith("moe.") for t in graph["pipeline.stages.train"])
    assert "pipeline.stage_commands" in graph["pipeline.cli"]
    assert "pipeline.stages.train" in graph["pipeline.stage_commands.train"]


def test_eval_stands_below_train():
    """moe/eval is a library the trainer's in-loop callback uses, never the other way round: its
    floor is below moe/train's, so test_no_import_runs_back_up refuses an arrow up to the trainer."""
    assert _floor("moe.eval.suite") < _floor("moe.train.callbacks.in_loop_eval")
    graph = import_graph()
    assert "moe.eval.suite" in graph["moe.train.callbacks.in_loop_eval"]
    assert not [t for m, ts in graph.items() if m.startswith("moe.eval") for t in ts if t.startswith("moe.train")]


def test_pipeline_floors_place_the_command_lines_on_top():
    assert [_pipeline_floor(m) for m in ("pipeline.outputs", "pipeline.executors.local", "pipeline.tracking.job", "pipeline.worker")] == [0] * 4
    assert _pipeline_floor("pipeline.stages.train") == 1 and _pipeline_floor("pipeline.paper.measure") == 2
    assert _pipeline_floor("pipeline.cli") == _pipeline_floor("pipeline.paper.cli") == _pipeline_floor("pipeline.stage_commands.train") == 3
    assert _pipeline_floor("pipeline.client") == 0  # a prefix counts at a dot only


def test_dynamic_imports_are_seen():
    tree = ast.parse("import importlib\nimportlib.import_module('bench.layer')\nimport_module(f'bench.{name}')\n__import__('moe.model')\n")
    found = [n for node in ast.walk(tree) if isinstance(node, ast.Call) for n in dynamic_imports(node)]
    assert found == ["bench.layer", "bench", "moe.model"]


def _folder(module: str) -> str:
    """A pipeline module's folder (pipeline.executors.slurm -> pipeline.executors); a top-level
    module stands for itself."""
    parts = module.split(".")
    return ".".join(parts[:2])


def test_no_folder_loop_in_pipeline():
    """No loop between a pipeline folder and the rest (e.g. executors <-> slurm_task, executors
    <-> run_dirs, when the job description lived in the executors): a folder is one node."""
    graph = import_graph()
    folders: dict[str, set[str]] = {}
    for mod, targets in graph.items():
        if mod.startswith("pipeline."):
            here = _folder(mod)
            folders.setdefault(here, set()).update(_folder(t) for t in targets if t.startswith("pipeline.") and _folder(t) != here)
    found = circles(folders)
    assert not found, "folder loops: " + "; ".join(" <-> ".join(c) for c in found)
