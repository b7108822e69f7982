"""The implementation switches (moe.switches): one table, read one way, a bad value refused by name."""

import ast
import importlib
import re
from pathlib import Path

import pytest

from moe import switches

LIBRARY = Path(__file__).resolve().parents[1] / "moe"


def _choice_calls(tree: ast.AST) -> set[str]:
    return {
        node.args[0].value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and getattr(node.func, "id", getattr(node.func, "attr", None)) == "choice"
        and node.args
        and isinstance(node.args[0], ast.Constant)
    }


def test_the_library_reads_moe_variables_only_through_the_switch_table():
    """Walk moe/: no module reads a MOE_ variable from the environment itself, and every switch
    is read, through choice(), in the module the table names (so a new switch inherits the check
    of its value and its place in every benchmark JSON)."""
    direct = re.compile(r"""(environ(\.get)?\s*[\[(]|getenv\s*\()\s*["']MOE_""")
    read_in: dict[str, set[str]] = {}
    for path in sorted(LIBRARY.rglob("*.py")):
        if path.name == "switches.py":
            continue
        text = path.read_text()
        assert not direct.search(text), f"{path.relative_to(LIBRARY.parent)} reads a MOE_ variable itself: declare it in moe/switches.py"
        module = ".".join(path.relative_to(LIBRARY.parent).with_suffix("").parts)
        for name in _choice_calls(ast.parse(text)):
            read_in.setdefault(name, set()).add(module)
    for name, switch in switches.SWITCHES.items():
        assert read_in.get(name) == {switch.acts_in}, f"{name}: read in {read_in.get(name)}, declared in {switch.acts_in}"
    assert set(read_in) <= set(switches.SWITCHES), set(read_in) - set(switches.SWITCHES)


def test_unset_switches_take_their_default(monkeypatch):
    for name, switch in switches.SWITCHES.items():
        monkeypatch.delenv(name, raising=False)
        assert switches.choice(name) == switch.values[0]


def test_a_value_not_declared_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("MOE_GRAD_ADD", "Triton")
    with pytest.raises(ValueError, match=r"MOE_GRAD_ADD='Triton': expected one of 'triton', 'torch'"):
        switches.choice("MOE_GRAD_ADD")
    with pytest.raises(ValueError, match="MOE_GRAD_ADD"):  # at import, before anything runs
        importlib.reload(importlib.import_module("moe.kernels.grad_add"))
    monkeypatch.delenv("MOE_GRAD_ADD")
    importlib.reload(importlib.import_module("moe.kernels.grad_add"))


def test_a_benchmark_records_the_switches_it_ran_with(monkeypatch):
    for name in switches.SWITCHES:
        monkeypatch.delenv(name, raising=False)
    assert switches.set_in_environment() is None
    monkeypatch.setenv("MOE_RESIDUAL_ADD", "separate")
    monkeypatch.setenv("MOE_WGRAD_KERNEL", "triton")
    assert switches.set_in_environment() == "MOE_WGRAD_KERNEL=triton MOE_RESIDUAL_ADD=separate"
