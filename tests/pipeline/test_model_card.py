"""The converted directory's model card: the Hub's YAML header, the in-loop evaluation of the
checkpoint's step, a base model when the run continued from one; transformers loads the
directory with the card in it. Issue 50: every value goes in through its format's escaper, and
the card says what the checkpoint's records say, not today's params.yaml."""

import ast
import json
import re
from pathlib import Path

import pytest
import yaml

from tests.pipeline.test_escape import PAYLOADS
from tests.workspace import load


def _header(readme: Path) -> dict:
    text = readme.read_text()
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


def test_the_card_has_the_hub_header_and_the_checkpoint_s_evaluation(in_trained):
    from transformers import AutoModelForCausalLM

    from pipeline.cli import card_writer
    from pipeline.stages.convert import convert_to_hf, load_tokens_tokenizer

    cfg = load(["convert.output=hf_card"])
    convert_to_hf("runs/train/checkpoints", "hf_card", load_tokens_tokenizer("data/tokens"), card=card_writer(cfg, "hf_card"))
    header = _header(Path("hf_card/README.md"))
    assert header["library_name"] == "transformers" and header["pipeline_tag"] == "text-generation"
    assert header["license"] == "apache-2.0" and "base_model" not in header  # trained from scratch

    logged = [json.loads(line) for line in Path("runs/train/metrics.jsonl").read_text().splitlines()]
    at_8 = [row for row in logged if row.get("step") == 8 and "eval/arc_easy/bpb" in row][-1]
    (entry,) = header["model-index"]
    (result,) = entry["results"]
    assert result["dataset"] == {
        "name": "arc_easy",
        "type": "allenai/ai2_arc",
        "config": "ARC-Easy",
        "split": "validation",
        "args": {"num_few_shot": 0},
    }
    values = {m["type"]: m["value"] for m in result["metrics"]}
    assert values["bpb"] == pytest.approx(at_8["eval/arc_easy/bpb"], abs=1e-6)
    assert values["acc"] == pytest.approx(at_8["eval/arc_easy/acc"], abs=1e-6)
    text = Path("hf_card/README.md").read_text()
    assert "In-loop evaluation at step 8" in text and "near chance" in text and "at most" in text
    assert values["bpb_stderr"] == pytest.approx(at_8["eval/arc_easy/bpb/stderr"], abs=1e-6)
    model = AutoModelForCausalLM.from_pretrained("hf_card")
    assert type(model).__name__ == "OlmoeForCausalLM"


def test_a_continued_run_names_its_base_model(in_trained, tmp_path):
    from pipeline.cli import card_writer
    from pipeline.stages.convert import convert_from_hf, convert_to_hf, load_tokens_tokenizer

    if not Path("hf_card").is_dir():
        convert_to_hf("runs/train/checkpoints", "hf_card", load_tokens_tokenizer("data/tokens"))
    src = tmp_path / "OLMoE-mini"
    src.mkdir()
    for f in Path("hf_card").iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "_name_or_path": "allenai/OLMoE-1B-7B-0924"}))
    convert_from_hf(src, tmp_path / "init")

    meta = {"step": 3, "config": {"checkpoint": {"init_from": str(tmp_path / "init")}, "train": {}, "data": {}}}
    cfg = load()
    header = _header_text(card_writer(cfg, "out")(cfg.model, meta))
    assert header["base_model"] == "allenai/OLMoE-1B-7B-0924"

    chosen = load(["convert.base_model=my-lab/olmoe-mini"])
    assert _header_text(card_writer(chosen, "out")(chosen.model, meta))["base_model"] == "my-lab/olmoe-mini"
    from moe.config import ConfigError

    with pytest.raises(ConfigError, match="convert.base_model: must be a Hugging Face Hub id"):
        load(["convert.base_model=../weights"])


def _header_text(card: str) -> dict:
    return yaml.safe_load(card.split("---\n")[1])


def _released(cfg, detail: dict) -> dict:
    from pipeline.cli import card_text
    from pipeline.stages.release import run_release

    Path("metrics").mkdir(exist_ok=True)
    Path("metrics/eval_detail.json").write_text(json.dumps(detail))
    return run_release(cfg, card_text)


