"""The evaluate stage: ours against transformers, on the trained workspace."""

import json
from pathlib import Path

from tests.workspace import load


def test_evaluation_agrees_with_transformers(in_trained):
    from pipeline.stages.convert import convert_to_hf, load_tokens_tokenizer
    from pipeline.stages.evaluate import run_evaluate

    cfg = load(["convert.output=hf_eval", "evaluate.output=metrics/eval_t.json"])
    convert_to_hf("runs/train/checkpoints", "hf_eval", load_tokens_tokenizer("data/tokens"))
    m = run_evaluate(cfg)
    assert m["hf_rel_diff"] < 1e-4
    assert m["generation_matches_hf"] == 1.0
    assert m["val_perplexity"] > 1 and m["eval_tokens_per_s"] > 0
    written = json.loads(Path("metrics/eval_t.json").read_text())
    assert written["val_loss"] == m["val_loss"]
    assert Path("metrics/eval_t_sample.txt").read_text().startswith("def ")
    assert m["val_windows"] == 4 < m["val_windows_total"]  # evaluate.max_batches=2 of batch 2: named as a subset

    whole = run_evaluate(load(["convert.output=hf_eval", "evaluate.output=metrics/eval_w.json", "evaluate.max_batches=null"]))
    assert whole["val_windows"] == whole["val_windows_total"] == m["val_windows_total"]
    assert whole["val_tokens"] > m["val_tokens"]


def test_evaluate_defaults_to_the_whole_split():
    from pipeline.params import EvaluateConfig

    assert EvaluateConfig().max_batches is None
