"""Tokenise stage: raw text -> OLMo-core token files (train/ and val/), tokenizer and manifest.

Deterministic: the same inputs and params give byte-identical outputs, whatever the number of
workers (documents keep the order of the input plan; shard boundaries depend only on it).
The output directory is built under a temporary name and renamed into place at the end.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import multiprocessing as mp
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from moe.data import write_token_file
from pipeline.corpus import Document, Source, is_text_source, is_validation, read_documents, resolve_sources
from pipeline.errors import PipelineError
from pipeline.outputs import check_own_output, replace_own_output
from pipeline.params import TokenizeConfig
from pipeline.tokenizer import TokenizerInfo, describe, load_tokenizer, train_bpe

SPLITS = ("train", "val")
log = logging.getLogger("pipeline.tokenize")


@dataclasses.dataclass(frozen=True)
class PlanItem:
    source: Source
    docs: int  # how many of the source's documents are included
    val: tuple[bool, ...]  # split of each included document


def plan_documents(cfg: TokenizeConfig, skipped: list[str] | None = None) -> list[PlanItem]:
    """Which documents go in, and to which split (one pass over the inputs); inputs that are
    not text are appended to ``skipped`` and reported."""
    plan: list[PlanItem] = []
    total = 0
    skipped = [] if skipped is None else skipped
    for source in resolve_sources(cfg.inputs):
        flags = []
        if not is_text_source(source):
            skipped.append(str(source.path))
            continue
        for doc in read_documents(source, cfg.text_field):
            if cfg.max_bytes is not None and total >= cfg.max_bytes:
                break
            flags.append(is_validation(doc.key, cfg.seed, cfg.val_fraction))
            total += len(doc.text.encode("utf-8", errors="replace"))
        if flags:
            plan.append(PlanItem(source, len(flags), tuple(flags)))
        if cfg.max_bytes is not None and total >= cfg.max_bytes:
            break
    if skipped:
        log.warning("tokenize.inputs: skipped %d file(s) that are not UTF-8 text (binary or another encoding): %s%s",
                    len(skipped), ", ".join(skipped[:5]), f" and {len(skipped) - 5} more" if len(skipped) > 5 else "")
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


def _iter_docs(item: PlanItem, text_field: str) -> Iterator[tuple[Document, bool]]:
    for i, doc in enumerate(read_documents(item.source, text_field)):
        if i >= item.docs:
            return
        yield doc, item.val[i]


def _encode_item(args: tuple[PlanItem, str, str, int]) -> dict[str, list[np.ndarray]]:
    item, text_field, tokenizer_json, eos_id = args
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json)
    docs = list(_iter_docs(item, text_field))
    encodings = tok.encode_batch([d.text for d, _ in docs], add_special_tokens=False)
    out: dict[str, list[np.ndarray]] = {s: [] for s in SPLITS}
    for (_, val), enc in zip(docs, encodings, strict=True):
        ids = np.asarray(enc.ids + [eos_id], dtype=np.int64)
        out["val" if val else "train"].append(ids)
    return out


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
    skipped: list[str] = []
    plan = plan_documents(cfg, skipped)
    if cfg.tokenizer:
        info = load_tokenizer(cfg.tokenizer)
        source = str(cfg.tokenizer)
    else:
        train_texts = (doc.text for item in plan for doc, val in _iter_docs(item, cfg.text_field) if not val)
        info = describe(train_bpe(train_texts, cfg.vocab_size))
        source = f"byte-level BPE trained here (vocab_size={cfg.vocab_size})"

    out = Path(cfg.output)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    writers = {s: _ShardWriter(tmp / s, info, cfg.shard_tokens) for s in SPLITS}
    jobs = [(item, cfg.text_field, info.json_text, info.eos_id) for item in plan]
    try:
        if cfg.workers > 1 and len(jobs) > 1:
            ctx = mp.get_context("spawn")
            with ctx.Pool(min(cfg.workers, len(jobs))) as pool:
                results = pool.imap(_encode_item, jobs, chunksize=4)
                _collect(results, writers, len(jobs), progress)
        else:
            _collect(map(_encode_item, jobs), writers, len(jobs), progress)
        for w in writers.values():
            w.flush()
        (tmp / "tokenizer.json").write_text(info.json_text)
        manifest = {
            "format": "olmo-core-tokens/1",
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
            "skipped_files": skipped,
            "splits": {
                s: {"files": w.files, "documents": w.documents, "tokens": w.tokens} for s, w in writers.items()
            },
            # what determines the content (not workers or the output path)
            "params": {k: v for k, v in cfg.to_dict().items() if k not in ("workers", "output")},
        }
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        replace_own_output(tmp, out, "manifest.json", "tokenize.output")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _collect(results, writers: dict[str, _ShardWriter], total: int, progress) -> None:
    for done, encoded in enumerate(results, 1):
        for split in SPLITS:
            for ids in encoded[split]:
                writers[split].add(ids)
        if progress:
            progress(done, total)


def read_manifest(tokens_dir: str | Path) -> dict:
    path = Path(tokens_dir) / "manifest.json"
    if not path.is_file():
        raise PipelineError(f"{path}: not found; run the tokenize stage first (moe tokenize)")
    try:
        manifest = json.loads(path.read_text())
        tok = manifest["tokenizer"]
        if not (isinstance(tok["sha256"], str) and isinstance(tok["vocab_size"], int)):
            raise TypeError("tokenizer.sha256/vocab_size have the wrong type")
    except (ValueError, KeyError, TypeError) as exc:
        raise PipelineError(f"{path}: corrupt manifest ({type(exc).__name__}: {exc}); rerun `moe tokenize`") from None
    return manifest