def test_release_puts_the_final_evaluation_on_the_card_of_exactly_that_model(ws):
    """Issue 40: the final evaluation reaches a card (convert writes its card before evaluate
    runs): documents, chance, standard errors and the step, for the directory evaluated only."""
    from transformers import AutoModelForCausalLM

    from pipeline.errors import PipelineError
    from pipeline.stages.convert import convert_to_hf, load_tokens_tokenizer
    from pipeline.stages.evaluate import converted_model_identity

    cfg = load()
    convert_to_hf("runs/train/checkpoints", cfg.convert.output, load_tokens_tokenizer("data/tokens"))
    task = {"acc_v2": 0.31, "acc_v2/stderr": 0.04, "bpb_v2": 2.5, "bpb_v2/stderr": 0.1, "docs": 123.0, "chance": 0.25, "primary": "acc"}
    task |= {"len_norm_v2": 0.3, "len_norm_v2/stderr": 0.04}
    detail = {"format": "moe-eval/1", "val_loss": 3.0, "step": 8, "tasks": {"arc_easy": task}, "converted_sha256": "0" * 64}
    with pytest.raises(PipelineError, match="is not the evaluation of the model now in"):
        _released(cfg, detail)
    assert not Path(cfg.release.output).exists()
    detail["converted_sha256"] = converted_model_identity(Path(cfg.convert.output))
    with pytest.raises(PipelineError, match="of step 7, the converted checkpoint of step 8"):
        _released(cfg, {**detail, "step": 7})
    done = _released(cfg, detail)
    assert done["step"] == 8
    card = Path(cfg.release.output, "README.md").read_text()
    assert "The evaluate stage's numbers for this directory, at step 8" in card
    assert "| arc_easy | acc | 0.3100 ± 0.0400 | 0.2500 | 123 | 0 |" in card
    assert "| arc_easy | bpb | 2.5000 ± 0.1000 |  | 123 | 0 |" in card
    values = {m["type"]: m["value"] for m in _header_text(card)["model-index"][0]["results"][0]["metrics"]}
    assert values == {"acc": 0.31, "acc_stderr": 0.04, "bpb": 2.5, "bpb_stderr": 0.1, "len_norm": 0.3, "len_norm_stderr": 0.04}
    assert type(AutoModelForCausalLM.from_pretrained(cfg.release.output)).__name__ == "OlmoeForCausalLM"
    _released(cfg, detail)  # its own earlier output: replaced
    foreign = Path("elsewhere")
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(PipelineError, match="release.output: elsewhere exists and holds files this stage did not write"):
        _released(load(["release.output=elsewhere"]), detail)
    assert (foreign / "notes.txt").read_text() == "mine"


# ---------------------------------------------------------------- issue 50


def _body(card: str) -> str:
    return card.split("\n---\n", 1)[1]


TOKENIZER_SHA = "ab" * 32


def tokens_manifest(inputs: list[str], **changes) -> dict:
    """A tokenize stage's manifest.json (as run_tokenize writes it) naming ``inputs``."""
    tokenizer = {
        "source": "here",
        "sha256": TOKENIZER_SHA,
        "vocab_size": 320,
        "eos_id": 0,
        "eos_token": "<|endoftext|>",
        "pad_id": None,
        "pad_token": None,
    }
    split = {"files": ["part-00000.npy"], "documents": 1, "tokens": 10}
    return {"format": "olmo-core-tokens/1", "tokenizer": tokenizer, "inputs": inputs, "splits": {"train": split, "val": split}, **changes}


def _python_snippet(card: str) -> ast.Module:
    lines = card.splitlines()
    start = lines.index("```python") + 1
    end = lines.index("```", start)
    return ast.parse("\n".join(lines[start:end]))


def _hostile_card(name: str, tmp_path: Path, monkeypatch) -> str:
    """A card whose every interpolated field (the directory name, the corpus the token manifest
    names, task and metric names, the task data's dataset names, the hyperparameters, the origin)
    carries the audit's payloads."""
    from moe.config import ModelConfig
    from pipeline.model_card import CardEvaluation, model_card

    monkeypatch.chdir(tmp_path)
    Path("tok").mkdir()
    Path("tok/manifest.json").write_text(json.dumps(tokens_manifest(PAYLOADS)))
    bad = PAYLOADS[3]
    config = {
        "data": {"paths": ["tok/train"], "tokenizer_hash": TOKENIZER_SHA, "seq_len": bad},
        "train": {"global_batch_size": bad, "micro_batch_size": bad, "grad_clip": bad, "seed": bad},
        "optim": {"lr": bad, "betas": PAYLOADS},
        "schedule": {"decay": bad, "warmup_steps": bad},
        "precision": {"recipe": bad},
        "checkpoint": {"init_from": bad},
    }
    tasks = {p: {p: 0.5, f"{p}/stderr": 0.1, "acc": 0.25} for p in PAYLOADS}
    sources = {p: {"type": p, "config": p, "split": p, "num_few_shot": p} for p in PAYLOADS}
    evaluation = CardEvaluation(8, False, tasks, docs={p: p for p in PAYLOADS}, chance=dict.fromkeys(PAYLOADS, 0.25), sources=sources, docs_upto=bad)
    model = ModelConfig.from_dict({"preset": "tiny", "vocab_size": 320, "d_model": 32, "n_heads": 2}).validate("model")
    return model_card(model, {"step": 8, "config": config}, name=name, corpus=["ignored"], evaluation=evaluation, continued_from=bad)


