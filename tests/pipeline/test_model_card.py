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

    from pipeline.model_card import card_writer
    from pipeline.stages.convert import convert_to_hf, load_tokens_tokenizer

    cfg = load(["convert.output=hf_card"])
    convert_to_hf("runs/train/checkpoints", "hf_card", load_tokens_tokenizer("data/tokens"), card=card_writer(cfg, "hf_card"))
    header = _header(Path("hf_card/README.md"))
    assert header["library_name"] == "transformers" and header["pipeline_tag"] == "text-generation"
    assert header["license"] == "apache-2.0" and "base_model" not in header  # trained from scratch

    logged = [json.loads(line) for line in Path("runs/train/metrics.jsonl").read_text().splitlines()]
    at_8 = [row for row in logged if row.get("step") == 8 and "eval/arc_easy/bpb" in row][-1]
    (entry,) = header["model-index"]
    val, result = entry["results"]  # the in-loop validation loss, then the task
    assert val["dataset"]["name"] == "held-out split of the training data"
    assert {m["type"] for m in val["metrics"]} == {"loss", "perplexity"}
    assert result["dataset"] == {
        "name": "arc_easy",
        "type": "allenai/ai2_arc",
        "config": "ARC-Easy",
        "split": "validation",
        "args": {"num_few_shot": 0},
    }
    values = {m["type"]: m["value"] for m in result["metrics"]}
    errors = {m["type"]: m["args"]["stderr"] for m in result["metrics"]}  # a standard error rides with its figure
    assert values["bpb"] == pytest.approx(at_8["eval/arc_easy/bpb"], abs=1e-6)
    assert values["acc"] == pytest.approx(at_8["eval/arc_easy/acc"], abs=1e-6)
    text = Path("hf_card/README.md").read_text()
    assert "In-loop evaluation at step 8" in text and "near chance" in text and "at most" in text
    assert errors["bpb"] == pytest.approx(at_8["eval/arc_easy/bpb/stderr"], abs=1e-6) and "bpb_stderr" not in values
    model = AutoModelForCausalLM.from_pretrained("hf_card")
    assert type(model).__name__ == "OlmoeForCausalLM"


def test_a_continued_run_names_its_base_model(in_trained, tmp_path):
    from pipeline.model_card import card_writer
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
    from pipeline.model_card import card_text
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
    assert "| arc_easy | acc | 0.3100 ± 0.0400 | 0.2500 | 123 | 0 | 0 |" in card  # no context cut
    assert "| arc_easy | bpb | 2.5000 ± 0.1000 |  | 123 | 0 | 0 |" in card
    val, arc = _header_text(card)["model-index"][0]["results"]
    assert {m["type"]: m["value"] for m in val["metrics"]} == {"loss": 3.0}
    values = {m["type"]: (m["value"], m["args"]) for m in arc["metrics"]}
    about = {"documents": 123, "truncated_documents": 0, "dropped_documents": 0}
    assert values == {"acc": (0.31, {"stderr": 0.04, **about}), "bpb": (2.5, {"stderr": 0.1, **about}), "len_norm": (0.3, {"stderr": 0.04, **about})}
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
    assert headings == [f"# {markdown_text(name)}", "## Usage", "## Training hyperparameters", "## Evaluation", "## Limitations", "## Citation"]
    assert "---" not in body.splitlines() and "injected: true" not in header
    snippet = _python_snippet(card)
    calls = [n for n in ast.walk(snippet) if isinstance(n, ast.Call)]
    assert len(calls) == 2 and all(isinstance(c.func, ast.Attribute) and c.func.attr == "from_pretrained" for c in calls)
    assert all(len(c.args) == 1 and isinstance(c.args[0], ast.Constant) and c.args[0].value == name for c in calls)
    assert not any(isinstance(n, ast.Name) and n.id == "__import__" for n in ast.walk(snippet))
    tables = [line for line in body.splitlines() if line.startswith("| ")]
    assert all(len(re.findall(r"(?<!\\)\|", line)) in (3, 8) for line in tables)  # no cell split by a value


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


# ---------------------------------------------- issue 51: a card the Hub reads, with what a researcher needs


