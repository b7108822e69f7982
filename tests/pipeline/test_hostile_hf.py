"""Hostile Hugging Face directories, tokenizers and evaluate settings (issue 25, items 7, 10, 13).

Every case starts from a private trained workspace (the `ws` fixture) holding `hostile_hf`, our own
conversion of its checkpoint, which the setup then tampers with. The harness (outcomes, running)
is tests/pipeline/hostile.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.pipeline.hostile import Case, params_for, run_case

TABLE = "issue 25: hf and evaluate"
FROM_HF = ["convert", "--from-hf", "hostile_hf", "--out", "hostile_ckpt"]
EVALUATE = ["evaluate", "--no-mlflow", "--set", "convert.output=hostile_hf"]
WEIGHTS = "hostile_hf/model.safetensors"


@pytest.fixture(scope="module")
def converted(trained_dir, tmp_path_factory) -> Path:
    """Our conversion of the trained checkpoint, made once and copied into every case's workspace."""
    from pipeline.stages.convert import convert_to_hf, load_tokens_tokenizer

    out = tmp_path_factory.mktemp("converted") / "hostile_hf"
    convert_to_hf(trained_dir / "runs/train/checkpoints", out, load_tokens_tokenizer(trained_dir / "data/tokens"))
    return out


# ----------------------------------------------------------------------- tampering


def edit_weights(change):
    """A setup that rewrites hostile_hf's weights through change(state) (a dict of tensors, edited in place)."""

    def setup(ws: Path) -> None:
        from safetensors.torch import load_file, save_file

        state = load_file(ws / WEIGHTS)
        change(state)
        save_file(state, ws / WEIGHTS, metadata={"format": "pt"})

    return setup


def edit_config(**changes):
    def setup(ws: Path) -> None:
        path = ws / "hostile_hf/config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))

    return setup


def write_config(text: str):
    def setup(ws: Path) -> None:
        (ws / "hostile_hf/config.json").write_text(text)

    return setup


def _nan(state):
    state["model.layers.0.self_attn.q_proj.weight"][0, 0] = float("nan")


def _int64(state):
    state["model.layers.1.mlp.gate.weight"] = state["model.layers.1.mlp.gate.weight"].to(torch.int64)


def _extra_expert(state):  # the tiny model has 4 experts: 0..3
    state["model.layers.0.mlp.experts.4.gate_proj.weight"] = state["model.layers.0.mlp.experts.0.gate_proj.weight"].clone()


def _drop_q_norm(state):
    del state["model.layers.1.self_attn.q_norm.weight"]


def _lm_head_is_embedding(state):
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()


def _tied(ws):
    edit_config(tie_word_embeddings=True)(ws)


def _tied_equal(ws):
    edit_weights(_lm_head_is_embedding)(ws)
    _tied(ws)


def index_pointing_at(shard: str):
    """The weights moved next to hostile_hf, and an index whose weight_map names them by `shard`."""

    def setup(ws: Path) -> None:
        from safetensors import safe_open

        with safe_open(ws / WEIGHTS, framework="pt") as f:
            names = list(f.keys())
        shutil.move(ws / WEIGHTS, ws / "x.safetensors")
        target = shard.replace("{ws}", str(ws))
        index = {"metadata": {}, "weight_map": dict.fromkeys(names, target)}
        (ws / "hostile_hf/model.safetensors.index.json").write_text(json.dumps(index))

    return setup


def _symlink_outside(ws):
    shutil.move(ws / WEIGHTS, ws / "outside.safetensors")
    (ws / WEIGHTS).symlink_to("../outside.safetensors")


def write_index(text: str):
    """The weights as a shard named by an index holding `text`."""

    def setup(ws: Path) -> None:
        shutil.move(ws / WEIGHTS, ws / "hostile_hf/model-00001-of-00001.safetensors")
        (ws / "hostile_hf/model.safetensors.index.json").write_text(text)

    return setup


def other_tokenizer(extra_tokens: int):
    """tokenize.output=hostile_tok: the workspace's tokenizer with `extra_tokens` more entries (another hash)."""

    def setup(ws: Path) -> None:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(ws / "data/tokens/tokenizer.json"))
        tok.add_tokens([f"<extra_{i}>" for i in range(extra_tokens)])
        (ws / "hostile_tok").mkdir()
        tok.save(str(ws / "hostile_tok/tokenizer.json"))

    return setup


