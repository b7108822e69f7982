"""Tokenise stage: raw text -> OLMo-core token files (train/ and val/), tokenizer and manifest.

Deterministic: the same inputs and params give byte-identical outputs, whatever the number of
workers (documents keep the order of the input plan; shard boundaries depend only on it).
The output directory is built under a temporary name and renamed into place at the end.

Encoding always runs in worker processes (even with one worker), so that the tokenizer, which
may be the user's, can never take the stage down with it: a worker that dies (killed, or a
Rust abort) or stalls (a backtracking pre-tokenizer regex) ends the stage with one error naming
the files in flight, its processes killed and the temporary directory removed.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import multiprocessing as mp
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import numpy as np

from moe.reader import FileFormatError, read_json
from pipeline.corpus import Document, Source, is_text_source, is_validation, read_documents, resolve_sources
from pipeline.errors import PipelineError
from pipeline.outputs import (
    MANIFEST_FORMAT,
    MANIFEST_SCHEMA,
    MAX_MANIFEST_BYTES,
    check_own_output,
    fresh_temp_dir,
    replace_own_output,
    seal_output,
    write_atomic,
)
from pipeline.params import TokenizeConfig
from pipeline.stage_spec import Output, Stage
from pipeline.tokenizer import TokenizerInfo, describe, load_tokenizer, train_bpe

SPLITS = ("train", "val")
# Documents are encoded in batches of about this many characters: bounded memory per call
# (the tokenizers library needs ~200 bytes per character) and a heartbeat after each batch.
BATCH_CHARS = 1 << 20
log = logging.getLogger("pipeline.tokenize")

# The manifest's params: what determines the content (not the workers, the stall deadline or the
# output path). Its schema: pipeline.outputs.MANIFEST_SCHEMA (the card reads it too).
NOT_CONTENT_PARAMS = ("workers", "stall_timeout_s", "output")


@dataclasses.dataclass(frozen=True)
class PlanItem:
    source: Source
    docs: int  # how many of the source's documents are included
    val: tuple[bool, ...]  # split of each included document


@dataclasses.dataclass
class Skipped:
    """Inputs the plan passed over, reported once (a warning line each kind) and in the manifest."""

    files: list[str] = dataclasses.field(default_factory=list)  # not UTF-8 text
    documents: list[dict[str, str]] = dataclasses.field(default_factory=list)  # {source, reason}

    def document(self, where: str, reason: str) -> None:
        self.documents.append({"source": where, "reason": reason})

    def warn(self, cfg: TokenizeConfig) -> None:
        if self.files:
            log.warning(
                "tokenize.inputs: skipped %d file(s) that are not UTF-8 text (binary or another encoding): %s",
                len(self.files),
                _first_few(self.files),
            )
        if self.documents:
            log.warning(
                "tokenize.inputs: skipped %d document(s) over tokenize.max_document_bytes (%d bytes): %s",
                len(self.documents),
                cfg.max_document_bytes,
                _first_few([d["source"] for d in self.documents]),
            )


def _first_few(names: list[str], n: int = 5) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def plan_documents(cfg: TokenizeConfig, skipped: Skipped | None = None) -> list[PlanItem]:
    """Which documents go in, and to which split (one pass over the inputs); inputs that are
    not text, and documents over the size bound, are recorded in ``skipped`` and reported."""
    plan: list[PlanItem] = []
    total = 0
    skipped = Skipped() if skipped is None else skipped
    for source in resolve_sources(cfg.inputs):
        flags = []
        if not is_text_source(source, cfg.max_document_bytes):
            skipped.files.append(str(source.path))
            continue
        for doc in read_documents(source, cfg.text_field, cfg.max_document_bytes, skipped.document):
            flags.append(is_validation(doc.key, cfg.seed, cfg.val_fraction))
            total += len(doc.text.encode("utf-8", errors="replace"))
            if cfg.max_bytes is not None and total >= cfg.max_bytes:
                break  # before reading on: what lies beyond the budget is neither read nor reported
        if flags:
            plan.append(PlanItem(source, len(flags), tuple(flags)))
        if cfg.max_bytes is not None and total >= cfg.max_bytes:
            break
    skipped.warn(cfg)
    n_docs = sum(p.docs for p in plan)
    if n_docs == 0:
        raise PipelineError(f"tokenize.inputs: the corpus is empty (no non-blank documents in {', '.join(cfg.inputs)})")
    if n_docs < 2:
        raise PipelineError("tokenize.inputs: the corpus has one document; need at least two for a train/validation split")
    n_val = sum(sum(p.val) for p in plan)
    if n_val == 0 or n_val == n_docs:
        # Tiny corpora: move the first document (in plan order) to the empty side.
        first = plan[0]
        flipped = (not first.val[0],) + first.val[1:]
        plan[0] = dataclasses.replace(first, val=flipped)
    return plan


def _iter_docs(item: PlanItem, text_field: str, max_document_bytes: int) -> Iterator[tuple[Document, bool]]:
    # islice stops after item.docs without reading on: what follows is not the plan's
    docs = itertools.islice(read_documents(item.source, text_field, max_document_bytes), item.docs)
    count = 0
    for doc, val in zip(docs, item.val, strict=False):  # a shorter file is reported below
        count += 1
        yield doc, val
    if count < item.docs:
        raise PipelineError(f"{item.source.path}: changed while being tokenized ({count} of {item.docs} documents left); rerun")


# ------------------------------------------------------------------ worker processes


@dataclasses.dataclass(frozen=True)
class _Job:
    item: PlanItem
    text_field: str
    max_document_bytes: int
    eos_id: int
    batch_chars: int  # BATCH_CHARS, passed along: the worker's copy of this module is its own


_worker: dict = {}  # in a worker process: its tokenizer and the shared heartbeat counter


def _start_worker(tokenizer_json: str, heartbeat, parent_pid: int) -> None:
    from tokenizers import Tokenizer

    _worker.update(tokenizer=Tokenizer.from_str(tokenizer_json), heartbeat=heartbeat)
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True).start()


def _exit_when_orphaned(parent_pid: int) -> None:
    """A stage killed outright (SIGKILL) cannot stop its workers: they stop themselves."""
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(1)


def _encode_item(job: _Job) -> dict[str, list[np.ndarray]]:
    out: dict[str, list[np.ndarray]] = {s: [] for s in SPLITS}
    docs = _iter_docs(job.item, job.text_field, job.max_document_bytes)
    while batch := _next_batch(docs, job.batch_chars):
        try:
            encodings = _worker["tokenizer"].encode_batch([d.text for d, _ in batch], add_special_tokens=False)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # a Rust panic arrives as pyo3's PanicException, a BaseException
            raise PipelineError(f"{job.item.source.path}: the tokenizer failed ({type(exc).__name__}: {exc})") from None
        for (_, val), enc in zip(batch, encodings, strict=True):
            out["val" if val else "train"].append(np.asarray(enc.ids + [job.eos_id], dtype=np.int64))
        with _worker["heartbeat"].get_lock():
            _worker["heartbeat"].value += 1
    return out


def _next_batch(docs: Iterator[tuple[Document, bool]], max_chars: int) -> list[tuple[Document, bool]]:
    batch, chars = [], 0
    for doc in docs:
        batch.append(doc)
        chars += len(doc[0].text)
        if chars >= max_chars:
            break
    return batch


class _EncodingPool:
    """Encoding processes whose results come back in plan order. A worker that dies breaks the
    pool (ProcessPoolExecutor notices, where multiprocessing.Pool waits forever); no encoded
    batch for ``stall_timeout_s`` is a stall. Either ends in one PipelineError naming the files
    in flight, after the processes are killed."""

    def __init__(self, workers: int, tokenizer_json: str, stall_timeout_s: float) -> None:
        ctx = mp.get_context("spawn")  # no fork of a process with threads (the tokenizers library's)
        self.heartbeat = ctx.Value("Q", 0)
        self.stall_timeout_s = stall_timeout_s
        self.workers = workers
        self.closed = False
        self.executor = ProcessPoolExecutor(
            workers, mp_context=ctx, initializer=_start_worker, initargs=(tokenizer_json, self.heartbeat, os.getpid())
        )

    def map_in_order(self, jobs: list[_Job]) -> Iterator[dict[str, list[np.ndarray]]]:
        window = 2 * self.workers  # jobs in flight: keeps every worker busy, bounds results held
        futures: dict[int, Future] = {}
        for i in range(len(jobs)):
            for j in range(len(futures) + i, min(i + window, len(jobs))):
                futures[j] = self.executor.submit(_encode_item, jobs[j])
            self._wait_for(futures[i], futures, jobs)
            try:
                result = futures[i].result()
            except BrokenProcessPool:
                raise PipelineError(
                    f"tokenize: an encoding process died (killed, or aborted inside the tokenizer) while encoding {self._in_flight(futures, jobs)}"
                ) from None
            del futures[i]
            yield result

    def _wait_for(self, head: Future, futures: dict[int, Future], jobs: list[_Job]) -> None:
        poll = min(1.0, self.stall_timeout_s / 4)
        seen, since = self._progress(futures), time.monotonic()
        while not wait([head], timeout=poll).done:
            now = self._progress(futures)
            if now != seen:
                seen, since = now, time.monotonic()
            elif time.monotonic() - since > self.stall_timeout_s:
                raise PipelineError(
                    f"tokenize: no document encoded for {self.stall_timeout_s:g}s (tokenize.stall_timeout_s) "
                    f"while encoding {self._in_flight(futures, jobs)}; a tokenizer this slow (e.g. a "
                    f"backtracking pre-tokenizer regex) or a stuck worker; encoding processes killed"
                )

    def _progress(self, futures: dict[int, Future]) -> tuple[int, int]:
        return self.heartbeat.value, sum(f.done() for f in futures.values())

    @staticmethod
    def _in_flight(futures: dict[int, Future], jobs: list[_Job]) -> str:
        """Queued or encoding, or failed: which worker held which job is not known."""
        names = [str(jobs[j].item.source.path) for j, f in sorted(futures.items()) if not f.done() or f.exception() is not None]
        return _first_few(names, 3)

    def close(self, ok: bool) -> None:
        """Finished: let the workers exit. Failed: kill them (a stuck one never would), then reap."""
        if self.closed:
            return
        self.closed = True
        # ProcessPoolExecutor has no public kill before Python 3.14 (kill_workers)
        processes = list((self.executor._processes or {}).values())
        if not ok:
            for p in processes:
                p.kill()
        self.executor.shutdown(wait=ok, cancel_futures=True)
        for p in processes:
            p.join(timeout=10)


class _ShardWriter:
    def __init__(self, directory: Path, info: TokenizerInfo, shard_tokens: int) -> None:
        self.directory, self.info, self.shard_tokens = directory, info, shard_tokens
        self.buffer: list[np.ndarray] = []
        self.buffered = 0
        self.docs_in_buffer = 0
        self.index = 0
        self.tokens = 0
        self.documents = 0
        self.files: list[str] = []
        directory.mkdir(parents=True, exist_ok=True)

    def add(self, ids: np.ndarray) -> None:
        self.buffer.append(ids)
        self.buffered += len(ids)
        self.docs_in_buffer += 1
        if self.buffered >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        if not self.buffer:
            return
        # imported here, not at the top: every worker process imports this module, and moe.data
        # brings torch (~1.5 s and ~200 MB per process)
        from moe.data import write_token_file

        path = self.directory / f"part-{self.index:05d}.npy"
        write_token_file(
            path,
            np.concatenate(self.buffer),
            vocab_size=self.info.vocab_size,
            eos_id=self.info.eos_id,
            pad_id=self.info.pad_id,
            tokenizer_hash=self.info.sha256,
            num_documents=self.docs_in_buffer,
        )
        self.files.append(path.name)
        self.tokens += self.buffered
        self.documents += self.docs_in_buffer
        self.index += 1
        self.buffer, self.buffered, self.docs_in_buffer = [], 0, 0


def run_tokenize(cfg: TokenizeConfig, progress: Callable[[int, int], None] | None = None) -> dict:
    """Build ``cfg.output``; returns the manifest."""
    check_own_output(Path(cfg.output), "manifest.json", "tokenize.output")  # before any work
    skipped = Skipped()
    plan = plan_documents(cfg, skipped)
    if cfg.tokenizer:
        info = load_tokenizer(cfg.tokenizer)
        source = str(cfg.tokenizer)
    else:
        train_texts = (doc.text for item in plan for doc, val in _iter_docs(item, cfg.text_field, cfg.max_document_bytes) if not val)
        info = describe(train_bpe(train_texts, cfg.vocab_size))
        source = f"byte-level BPE trained here (vocab_size={cfg.vocab_size})"

    out = Path(cfg.output)
    tmp = fresh_temp_dir(out)  # a new name: never someone's folder
    jobs = [_Job(item, cfg.text_field, cfg.max_document_bytes, info.eos_id, BATCH_CHARS) for item in plan]
    pool = None
    try:
        writers = {s: _ShardWriter(tmp / s, info, cfg.shard_tokens) for s in SPLITS}
        pool = _EncodingPool(min(cfg.workers, len(jobs)), info.json_text, cfg.stall_timeout_s)
        _collect(pool.map_in_order(jobs), writers, len(jobs), progress)
        pool.close(ok=True)
        for w in writers.values():
            w.flush()
        write_atomic(tmp / "tokenizer.json", info.json_text)
        manifest = {
            "format": MANIFEST_FORMAT,
            "tokenizer": {
                "source": source,
                "sha256": info.sha256,
                "vocab_size": info.vocab_size,
                "eos_id": info.eos_id,
                "eos_token": info.eos_token,
                "pad_id": info.pad_id,
                "pad_token": info.pad_token,
            },
            "inputs": list(cfg.inputs),
            "sources": len(plan),
            "skipped_files": skipped.files,
            "skipped_documents": skipped.documents,
            "splits": {s: {"files": w.files, "documents": w.documents, "tokens": w.tokens} for s, w in writers.items()},
            "params": {k: v for k, v in cfg.to_dict().items() if k not in NOT_CONTENT_PARAMS},
        }
        manifest = seal_output(tmp, "manifest.json", manifest)  # lists every file: proof of what we wrote
        replace_own_output(tmp, out, "manifest.json", "tokenize.output")
    except BaseException:
        if pool is not None:
            pool.close(ok=False)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _collect(results: Iterator[dict[str, list[np.ndarray]]], writers: dict[str, _ShardWriter], total: int, progress) -> None:
    for done, encoded in enumerate(results, 1):
        for split in SPLITS:
            for ids in encoded[split]:
                writers[split].add(ids)
        if progress:
            progress(done, total)


def read_manifest(tokens_dir: str | Path) -> dict:
    """The tokenize stage's manifest.json in ``tokens_dir``, every field checked."""
    path = Path(tokens_dir) / "manifest.json"
    if not path.exists() and not path.is_symlink():
        raise PipelineError(f"{path}: not found; run the tokenize stage first (moe tokenize)")
    try:
        return read_json(path, MANIFEST_SCHEMA, MAX_MANIFEST_BYTES)
    except FileFormatError as exc:
        raise PipelineError(f"{exc}: not the tokenize stage's manifest; rerun `moe tokenize`") from None


# What dvc.yaml runs, reads and writes for this stage, and the code it runs (pipeline/stage_spec.py).
STAGE = Stage(
    name="tokenize",
    params=("tokenize",),
    deps=(),
    outputs=(Output("data/tokens", "manifest.json"),),
    code=(
        "pipeline/stages/tokenize.py",
        "pipeline/corpus.py",
        "pipeline/errors.py",
        "pipeline/hub.py",
        "pipeline/outputs.py",
        "pipeline/params.py",
        "pipeline/repository.py",
        "pipeline/tokenizer.py",
    ),
)
