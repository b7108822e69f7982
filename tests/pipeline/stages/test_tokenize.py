import gzip
import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moe.config import ConfigError
from moe.data import TokenDataset, open_token_file
from pipeline.corpus import Source, read_documents
from pipeline.errors import PipelineError
from pipeline.params import TokenizeConfig
from pipeline.stages.tokenize import read_manifest, run_tokenize
from pipeline.tokenizer import load_tokenizer


def tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(root.rglob("*")):
        if f.is_file():
            h.update(f.relative_to(root).as_posix().encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def cfg(**kw) -> TokenizeConfig:
    base = {"inputs": ["corpus"], "vocab_size": 300, "max_bytes": None, "workers": 1, "val_fraction": 0.2, "output": "out"}
    return TokenizeConfig(**{**base, **kw}).validate("tokenize")


def test_outputs_are_valid_token_files_and_decode_back(workspace):
    m = run_tokenize(cfg())
    out = Path("out")
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "tokenizer.json", "train", "val"]
    assert m["splits"]["train"]["documents"] + m["splits"]["val"]["documents"] == 60
    assert m["splits"]["val"]["documents"] > 0
    info = load_tokenizer(out / "tokenizer.json")
    assert info.sha256 == m["tokenizer"]["sha256"] and info.vocab_size == 300
    assert read_manifest(out) == m  # the manifest as written passes its schema (MANIFEST_SCHEMA)
    arr, side = open_token_file(out / "train" / "part-00000.npy", tokenizer_hash=info.sha256)
    assert side.eos_id == info.eos_id and side.num_documents == m["splits"]["train"]["documents"]
    first_doc = arr[: int(np.argmax(arr == info.eos_id))]
    text = info.build().decode(first_doc.tolist())
    with open("corpus/docs.jsonl") as f:
        source = [json.loads(line)["text"] for line in f]
    assert text in source
    TokenDataset([str(out / "train")], 16, tokenizer_hash=info.sha256)


def test_rerun_is_byte_identical_whatever_the_worker_count(workspace):
    run_tokenize(cfg(output="a", workers=1))
    run_tokenize(cfg(output="b", workers=2))
    run_tokenize(cfg(output="a2", workers=1))
    assert tree_digest(Path("a")) == tree_digest(Path("b")) == tree_digest(Path("a2"))


def test_each_input_format(workspace):
    texts = [f"document number {i} says hello to the tokenizer" for i in range(12)]
    d = Path("formats")
    d.mkdir()
    (d / "a.txt").write_text(texts[0])
    (d / "b.py").write_text("def f():\n    return 1\n")
    with gzip.open(d / "c.jsonl.gz", "wt") as f:
        for t in texts[1:5]:
            f.write(json.dumps({"text": t}) + "\n")
    with open(d / "d.jsonl", "w") as f:
        for t in texts[5:8]:
            f.write(json.dumps({"body": "x", "text": t}) + "\n")
    pq.write_table(pa.table({"text": texts[8:12]}), d / "e.parquet")
    m = run_tokenize(cfg(inputs=["formats"]))
    assert m["splits"]["train"]["documents"] + m["splits"]["val"]["documents"] == 1 + 1 + 4 + 3 + 4


def test_stdlib_default_reads_real_python(workspace):
    m = run_tokenize(cfg(inputs=["stdlib"], max_bytes=300_000, vocab_size=400))
    assert m["splits"]["train"]["tokens"] > 50_000


def test_user_tokenizer_file_or_directory(workspace):
    run_tokenize(cfg(output="first"))
    tok_dir = Path("saved_tok")
    tok_dir.mkdir()
    (tok_dir / "tokenizer.json").write_text(Path("first/tokenizer.json").read_text())
    m = run_tokenize(cfg(output="second", tokenizer=str(tok_dir)))
    assert m["tokenizer"]["sha256"] == json.loads(Path("first/manifest.json").read_text())["tokenizer"]["sha256"]
    assert Path("first/train/part-00000.npy").read_bytes() == Path("second/train/part-00000.npy").read_bytes()