def _other_tokens(ws):
    """A whole tokenised dataset (manifest, splits) made with another tokenizer."""
    from typer.testing import CliRunner

    from pipeline.cli import app

    r = CliRunner().invoke(app, ["tokenize", "--no-mlflow", "--set", "tokenize.output=hostile_tokens", "--set", "tokenize.vocab_size=290"])
    assert r.exit_code == 0, r.output


# -------------------------------------------------------------------------- checks


def names(*words: str, unwritten: str | None = None):
    """The error line names every word, and `unwritten` (an output path) was not created."""

    def check(ws: Path, result) -> str | None:
        if result.exit_code == 0 or (unwritten and (ws / unwritten).exists()):
            return "silent"
        last = result.output.strip().splitlines()[-1]
        return "traceback" if any(w not in last for w in words) else None  # not one clear error naming the fault

    return check


def refused_from_hf(*words: str):
    return names(*words, unwritten="hostile_ckpt")


def _converted_back(ws, result):
    return None if (ws / "hostile_ckpt/latest").is_file() else "silent"


def generation_capped_below(positions: int):
    """The sample was cut to fit `positions`, and both the metrics and the output say so."""

    def check(ws: Path, result) -> str | None:
        metrics = json.loads((ws / "metrics/eval_detail.json").read_text())
        said = "evaluate.generate_tokens=4096" in result.output
        capped = metrics.get("generation_capped") == 1.0 and 0 < metrics.get("generate_tokens", 0) < positions
        return None if said and capped else "silent"

    return check


def _vocab_sizes_named(ws, result):
    from pipeline.tokenizer import load_tokenizer

    return names(str(load_tokenizer(ws / "hostile_tok/tokenizer.json").vocab_size), "model.vocab_size=320")(ws, result)


def _hashes_named(ws, result):
    from pipeline.tokenizer import load_tokenizer

    ours = load_tokenizer(ws / "data/tokens/tokenizer.json").sha256[:12]
    return names(ours, "meta.json")(ws, result)


