"""Every read of a file in moe/ and pipeline/ goes through the bounded reader (moe/reader.py:
regular files only, size-bounded, typed schema), or is listed here with the reason it is safe
(issue 50: "a walk test, like the writer's, fails on any json.load, yaml.safe_load, Arrow open
or open(...) for reading outside it"). A new raw read fails this test until it uses moe.reader
or is added below with its reason; entries marked PENDING are reads the migration has not
reached yet: the list may only shrink."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
THE_READER = "moe/reader.py"

# file::function -> why the raw read there is safe
ALLOWED: dict[str, str] = {
    "moe/config/base.py::parse_value": "a --set value's text from the command line, not a file",
    "moe/digest.py::sha256_file": "bytes hashed, never interpreted",
    "moe/parallel/spawn.py::tail": "a failed rank's log, in the group's own mkdtemp folder, shown as text",
    "moe/plan/activations.py::load_calibration": "the package's own calibration table (moe/plan/calibration.json)",
    "moe/plan/host.py::available_host_gib": "/proc/meminfo",
    "moe/train/checkpoint.py::_host_memory_available": "/proc/meminfo",
    "moe/train/checkpoint.py::load_plain": "torch.load(weights_only=True) of an RNG file whose sha256 meta.json vouches for",
    "moe/train/safe_dcp.py::read_metadata": "DCP's .metadata through the restricted unpickler, after its sha256 was checked",
    "pipeline/slurm_cli.py::logs": "a job's log, shown as text",
    "pipeline/containers.py::directory_image_digest": "bytes hashed, never interpreted",
    "pipeline/corpus.py::_jsonl_documents": "the tokenize stage's input text, each document bounded by tokenize.max_document_bytes",
    "pipeline/corpus.py::_parquet_documents": "the tokenize stage's input text (pyarrow's Parquet reader validates pages)",
    "pipeline/corpus.py::_read_whole_file": "the tokenize stage's input text, bounded by tokenize.max_document_bytes",
    "pipeline/escape.py::yaml_front_matter": "the YAML it has just dumped, parsed back as a round-trip check (not a file)",
    "pipeline/eval/tasks.py::<module>": "the package's own task table (pipeline/eval/task_table.json)",
    "pipeline/executors/local.py::last_error_line": "a job's log, shown as text",
    "pipeline/executors/slurm.py::_last_error": "a job's log, shown as text",
    "pipeline/executors/slurm.py::_tail": "a job's log, shown as text",
    "pipeline/paper/report.py::_is_matplotlib_png": "a file's first bytes compared with our PNG's, to recognise it",
    "pipeline/paper/report.py::_is_our_report": "a file's first bytes compared with our report's header, to recognise it",
    "pipeline/params.py::parse_params_text": "the params loader's own strict YAML (line numbers, duplicate keys; every key validated)",
    "pipeline/params.py::read_params_file": "the params file, size-checked, for the strict loader",
    "pipeline/plots.py::is_our_png": "a file's first bytes compared with our PNG's, to recognise it",
    "pipeline/redact.py::read_password": "a password file's first line, held in memory only",
    "pipeline/resume.py::_md5": "bytes hashed, never interpreted",
    "pipeline/run_dirs.py::_is_log_dir": "a worker log's first 16 bytes compared with LOG_HEADER, to recognise it",
    "pipeline/run_lock.py::_read_holder": "the run's .lock, opened O_NOFOLLOW | O_NONBLOCK and refused unless a plain file; 4 KiB at most",
    "pipeline/stages/convert.py::load_hf_weights": "safetensors (header parsed and bounded by the safetensors library; tensors only)",
    "pipeline/stages/convert.py::read_headers": "safetensors headers (parsed and bounded by the safetensors library)",
    "pipeline/tracking/provenance.py::pipeline_key": "bytes hashed, never interpreted",
}

READ_METHODS = {"read_text", "read_bytes"}
MODULE_READERS = {
    ("json", "load"), ("json", "loads"), ("yaml", "safe_load"), ("yaml", "load"), ("yaml", "full_load"),
    ("pq", "read_table"), ("pq", "ParquetFile"), ("pa.ipc", "open_stream"), ("pa.ipc", "open_file"), ("ipc", "open_stream"),
    ("ipc", "open_file"), ("pa", "memory_map"), ("torch", "load"), ("gzip", "open"), ("gzip", "decompress"), ("os", "pread"),
    ("np", "load"), ("numpy", "load"), ("np", "fromfile"), ("pickle", "load"), ("pickle", "loads"), ("Tokenizer", "from_file"),
}  # fmt: skip


def _read_mode(call: ast.Call) -> bool:
    mode = call.args[1] if len(call.args) > 1 else next((k.value for k in call.keywords if k.arg == "mode"), None)
    if mode is None:
        return True
    return isinstance(mode, ast.Constant) and isinstance(mode.value, str) and not any(c in mode.value for c in "wax+")


def _reads(call: ast.Call) -> str | None:
    fn = call.func
    if isinstance(fn, ast.Attribute):
        base = ast.unparse(fn.value)
        if (base, fn.attr) in MODULE_READERS:
            return f"{base}.{fn.attr}"
        if fn.attr in READ_METHODS:
            return fn.attr
        if fn.attr == "open" and base not in ("os",) and _read_mode(call):
            return "open for reading"
    elif isinstance(fn, ast.Name) and fn.id in ("open", "safe_open") and _read_mode(call):
        return f"{fn.id} for reading"
    return None


def read_sites() -> dict[str, list[str]]:
    """file::function -> the raw reads in it, for every module of moe/ and pipeline/."""
    sites: dict[str, list[str]] = {}
    for path in sorted([*ROOT.glob("moe/**/*.py"), *ROOT.glob("pipeline/**/*.py")]):
        rel = path.relative_to(ROOT).as_posix()
        if rel == THE_READER:
            continue
        tree = ast.parse(path.read_text())
        for func in ast.walk(tree):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module)):
                continue
            name = getattr(func, "name", "<module>")
            body = func.body if isinstance(func, ast.Module) else [func]
            for node in (n for b in body for n in ast.walk(b)):
                if isinstance(node, ast.Call) and (what := _reads(node)):
                    if isinstance(func, ast.Module) and _inside_function(tree, node):
                        continue
                    sites.setdefault(f"{rel}::{name}", []).append(f"line {node.lineno}: {what}")
    return sites


def _inside_function(tree: ast.Module, target: ast.AST) -> bool:
    return any(target in set(ast.walk(f)) for f in tree.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))


def test_every_read_goes_through_the_reader_or_is_listed():
    unlisted = {site: what for site, what in read_sites().items() if site not in ALLOWED}
    assert not unlisted, "raw reads outside moe/reader.py (use it, or list the site with its reason):\n" + "\n".join(
        f"{s}: {', '.join(w)}" for s, w in sorted(unlisted.items())
    )


def test_the_allow_list_has_no_stale_entries():
    stale = sorted(set(ALLOWED) - set(read_sites()))
    assert not stale, f"listed sites that no longer read raw (remove them): {stale}"


MAX_PENDING = 0  # lower it as sites move to moe.reader; it may never rise


def test_the_pending_migrations_only_shrink():
    pending = sorted(k for k, why in ALLOWED.items() if why.startswith("PENDING"))
    assert len(pending) <= MAX_PENDING, f"{len(pending)} reads pending migration, more than {MAX_PENDING}: a new raw read must use moe.reader"
