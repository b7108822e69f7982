"""Hostile inputs of the tokenise stage (issue 25): giant documents, gzip bombs, text that is not
Unicode, and tokenizers that panic, backtrack for hours, or lose a worker to SIGKILL.

Rows carry the audit's item numbers (test_hostile_audit.py): 8 = resources (one document too
large: a giant line, a giant file, a gzip bomb), 12 = the encoding itself (text that is not
Unicode; a tokenizer that panics or stalls; a dead or orphaned encoding process).
"""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.pipeline.hostile import REPO, Case, params_for, run_case

TOKENIZE = ["tokenize", "--no-mlflow"]
CORPUS_DOCS = 60  # tests/pipeline/conftest.py's write_corpus
BOMB_MIB = 512  # decompressed size of the gzip bomb's one line


def sets(*pairs: str) -> list[str]:
    return [arg for pair in pairs for arg in ("--set", pair)]


def manifest(ws: Path) -> dict:
    return json.loads((ws / "data/tokens/manifest.json").read_text())


def documents(m: dict) -> int:
    return m["splits"]["train"]["documents"] + m["splits"]["val"]["documents"]


def write_jsonl(path: Path, texts: list[str]) -> None:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))


# ------------------------------------------------------------------ 8: one document too large


def _giant_jsonl_line(ws):
    write_jsonl(ws / "corpus/giant.jsonl", ["a fine first document", "x" * 1_000_000, "a fine third document"])


def _giant_line_skipped(ws, result):
    m = manifest(ws)
    sources = [d["source"] for d in m.get("skipped_documents", [])]
    ok = sources == ["corpus/giant.jsonl:2"] and documents(m) == CORPUS_DOCS + 2 and "skipped 1 document(s)" in result.output
    return None if ok else "silent"


def _giant_txt(ws):
    """One line of 9 MiB of words: over the default bound (8 MiB), without any --set."""
    line = ("the router sends each token to a few experts " * 200_000)[: 9 << 20]
    (ws / "corpus/giant.txt").write_text(line)


def _giant_txt_skipped(ws, result):
    m = manifest(ws)
    ok = [d["source"] for d in m.get("skipped_documents", [])] == ["corpus/giant.txt"] and documents(m) == CORPUS_DOCS
    return None if ok and "max_document_bytes" in result.output else "silent"


def _write_gzip_bomb(path: Path, mib: int, then: list[str]) -> None:
    """A .jsonl.gz whose first line inflates to ``mib`` MiB: concatenated gzip members (one
    compressed MiB of "a" repeated), so writing it costs nothing."""
    block = gzip.compress(b"a" * (1 << 20), compresslevel=9)
    with open(path, "wb") as f:
        f.write(gzip.compress(b'{"text": "'))
        for _ in range(mib):
            f.write(block)
        f.write(gzip.compress(b'"}\n' + "".join(json.dumps({"text": t}) + "\n" for t in then).encode()))


_MEASURED_TOKENIZE = """
import json, resource, sys, time
from pipeline.params import load_params
from pipeline.stages.tokenize import run_tokenize

started = time.monotonic()
m = run_tokenize(load_params("params.yaml").tokenize)
# This process's own peak is VmHWM: its ru_maxrss would count the parent's (pytest's) RSS before
# exec. A worker's ru_maxrss counts at most this process's RSS at its fork, so the max is exact.
own_kib = int(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM:")))
peak_kib = max(own_kib, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
print(json.dumps({"seconds": time.monotonic() - started, "peak_mib": peak_kib / 1024, "manifest": m}))
"""


