"""Text we emit into another format goes out through that format's escaper (pipeline/escape.py):
every function that writes a markdown document is listed here with the module that renders its
text, and that module imports the escapers; a new .md writer fails this test until it is listed
and its renderer escapes. The renderers' own tests feed every field hostile payloads (the cards:
tests/pipeline/test_model_card.py; the paper report: below). Error and log lines have their
own walk test (tests/test_error_lines.py); sbatch and shell values are checked at the config
(pipeline/params.py) and quoted by submitit."""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WRITERS = {"write_atomic", "write_output_file", "write_text", "write_bytes"}

# file::function writing a markdown document -> the module that renders its text
EMITTERS = {
    "pipeline/stages/release.py::run_release": "pipeline/model_card.py",
    "pipeline/stages/convert.py::convert_to_hf": "pipeline/model_card.py",
    "pipeline/paper/report.py::write_report": "pipeline/paper/report.py",
}


def _markdown_writes() -> set[str]:
    found = set()
    for path in sorted([*ROOT.glob("moe/**/*.py"), *ROOT.glob("pipeline/**/*.py")]):
        rel = path.relative_to(ROOT).as_posix()
        for func in ast.walk(ast.parse(path.read_text())):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(func):
                if isinstance(node, ast.Call):
                    name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                    target = ast.unparse(node.func.value) if name in ("write_text", "write_bytes") else ast.unparse(node.args[0]) if node.args else ""
                    if name in WRITERS and (".md'" in target or '.md"' in target):
                        found.add(f"{rel}::{func.name}")
    return found


def _imports_escapers(rel: str) -> bool:
    tree = ast.parse((ROOT / rel).read_text())
    return any(isinstance(n, ast.ImportFrom) and n.module == "pipeline.escape" for n in ast.walk(tree))


def test_every_markdown_writer_is_listed_and_its_renderer_escapes():
    found = _markdown_writes()
    assert found - set(EMITTERS) == set(), "markdown documents written without a listed renderer"
    assert set(EMITTERS) - found == set(), "stale entries"
    assert [r for r in set(EMITTERS.values()) if not _imports_escapers(r)] == []


PAYLOADS = ["x\n# Injected heading", "<img src=x onerror=alert(1)>", "a | b | c", "`code` *bold* [link](http://x)"]


def test_the_paper_report_shows_result_texts_as_text(tmp_path, monkeypatch):
    """Every text field of a stage result (hardware description, shape, variant notes) reaches
    REPORT.md escaped: no injected heading line, no live HTML, no extra table cell."""
    from pipeline.paper.report import write_report

    results = tmp_path / "results"
    shutil.copytree(ROOT / "bench/paper/h200x1/results", results)
    path = results / "fp8.json"
    r = json.loads(path.read_text())
    r["hardware"]["describe"] = r["hardware"]["name"] = " ".join(PAYLOADS)
    path.write_text(json.dumps(r))
    monkeypatch.chdir(tmp_path)  # the report goes inside the project it runs in
    report = write_report(results, tmp_path / "out").read_text()
    assert "<img" not in report
    assert not any(line.startswith("# Injected") for line in report.splitlines())
    row = next(line for line in report.splitlines() if line.startswith("|") and "onerror" in line)
    header = next(line for line in report.splitlines() if line.startswith("| claim"))
    assert row.replace("\\|", "").count("|") == header.count("|")  # the payload's bars are escaped, no cell added