@pytest.mark.parametrize(
    "setup, kw, message",
    [
        (None, {"inputs": ["nope"]}, "tokenize.inputs: nope not found"),
        ("empty", {"inputs": ["empty"]}, "holds no .txt"),
        ("blank", {"inputs": ["blank"]}, "the corpus is empty"),
        ("badjson", {"inputs": ["badjson"]}, "docs.jsonl:2: not valid JSON"),
        ("nofield", {"inputs": ["nofield"]}, "docs.jsonl:1: no string field 'text'"),
        (None, {"tokenizer": "missing/tokenizer.json"}, "tokenize.tokenizer: missing/tokenizer.json not found"),
        ("badtok", {"tokenizer": "bad.json"}, "is not a tokenizers JSON file"),
    ],
)
def test_bad_input_fails_clearly_and_writes_nothing(workspace, setup, kw, message):
    Path("empty").mkdir()
    Path("blank").mkdir()
    (Path("blank") / "a.txt").write_text("   \n")
    Path("badjson").mkdir()
    (Path("badjson") / "docs.jsonl").write_text('{"text": "ok"}\n{oops\n')
    Path("nofield").mkdir()
    (Path("nofield") / "docs.jsonl").write_text('{"content": "x"}\n')
    Path("bad.json").write_text("{}")
    with pytest.raises(PipelineError) as info:
        run_tokenize(cfg(**kw))
    assert message in str(info.value)
    assert not Path("out").exists()
    assert not list(Path(".").glob(".out.tmp-*"))


@pytest.mark.parametrize("key", ["max_document_bytes", "stall_timeout_s"])
def test_bounds_must_be_positive(key):
    with pytest.raises(ConfigError, match=f"tokenize.{key}: must be > 0"):
        TokenizeConfig(**{key: 0}).validate("tokenize")


def test_documents_over_the_bound_are_skipped_unread_and_listed(workspace):
    """In every format; the documents after an over-long line keep their place (and their split)."""
    d = Path("long")
    d.mkdir()
    texts = [f"document number {i} is short and fine" for i in range(6)]
    with open(d / "a.jsonl", "w") as f:
        for t in [texts[0], "y" * 5000, texts[1]]:
            f.write(json.dumps({"text": t}) + "\n")
    with gzip.open(d / "b.jsonl.gz", "wt") as f:
        for t in ["z" * 5000, texts[2], texts[3]]:
            f.write(json.dumps({"text": t}) + "\n")
    (d / "c.txt").write_text("w " * 2000)
    (d / "d.txt").write_text(texts[4])
    pq.write_table(pa.table({"text": [texts[5], "\u00e9" * 600]}), d / "e.parquet")  # 600 chars, 1200 bytes
    m = run_tokenize(cfg(inputs=["long"], max_document_bytes=1000))
    assert sorted(s["source"] for s in m["skipped_documents"]) == ["long/a.jsonl:2", "long/b.jsonl.gz:1", "long/c.txt", "long/e.parquet:1"]
    assert all("tokenize.max_document_bytes (1000 bytes)" in s["reason"] for s in m["skipped_documents"])
    assert m["skipped_files"] == [] and m["params"]["max_document_bytes"] == 1000
    assert m["splits"]["train"]["documents"] + m["splits"]["val"]["documents"] == 6
    assert read_manifest("out") == m
    keys = [doc.key for doc in read_documents(Source(d / "a.jsonl", "long/a.jsonl"), "text", 1000)]
    assert keys == ["long/a.jsonl:1", "long/a.jsonl:3"]


def test_lone_surrogates_become_replacement_characters(workspace):
    Path("corpus/odd.jsonl").write_text('{"text": "abc \\ud800 def"}\n{"text": "\\udfff and a pair \\ud83d\\ude00"}\n')
    docs = [d.text for d in read_documents(Source(Path("corpus/odd.jsonl"), "odd.jsonl"), "text", 1 << 20)]
    assert docs == ["abc \ufffd def", "\ufffd and a pair \U0001f600"]
    m = run_tokenize(cfg())
    assert m["splits"]["train"]["documents"] + m["splits"]["val"]["documents"] == 62