@pytest.mark.parametrize("name", PAYLOADS, ids=range(len(PAYLOADS)))
def test_every_card_field_goes_through_its_format_s_escaper(name, tmp_path, monkeypatch):
    from pipeline.escape import markdown_text

    card = _hostile_card(name, tmp_path, monkeypatch)
    header = _header_text(card)
    assert header["model-index"][0]["name"] == name and {r["dataset"]["type"] for r in header["model-index"][0]["results"]} == set(PAYLOADS)
    body = _body(card)
    assert "<img" not in body and "<" not in body.replace("< ", "")
    headings = [line for line in body.splitlines() if line.startswith("#")]
    assert headings == [f"# {markdown_text(name)}", "## Training hyperparameters", "## Evaluation"]
    assert "---" not in body.splitlines() and "injected: true" not in header
    snippet = _python_snippet(card)
    calls = [n for n in ast.walk(snippet) if isinstance(n, ast.Call)]
    assert len(calls) == 2 and all(isinstance(c.func, ast.Attribute) and c.func.attr == "from_pretrained" for c in calls)
    assert all(len(c.args) == 1 and isinstance(c.args[0], ast.Constant) and c.args[0].value == name for c in calls)
    assert not any(isinstance(n, ast.Name) and n.id == "__import__" for n in ast.walk(snippet))
    tables = [line for line in body.splitlines() if line.startswith("| ")]
    assert all(len(re.findall(r"(?<!\\)\|", line)) in (3, 7) for line in tables)  # no cell split by a value


def test_the_card_describes_the_checkpoint_as_recorded_not_today_s_params(ws):
    """`--set tokenize.inputs=...` at release time does not change the card's corpus, and
    `convert.base_model=` does not make a model trained from scratch claim a base model."""
    from tests.pipeline.stages.test_release import ready_to_release

    ready_to_release(ws)
    cfg = load(["tokenize.inputs=[<img src=x onerror=alert(1)>]", "convert.base_model=evil-lab/not-my-base"])
    _released(cfg, json.loads(Path("metrics/eval_detail.json").read_text()))
    card = Path(cfg.release.output, "README.md").read_text()
    assert "| training data | the corpus the tokenize stage read (tokenize.inputs: corpus); its license is its source's |" in card
    assert "<img" not in card and "evil-lab" not in card and "base_model" not in _header_text(card) and "Continued from" not in card


# ---------------------------------------------- issue 50: the records the card reads, through moe.reader


@pytest.mark.parametrize(
    "manifest",
    [
        tokens_manifest(["corpus"], format="olmo-core-tokens/2"),
        tokens_manifest(["corpus"], tokenizer={"sha256": TOKENIZER_SHA}),  # not the whole record
        tokens_manifest([7]),
        tokens_manifest(["corpus"], sources=-1),
        tokens_manifest(["corpus"], homepage="https://example.org"),
        {"name": "my web app", "start_url": "/"},
    ],
)
def test_a_manifest_not_of_the_tokenize_stage_s_schema_names_no_corpus(tmp_path, manifest):
    from pipeline.model_card import trained_corpus

    (tmp_path / "tok").mkdir()
    meta = {"config": {"data": {"paths": [str(tmp_path / "tok/train")], "tokenizer_hash": TOKENIZER_SHA}}}
    (tmp_path / "tok/manifest.json").write_text(json.dumps(tokens_manifest(["corpus"])))
    assert trained_corpus(meta) == ["corpus"]
    (tmp_path / "tok/manifest.json").write_text(json.dumps(manifest))
    assert trained_corpus(meta) is None


def test_a_fifo_as_the_manifest_or_the_run_s_metrics_is_answered_at_once(tmp_path):
    from moe.reader import FileFormatError
    from pipeline.model_card import eval_at_step, trained_corpus
    from tests.pipeline.fifo import fifo_at, within

    fifo = fifo_at(tmp_path / "tok/manifest.json")
    meta = {"config": {"data": {"paths": [str(tmp_path / "tok/train")], "tokenizer_hash": TOKENIZER_SHA}}}
    assert within(lambda: trained_corpus(meta), fifo) is None
    fifo = fifo_at(tmp_path / "run/metrics.jsonl")
    with pytest.raises(FileFormatError, match="metrics.jsonl: not a regular file"):
        within(lambda: eval_at_step(fifo, 8), fifo)


def test_eval_at_step_takes_the_later_row_of_the_step_and_numbers_only(tmp_path, capsys):
    from pipeline.model_card import eval_at_step

    metrics = tmp_path / "metrics.jsonl"
    rows = [
        {"step": 8, "loss": 3.0, "eval/arc_easy/acc": 0.2},
        "{damaged",
        {"step": 8, "loss": 3.0, "eval/arc_easy/acc": 0.25, "eval/arc_easy/acc/stderr": 0.05, "eval/arc_easy/note": "nan", "eval/x": 1.0},
        {"step": 9, "loss": 2.9, "eval/arc_easy/acc": 0.5},
    ]
    metrics.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    assert eval_at_step(metrics, 8) == {"arc_easy": {"acc": 0.25, "acc/stderr": 0.05}}
    assert eval_at_step(metrics, 7) == {} and eval_at_step(tmp_path / "none.jsonl", 8) == {}
    warned = capsys.readouterr().err
    assert "metrics.jsonl" in warned and "damaged" in warned  # the damaged line, skipped with one warning (moe.train.sinks)
