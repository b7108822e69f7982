"""The converted directory's model card: the Hub's YAML header, the in-loop evaluation of the
checkpoint's step, a base model when the run continued from one; transformers loads the
directory with the card in it."""

import json
from pathlib import Path

import pytest
import yaml

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