def test_the_release_card_passes_huggingface_hub_s_parsing_with_every_field(ws):
    """huggingface_hub's ModelCard reads the card: its name (release.name), the validation loss and
    perplexity, each figure with its standard error as its args (no extra metric rows), the
    contexts cut per task; the text has the usage with that name, limitations naming the cut
    task, the citation and the code's repository, the resolved precision and per-character ce_loss."""
    from huggingface_hub import ModelCard

    from pipeline.stages.evaluate import converted_model_identity
    from tests.pipeline.stages.test_release import TASK, ready_to_release

    ready_to_release(ws)
    mmlu = {**TASK, "primary": "len_norm", "docs": 100.0, "ce_loss_v2": 1.25, "ce_loss_v2/stderr": 0.05}
    mmlu |= {"truncated_docs": 67.0, "truncated_requests": 268.0, "truncated_tokens_max": 6760.0, "truncated_tokens_total": 9e4}
    detail = {"format": "moe-eval/1", "step": 8, "val_loss": 3.0, "val_perplexity": 20.0855, "val_tokens": 4096.0}
    detail |= {"tasks": {"arc_easy": TASK, "mmlu_stem_mc_5shot": mmlu}, "converted_sha256": converted_model_identity(ws / "runs/hf")}
    name, repo = "my-lab/olmoe-tiny", "https://github.com/my-lab/moe-pipeline"
    _released(load([f"release.name={name}", f"release.repository={repo}"]), detail)

    card = ModelCard.load(Path("runs/release/README.md"))
    assert card.data.model_name == name and card.data.library_name == "transformers"
    results = {(r.dataset_name, r.metric_type): r for r in card.data.eval_results}
    val = "held-out split of the training data"
    assert results[(val, "loss")].metric_value == 3.0 and results[(val, "perplexity")].metric_value == 20.0855
    assert not [k for k in results if "stderr" in k[1]]  # standard errors ride with their figures
    assert results[("arc_easy", "acc")].metric_args == {"stderr": 0.04, "documents": 123, "truncated_documents": 0, "dropped_documents": 0}
    cut = results[("mmlu_stem_mc_5shot", "len_norm")]
    assert cut.metric_args == {"stderr": 0.04, "documents": 100, "truncated_documents": 67, "dropped_documents": 0}
    assert cut.dataset_args == {"num_few_shot": 5} and cut.dataset_type == "cais/mmlu"
    assert results[("mmlu_stem_mc_5shot", "ce_loss")].metric_name == "cross-entropy of the gold answer per character (nats)"

    text = card.text
    assert f"AutoModelForCausalLM.from_pretrained('{name}'), AutoTokenizer.from_pretrained('{name}')" in text
    assert "Validation loss 3.0000 nats per token (perplexity 20.09) over 4,096 tokens" in text
    assert "| mmlu_stem_mc_5shot | len_norm | 0.3000 ± 0.0400 | 0.2500 | 100 | 67 (up to 6760 tokens) | 5 |" in text
    assert "| arc_easy | acc | 0.3100 ± 0.0400 | 0.2500 | 123 | 0 | 0 |" in text
    limitations = text.split("## Limitations", 1)[1].split("##", 1)[0]
    assert "mmlu_stem_mc_5shot 67 (up to 6760 tokens)" in limitations and "arc_easy" not in limitations
    citation = text.split("## Citation", 1)[1]
    assert repo in citation and "Supercharging Olmo-core for Efficient and Scalable MoE Training" in citation
    assert "| precision | fp32 (precision.recipe auto on cpu) |" in text  # resolved, from the checkpoint's record
    assert "nats per token)" not in text.replace("Validation loss 3.0000 nats per token (", "")  # ce_loss is per character


def test_without_release_name_the_card_is_named_after_the_run_and_cites_no_made_up_repository(ws):
    from huggingface_hub import ModelCard

    from tests.pipeline.stages.test_release import ready_to_release

    ready_to_release(ws)
    _released(load(), json.loads(Path("metrics/eval_detail.json").read_text()))
    card = ModelCard.load(Path("runs/release/README.md"))
    assert card.data.model_name == "olmoe-tiny-step8" and "from_pretrained('olmoe-tiny-step8')" in card.text
    assert "from_pretrained('release')" not in card.text and "set `release.repository`" in card.text  # ws is no git clone
    assert "No evaluated context was cut" in card.text


@pytest.mark.parametrize("value", ["my lab/olmoe", "a--b", "x/y/z", "../weights", "olmoe.git"])
def test_a_bad_release_name_is_one_error_line_naming_the_key(value):
    import subprocess
    import sys

    from tests.workspace import REPO

    r = subprocess.run([sys.executable, "-m", "pipeline.cli", "params", "--set", f"release.name={value}"], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith("error: --set release.name: must be a Hugging Face Hub model name"), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
