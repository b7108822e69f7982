"""Tokenizers via Hugging Face `tokenizers`: train a byte-level BPE or load a tokenizer.json."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from moe.reader import FileFormatError, read_text
from pipeline.errors import PipelineError
from pipeline.outputs import write_atomic

EOS = "<|endoftext|>"
PAD = "<|pad|>"
_EOS_CANDIDATES = (EOS, "</s>", "<eos>", "<|eos|>", "<|end_of_text|>")
_PAD_CANDIDATES = (PAD, "<pad>", "<|padding|>")


@dataclasses.dataclass(frozen=True)
class TokenizerInfo:
    json_text: str
    sha256: str
    vocab_size: int
    eos_id: int
    eos_token: str
    pad_id: int | None
    pad_token: str | None

    def build(self) -> Tokenizer:
        return Tokenizer.from_str(self.json_text)


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def describe(tok: Tokenizer, source: str = "tokenizer") -> TokenizerInfo:
    text = tok.to_str()
    eos = next((t for t in _EOS_CANDIDATES if tok.token_to_id(t) is not None), None)
    if eos is None:
        raise PipelineError(f"{source}: no end-of-text token (looked for {', '.join(_EOS_CANDIDATES)})")
    pad = next((t for t in _PAD_CANDIDATES if tok.token_to_id(t) is not None), None)
    return TokenizerInfo(
        json_text=text,
        sha256=hashlib.sha256(text.encode()).hexdigest(),
        vocab_size=tok.get_vocab_size(with_added_tokens=True),
        eos_id=tok.token_to_id(eos),
        eos_token=eos,
        pad_id=tok.token_to_id(pad) if pad else None,
        pad_token=pad,
    )


MAX_TOKENIZER_BYTES = 256 * 2**20  # the largest public tokenizer.json files are a few tens of MiB


def load_tokenizer(path: str | Path) -> TokenizerInfo:
    """A tokenizer.json file, or a directory holding one (e.g. a saved HF tokenizer)."""
    p = Path(path)
    file = p / "tokenizer.json" if p.is_dir() else p
    if not file.exists():
        raise PipelineError(f"tokenize.tokenizer: {file} not found")
    try:
        text = read_text(file, MAX_TOKENIZER_BYTES)  # a regular file of bounded size, before the parser sees it
    except FileFormatError as exc:
        raise PipelineError(f"tokenize.tokenizer: {exc}") from None
    try:
        tok = Tokenizer.from_str(text)
    except Exception as exc:  # tokenizers raises a plain Exception
        raise PipelineError(f"tokenize.tokenizer: {file} is not a tokenizers JSON file ({exc})") from None
    return describe(tok, str(file))


def write_hf_tokenizer_files(info: TokenizerInfo, directory: Path, max_length: int) -> None:
    """tokenizer.json plus the small files AutoTokenizer reads."""
    directory.mkdir(parents=True, exist_ok=True)
    write_atomic(directory / "tokenizer.json", info.json_text)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": info.eos_token,
        "bos_token": None,
        "unk_token": None,
        "pad_token": info.pad_token,
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
    }
    write_atomic(directory / "tokenizer_config.json", json.dumps(config, indent=2) + "\n")
    special = {"eos_token": info.eos_token}
    if info.pad_token:
        special["pad_token"] = info.pad_token
    write_atomic(directory / "special_tokens_map.json", json.dumps(special, indent=2) + "\n")
