"""Text we emit into a terminal or a log goes out on one line: every ``error:`` line is made by
moe.errors.error_line (or the console's fail, which escapes the same way), and every log record
is made one line by the record factory (pipeline.redact.install_log_redaction), so a value
holding a line break or a bidi override (a file name, a key, a job name) cannot forge a line."""

from __future__ import annotations

import ast
import logging
from pathlib import Path

from moe.errors import error_line, one_line

ROOT = Path(__file__).resolve().parents[1]

# file::function -> why an `error:` text is made there by hand
ALLOWED = {
    "moe/errors.py::error_line": "the one maker of the line",
    "pipeline/console.py::<module>": "the message of a missing install, a constant naming a package",
    "pipeline/paper/cli.py::repro_cmd": "constant texts naming a fixed folder and a flag",
}


def _error_texts() -> dict[str, list[int]]:
    found: dict[str, list[int]] = {}
    for path in sorted([*ROOT.glob("moe/**/*.py"), *ROOT.glob("pipeline/**/*.py")]):
        rel = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text())
        owner = {}
        for func in ast.walk(tree):
            if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(func):
                    owner.setdefault(node, func.name)
        for node in ast.walk(tree):
            text = None
            if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
                text = node.values[0].value
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                text = node.value
            if isinstance(text, str) and text.startswith("error: "):
                found.setdefault(f"{rel}::{owner.get(node, '<module>')}", []).append(node.lineno)
    return {k: sorted(set(v)) for k, v in found.items()}


def test_every_error_line_is_made_by_error_line():
    unlisted = {k: v for k, v in _error_texts().items() if k not in ALLOWED}
    assert not unlisted, f"`error:` texts made by hand (use moe.errors.error_line): {unlisted}"


def test_a_value_cannot_forge_a_line():
    assert error_line("runs/a\nerror: forged\u202ename.txt") == "error: runs/a\\x0aerror: forged\\u202ename.txt"
    assert one_line("plain, é, 中, tab\there") == "plain, é, 中, tab\\x09here"
    text = "ok " * 1000
    assert one_line(text) is text  # the common case costs one check


def test_log_records_are_one_line(caplog):
    from pipeline.redact import install_log_redaction

    install_log_redaction()
    with caplog.at_level(logging.INFO, logger="moe.test"):
        logging.getLogger("moe.test").info("checkpoint %s written", "step_1\nERROR forged line")
    assert caplog.records[-1].getMessage() == "checkpoint step_1\\x0aERROR forged line written"