def _gzip_bomb_bounded(ws):
    """A real bomb (512 MiB in one line, 0.5 MB on disk), default bound: skipped, the documents
    after it kept, in seconds, the peak memory of every process far below the line's size."""
    _write_gzip_bomb(ws / "corpus/bomb.jsonl.gz", BOMB_MIB, [f"document {i} after the bomb" for i in range(5)])
    r = subprocess.run([sys.executable, "-c", _MEASURED_TOKENIZE], cwd=ws, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert [d["source"] for d in out["manifest"]["skipped_documents"]] == ["corpus/bomb.jsonl.gz:1"], out["manifest"]
    assert documents(out["manifest"]) == CORPUS_DOCS + 5
    # holding the line would take its size at least (and its decoded copies several times it);
    # the main process's own ~250-300 MiB (torch) is the floor of what is measured
    assert out["peak_mib"] < BOMB_MIB, f"peak RSS {out['peak_mib']:.0f} MiB for a {BOMB_MIB} MiB line"
    assert out["seconds"] < 60, f"took {out['seconds']:.0f}s"
    assert "skipped 1 document(s)" in r.stderr


# ------------------------------------------------------------------ 12: not Unicode


def _lone_surrogates(ws):
    # written as JSON escapes: the file is valid UTF-8, the decoded strings are not Unicode
    (ws / "corpus/surrogates.jsonl").write_text('{"text": "abc \\ud800 def"}\n{"text": "ghi \\udfff jkl \\ud83d"}\n')


def _surrogates_kept(ws, result):
    m = manifest(ws)
    return None if documents(m) == CORPUS_DOCS + 2 and m.get("skipped_documents") == [] else "silent"


# ------------------------------------------------------------------ 12: hostile tokenizers, dead workers


def _redos_tokenizer(ws) -> None:
    """The workspace's tokenizer with a pre-tokenizer regex that backtracks exponentially:
    "(a+)+$" on a run of n "a"s not at the end costs 2^n steps. Oniguruma stops one match
    after 10^7 steps and tokenizers panics (n >= 24); under that limit (n = 21: ~0.08 s per
    run) a document of 5000 runs takes ~7 minutes."""
    tok = json.loads((ws / "data/tokens/tokenizer.json").read_text())
    split = {"type": "Split", "pattern": {"Regex": "(a+)+$"}, "behavior": "Isolated", "invert": False}
    tok["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [split, tok["pre_tokenizer"]]}
    (ws / "redos.json").write_text(json.dumps(tok))


def _panicking_tokenizer(ws):
    _redos_tokenizer(ws)
    write_jsonl(ws / "corpus/aaa.jsonl", ["a" * 40 + "b", "a short one"])


def _stalling_tokenizer(ws):
    _redos_tokenizer(ws)
    write_jsonl(ws / "corpus/slow.jsonl", [("a" * 21 + "b") * 5000, "a short one"])


def _workers_in(ws: Path) -> list[int]:
    """Encoding processes (spawned multiprocessing children) running in the workspace."""
    pids, here = [], ws.resolve()
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and b"spawn_main" in (proc / "cmdline").read_bytes() and Path(os.readlink(proc / "cwd")) == here:
                pids.append(int(proc.name))
        except OSError:  # gone, or not ours to read
            continue
    return pids


def _no_leftovers(ws: Path) -> str | None:
    """No temporary output directory, no encoding process left (given a moment to be reaped)."""
    if list((ws / "data").glob(".tokens.tmp-*")):
        return "lost"
    deadline = time.monotonic() + 5
    while _workers_in(ws) and time.monotonic() < deadline:
        time.sleep(0.1)
    return "hang" if _workers_in(ws) else None


def _error_says(*words: str):
    def check(ws, result):
        last = result.output.strip().splitlines()[-1]
        return _no_leftovers(ws) or (None if all(w in last for w in words) else "silent")

    return check


_killed: list[int] = []


def _kill_a_worker_once_started(ws):
    """SIGKILL the first encoding process that appears (the command is started after setup)."""
    _stalling_tokenizer(ws)
    _killed.clear()

    def watch():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if pids := _workers_in(ws):
                time.sleep(0.5)  # let it take a job
                os.kill(pids[0], signal.SIGKILL)
                _killed.append(pids[0])
                return
            time.sleep(0.05)

    threading.Thread(target=watch, daemon=True).start()


def _worker_death_reported(ws, result):
    if not _killed:
        return "silent"
    return _error_says("encoding process died", "corpus/slow.jsonl")(ws, result)


def _stage_killed_takes_workers_along(ws):
    """SIGKILL of `moe tokenize` itself: its encoding processes notice and exit on their own."""
    _stalling_tokenizer(ws)
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "pipeline.cli", *TOKENIZE, *sets("tokenize.tokenizer=redos.json")]
    stage = subprocess.Popen(cmd, cwd=ws, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while not (workers := _workers_in(ws)) and stage.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert workers, "no encoding process started"
        time.sleep(0.5)
    finally:
        stage.kill()
        stage.wait()
    try:
        deadline = time.monotonic() + 5
        while _workers_in(ws) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _workers_in(ws), f"encoding processes {_workers_in(ws)} outlived the killed stage"
    finally:
        for pid in set(workers) & set(_workers_in(ws)):  # the ones this case started, by id
            os.kill(pid, signal.SIGKILL)


CASES = [
    # 8: one document bounds memory and the tokenizer's work, not only the total
    Case(
        "jsonl-line-over-max-document-bytes",
        8,
        TOKENIZE + sets("tokenize.max_document_bytes=100000"),
        setup=_giant_jsonl_line,
        expect="ok",
        check=_giant_line_skipped,
        subprocess=True,
    ),
    Case("txt-one-line-over-default-bound", 8, TOKENIZE, setup=_giant_txt, expect="ok", check=_giant_txt_skipped, subprocess=True),
    Case("jsonl-gz-bomb-bounded-memory", 8, call=_gzip_bomb_bounded, expect="ok"),
    # 12: text that is not Unicode gets U+FFFD, as undecodable bytes in a .txt do
    Case("jsonl-lone-surrogates", 12, TOKENIZE, setup=_lone_surrogates, expect="ok", check=_surrogates_kept),
    # 12: the tokenizer runs in worker processes; their death or stall ends the stage clearly
    Case(
        "tokenizer-panics-in-worker",
        12,
        TOKENIZE + sets("tokenize.tokenizer=redos.json"),
        setup=_panicking_tokenizer,
        check=_error_says("the tokenizer failed", "corpus/aaa.jsonl"),
        subprocess=True,
        timeout=120,
    ),
    Case(
        "tokenizer-backtracks-past-stall-timeout",
        12,
        TOKENIZE + sets("tokenize.tokenizer=redos.json", "tokenize.stall_timeout_s=3"),
        setup=_stalling_tokenizer,
        check=_error_says("no document encoded for 3s", "corpus/slow.jsonl"),
        subprocess=True,
        timeout=120,
    ),
    Case(
        "worker-sigkilled",
        12,
        TOKENIZE + sets("tokenize.tokenizer=redos.json", "tokenize.workers=2"),
        setup=_kill_a_worker_once_started,
        check=_worker_death_reported,
        subprocess=True,
        timeout=120,
    ),
    Case("stage-sigkilled-workers-exit", 12, call=_stage_killed_takes_workers_along, expect="ok"),
]


@pytest.mark.parametrize("case", params_for(CASES))
def test_hostile_tokenize(case: Case, ws, monkeypatch):
    run_case("issue 25: tokenize", case, ws, monkeypatch)