def test_encoding_in_batches_does_not_change_the_output(workspace, monkeypatch):
    """BATCH_CHARS splits a file's documents into several encode calls (a heartbeat after each)."""
    import pipeline.stages.tokenize as stage

    monkeypatch.setattr(stage, "BATCH_CHARS", 500)
    run_tokenize(cfg(output="small_batches", workers=2, inputs=["corpus", "stdlib"], max_bytes=200_000))
    monkeypatch.setattr(stage, "BATCH_CHARS", 1 << 30)
    run_tokenize(cfg(output="one_batch", workers=1, inputs=["corpus", "stdlib"], max_bytes=200_000))
    assert tree_digest(Path("small_batches")) == tree_digest(Path("one_batch"))


# ------------------------------------------------ issue 50: the manifest through moe.reader


def _manifest(**changes) -> dict:
    """A manifest as run_tokenize writes it (the params of the default config), with ``changes``."""
    from pipeline.stages.tokenize import NOT_CONTENT_PARAMS

    params = {k: v for k, v in TokenizeConfig().to_dict().items() if k not in NOT_CONTENT_PARAMS}
    manifest = {
        "format": "olmo-core-tokens/1",
        "tokenizer": {
            "source": "here",
            "sha256": "ab" * 32,
            "vocab_size": 512,
            "eos_id": 0,
            "eos_token": "<|endoftext|>",
            "pad_id": None,
            "pad_token": None,
        },
        "inputs": ["stdlib"],
        "sources": 3,
        "skipped_files": [],
        "skipped_documents": [{"source": "docs.jsonl:2", "reason": "over tokenize.max_document_bytes"}],
        "splits": {s: {"files": ["part-00000.npy"], "documents": 3, "tokens": 300} for s in ("train", "val")},
        "params": params,
        "written_files": {"tokenizer.json": {"size": 1234, "sha256": "cd" * 32}},
    }
    return {**manifest, **changes}


def test_every_param_of_the_stage_has_its_place_in_the_manifest_schema(tmp_path, monkeypatch):
    """A new tokenize param must be added to the manifest's schema, or every manifest is refused."""
    monkeypatch.chdir(tmp_path)
    Path("out").mkdir()
    Path("out/manifest.json").write_text(json.dumps(_manifest()))
    assert read_manifest("out")["params"]["vocab_size"] == 512


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"tokenizer": {"sha256": 7, "vocab_size": 512, "eos_id": 0}}, "tokenizer.sha256: expected a string"),
        (
            {"splits": {"train": {"files": [], "documents": 0, "tokens": -1}, "val": {"files": [], "documents": 0, "tokens": 0}}},
            "splits.train.tokens: expected an integer in [0, ",
        ),
        (
            {"splits": {"train": {"files": ["../x.npy"], "documents": 0, "tokens": 0}, "val": {"files": [], "documents": 0, "tokens": 0}}},
            "splits.train.files[0]: expected a string matching",
        ),
        ({"format": "olmo-core-tokens/2"}, "format: expected one of olmo-core-tokens/1"),
        ({"workers": 4}, "workers: unknown key"),
    ],
)
def test_a_manifest_not_of_its_schema_is_one_error_naming_the_field(tmp_path, monkeypatch, changes, field):
    monkeypatch.chdir(tmp_path)
    Path("out").mkdir()
    Path("out/manifest.json").write_text(json.dumps(_manifest(**changes)))
    with pytest.raises(PipelineError) as exc:
        read_manifest("out")
    message = str(exc.value)
    assert message.startswith(f"out/manifest.json: {field}") and "rerun `moe tokenize`" in message and "\n" not in message


def test_a_manifest_with_nan_or_a_fifo_in_its_place_is_one_error_at_once(tmp_path, monkeypatch):
    from tests.pipeline.fifo import fifo_at, within

    monkeypatch.chdir(tmp_path)
    Path("out").mkdir()
    Path("out/manifest.json").write_text(json.dumps(_manifest(), allow_nan=True).replace('"val_fraction": 0.05', '"val_fraction": NaN'))
    with pytest.raises(PipelineError, match=re.escape("out/manifest.json: not valid JSON (NaN is not a number JSON allows")):
        read_manifest("out")
    fifo = fifo_at(Path("out/manifest.json"))
    with pytest.raises(PipelineError, match="out/manifest.json: not a regular file"):
        within(lambda: read_manifest("out"), fifo)
    fifo.unlink()
    with pytest.raises(PipelineError, match="out/manifest.json: not found; run the tokenize stage first"):
        read_manifest("out")
