"""Every write, move or removal of a file in moe/ and pipeline/ goes through pipeline.outputs
(or moe's own checkpoint and token writers), or is listed here with the reason it is safe
(issue 37: "a test walks every module for writes that bypass it"). A new raw write fails this
test until it uses pipeline.outputs (write_output_file, write_atomic, open_for_write,
fresh_temp_dir, replace_own_output) or is added below with its reason."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
THE_WRITER = "pipeline/outputs.py"

# file::function -> why the raw write there is safe
ALLOWED = {
    # the torch-only library writes its own formats (it cannot import pipeline/)
    "moe/data/tokens.py::_write_json_atomic": "a token file's sidecar, through a temporary and a rename",
    "moe/data/tokens.py::write_token_file": "token files `moe tokenize` writes inside its own fresh temporary folder",
    "moe/train/checkpoint.py::_write": "checkpoint steps, built under a temporary name inside checkpoint.dir and renamed",
    "moe/train/checkpoint.py::_prepare_tmp": "this step's own temporary (.tmp-step_N) inside checkpoint.dir, made afresh",
    "moe/train/checkpoint.py::_write_atomic": "the checkpoint's `latest` pointer, temporary + rename",
    "moe/train/checkpoint.py::_prune": "older complete steps beyond keep_last, named by the step pattern, inside checkpoint.dir",
    "moe/train/checkpoint.py::clean_stale": "temporaries of interrupted saves (.tmp-step_*), inside checkpoint.dir",
    "moe/train/checkpoint.py::_guarded": "a half-written temporary of this save, after a failure",
    "moe/train/checkpoint.py::_fsync_dir": "opens a directory read-only to fsync it",
    "moe/reader.py::read_bytes": "opens a file read-only (O_RDONLY | O_NONBLOCK) to read it: the bounded reader",
    "moe/train/sinks.py::_open_for_append": "metrics.jsonl appended to with O_NOFOLLOW, after check_output_target refused a symlink or non-file",
    "moe/train/sinks.py::write_file_atomic": "metrics.jsonl on a resume, --summary-json: an O_EXCL temporary beside a checked target, renamed",
    "moe/parallel/spawn.py::_open_log": "rank logs at the paths the caller names (the local executor passes open_for_write instead)",
    "moe/parallel/spawn.py::_rank_main": "a failed rank's traceback, inside its group's own mkdtemp folder",
    "moe/parallel/spawn.py::_finish": "the group's own mkdtemp folder and torch's traceback files of its ranks, once read",
    # pipeline/
    "pipeline/run_lock.py::_take": "the run's .lock: O_NOFOLLOW | O_NONBLOCK, refused unless a plain file",
    "pipeline/resume.py::remove_own_checkpoints": "checkpoints proven ours (config hash and files checked) and stale",
    "pipeline/stages/train.py::prepare_run": "metrics.jsonl of a run directory the run-directory check read as ours",
    "pipeline/stages/convert.py::convert_to_hf": "files inside its own fresh_temp_dir, and that folder's removal on failure",
    "pipeline/stages/release.py::run_release": "independent copies into its own fresh_temp_dir, and that folder's removal on failure",
    "pipeline/stages/convert.py::_write_shards": "files inside convert's own fresh_temp_dir",
    "pipeline/stages/tokenize.py::run_tokenize": "removal of its own fresh_temp_dir on failure",
    "pipeline/paper/measure.py::fresh_run_dir": "a run directory with the paper marker whose every file read as a run's own",
    "pipeline/paper/report.py::save": "matplotlib into a BytesIO (then write_output_file)",
    "pipeline/plots.py::png_bytes": "matplotlib into a BytesIO (then write_output_file)",
    "pipeline/tracking/provenance.py::redacted_copy": "a masked copy inside a fresh mkdtemp folder",
}

WRITE_METHODS = {"write_text", "write_bytes", "savefig", "to_csv", "symlink_to", "hardlink_to", "touch", "unlink", "rmdir", "mkfifo"}
MODULE_WRITERS = {
    ("shutil", "copy"), ("shutil", "copy2"), ("shutil", "copyfile"), ("shutil", "copytree"), ("shutil", "move"), ("shutil", "rmtree"),
    ("os", "replace"), ("os", "rename"), ("os", "remove"), ("os", "unlink"), ("os", "rmdir"), ("os", "open"), ("os", "mkfifo"),
    ("torch", "save"), ("np", "save"), ("numpy", "save"), ("json", "dump"), ("pickle", "dump"), ("yaml", "dump"),
}  # fmt: skip


def _write_mode(call: ast.Call) -> bool:
    mode = call.args[1] if len(call.args) > 1 else next((k.value for k in call.keywords if k.arg == "mode"), None)
    return isinstance(mode, ast.Constant) and isinstance(mode.value, str) and any(c in mode.value for c in "wax+")


def _writes(call: ast.Call) -> str | None:
    fn = call.func
    if isinstance(fn, ast.Attribute):
        base = ast.unparse(fn.value)
        if (base, fn.attr) in MODULE_WRITERS:
            return f"{base}.{fn.attr}"
        if fn.attr in WRITE_METHODS:
            return fn.attr
        if fn.attr in ("open", "fdopen") and _write_mode(call):
            return "open for writing"
    elif isinstance(fn, ast.Name) and fn.id in ("open", "fdopen") and _write_mode(call):
        return "open for writing"
    return None


def write_sites() -> dict[str, list[str]]:
    """file::function -> the raw writes in it, for every module of moe/ and pipeline/."""
    sites: dict[str, list[str]] = {}
    for path in sorted([*ROOT.glob("moe/**/*.py"), *ROOT.glob("pipeline/**/*.py")]):
        rel = path.relative_to(ROOT).as_posix()
        if rel == THE_WRITER:
            continue
        tree = ast.parse(path.read_text())
        for func in ast.walk(tree):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            inner = {id(n) for f in ast.walk(func) if f is not func and isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in ast.walk(f)}
            for node in ast.walk(func):
                if isinstance(node, ast.Call) and id(node) not in inner and (what := _writes(node)):
                    sites.setdefault(f"{rel}::{func.name}", []).append(f"line {node.lineno}: {what}")
        module_level = [n for n in tree.body if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
        for stmt in module_level:
            for node in ast.walk(stmt):
                if isinstance(node, ast.Call) and (what := _writes(node)):
                    sites.setdefault(f"{rel}::<module>", []).append(f"line {node.lineno}: {what}")
    return sites


def test_every_write_goes_through_the_output_module_or_is_listed_with_its_reason():
    sites = write_sites()
    unlisted = {k: v for k, v in sites.items() if k not in ALLOWED}
    assert not unlisted, "writes that bypass pipeline.outputs (use it, or list the site with its reason):\n" + "\n".join(
        f"  {k}: {', '.join(v)}" for k, v in sorted(unlisted.items())
    )
    stale = sorted(set(ALLOWED) - set(sites))
    assert not stale, f"listed sites that no longer write (remove them from ALLOWED): {stale}"


def test_the_walk_finds_a_planted_bypass(tmp_path):
    tree = ast.parse("def f(p):\n    p.write_text('x')\n    open(p, 'w')\n    open(p)\n    shutil.rmtree(p)\n")
    found = [w for n in ast.walk(tree) if isinstance(n, ast.Call) and (w := _writes(n))]
    assert found == ["write_text", "open for writing", "shutil.rmtree"]