CASES = [
    # 7: hostile Hugging Face directories given to `moe convert --from-hf`
    Case("hf-nan-weight", 7, FROM_HF, setup=edit_weights(_nan), check=refused_from_hf("model.layers.0.self_attn.q_proj.weight")),
    Case("hf-int64-weight", 7, FROM_HF, setup=edit_weights(_int64), check=refused_from_hf("model.layers.1.mlp.gate.weight", "int64")),
    Case("hf-extra-expert", 7, FROM_HF, setup=edit_weights(_extra_expert), check=refused_from_hf("model.layers.0.mlp.experts.4.gate_proj.weight")),
    Case("hf-missing-tensor", 7, FROM_HF, setup=edit_weights(_drop_q_norm), check=refused_from_hf("model.layers.1.self_attn.q_norm.weight")),
    Case("hf-shape-disagrees-with-config", 7, FROM_HF, setup=edit_config(vocab_size=321), check=refused_from_hf("config.json", "(321, 32)")),
    Case("hf-index-parent-path", 7, FROM_HF, setup=index_pointing_at("../x.safetensors"), check=refused_from_hf("../x.safetensors")),
    Case("hf-index-absolute-path", 7, FROM_HF, setup=index_pointing_at("{ws}/x.safetensors"), check=refused_from_hf("x.safetensors")),
    Case("hf-weights-symlink-outside", 7, FROM_HF, setup=_symlink_outside, check=refused_from_hf("model.safetensors", "symlink")),
    Case("hf-index-malformed-json", 7, FROM_HF, setup=write_index("{oops"), check=refused_from_hf("model.safetensors.index.json")),
    Case(
        "hf-index-weight-map-a-list",
        7,
        FROM_HF,
        setup=write_index('{"weight_map": ["model-00001-of-00001.safetensors"]}'),
        check=refused_from_hf("model.safetensors.index.json", "weight_map"),
    ),
    Case("hf-config-malformed-json", 7, FROM_HF, setup=write_config("{oops"), check=refused_from_hf("config.json")),
    Case("hf-config-a-list", 7, FROM_HF, setup=write_config("[1, 2]"), check=refused_from_hf("config.json")),
    Case("hf-config-rope-scaling-string", 7, FROM_HF, setup=edit_config(rope_scaling="linear"), check=refused_from_hf("config.json", "rope_scaling")),
    Case("hf-config-hidden-size-string", 7, FROM_HF, setup=edit_config(hidden_size="32"), check=refused_from_hf("config.json", "hidden_size")),
    Case("hf-config-hidden-size-fraction", 7, FROM_HF, setup=edit_config(hidden_size=32.5), check=refused_from_hf("config.json", "hidden_size")),
    Case("hf-config-num-experts-null", 7, FROM_HF, setup=edit_config(num_experts=None), check=refused_from_hf("config.json", "num_experts")),
    Case(
        "hf-config-vocab-size-missing",
        7,
        FROM_HF,
        setup=write_config(json.dumps({"model_type": "olmoe"})),
        check=refused_from_hf("config.json", "vocab_size"),
    ),
    Case("hf-tied-but-lm-head-differs", 7, FROM_HF, setup=_tied, check=refused_from_hf("lm_head.weight", "model.embed_tokens.weight")),
    Case("hf-tied-and-lm-head-equal", 7, FROM_HF, setup=_tied_equal, expect="ok", check=_converted_back),
    # 10: `moe evaluate` ends, names its own keys, and never loads an unchecked directory through transformers
    Case(
        "eval-generate-tokens-over-bound",
        10,
        [*EVALUATE, "--set", "evaluate.generate_tokens=100000"],
        check=names("evaluate.generate_tokens"),
        subprocess=True,
        timeout=90,
    ),
    Case(
        "eval-generate-tokens-past-max-positions",
        10,
        [*EVALUATE, "--set", "evaluate.generate_tokens=4096"],
        setup=edit_config(max_position_embeddings=48),
        expect="ok",
        check=generation_capped_below(48),
        subprocess=True,
        timeout=120,
    ),
    # the same against our own limit (model.max_seq_len=1024): a thousand greedy steps without a KV cache
    Case(
        "eval-generate-tokens-past-max-seq-len",
        10,
        [*EVALUATE, "--set", "evaluate.generate_tokens=4096"],
        expect="ok",
        check=generation_capped_below(1024),
        subprocess=True,
        timeout=400,
        slow=True,
    ),
    Case("eval-device-cuda-without-gpu", 10, [*EVALUATE, "--set", "evaluate.device=cuda"], check=names("evaluate.device")),
    Case("eval-config-vocab-size-disagrees", 10, EVALUATE, setup=edit_config(vocab_size=321), check=names("config.json", "(321, 32)")),
    Case("eval-missing-tensor", 10, EVALUATE, setup=edit_weights(_drop_q_norm), check=names("model.layers.1.self_attn.q_norm.weight")),
    Case("eval-nan-weight", 10, EVALUATE, setup=edit_weights(_nan), check=names("model.layers.0.self_attn.q_proj.weight")),
    # 13: a checkpoint meets only the tokenizer it was trained with
    Case(
        "convert-other-tokenizer-same-size",
        13,
        ["convert", "--no-mlflow", "--out", "hostile_hf2", "--set", "tokenize.output=hostile_tok"],
        setup=other_tokenizer(5),
        check=_hashes_named,
    ),
    Case(
        "convert-tokenizer-larger-than-model",
        13,
        ["convert", "--no-mlflow", "--out", "hostile_hf2", "--set", "tokenize.output=hostile_tok"],
        setup=other_tokenizer(1000),
        check=_vocab_sizes_named,
    ),
    Case("eval-data-of-another-tokenizer", 13, [*EVALUATE, "--set", "tokenize.output=hostile_tokens"], setup=_other_tokens, check=_hashes_named),
]
NEEDS_NO_GPU = {"eval-device-cuda-without-gpu"}


@pytest.mark.parametrize("case", params_for(CASES))
def test_hostile_hf(case: Case, ws, converted, monkeypatch):
    if case.id in NEEDS_NO_GPU and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    shutil.copytree(converted, ws / "hostile_hf")
    run_case(TABLE, case, ws, monkeypatch)
