"""Evaluate stage: validation loss and perplexity, and the downstream tasks OLMo judges models
by (evaluate.tasks, pipeline/eval), from our model and from the converted checkpoint loaded
through transformers: they must agree, per task too. Evaluation speed, a greedy sample from
both. With checkpoints named (`moe evaluate --checkpoint A --checkpoint B`), our model alone at
each of them: a curve over training, without a conversion."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from moe.data import TokenDataset
from moe.eval.metrics import RANKED, combined_stderr, task_metrics
from moe.eval.requests import TaskRequests
from moe.eval.suite import evaluate_suite, headline
from moe.model import Transformer
from moe.parallel.env import pick_device
from moe.reader import Int, List, Map, Nullable, Num, Plain, Str, read_json
from moe.train.checkpoint import read_meta, resolve_checkpoint
from moe.train.sinks import read_metric_rows
from moe.train.weights import load_model
from pipeline.dvc_views import EVAL_HEADLINE, check_headline, write_headline
from pipeline.errors import PipelineError
from pipeline.eval.requests import prepare_tasks
from pipeline.eval.tasks import TABLE, TASKS
from pipeline.outputs import check_output_file, json_keys_within, sha256_file, write_output_file
from pipeline.params import PipelineConfig
from pipeline.plots import checkpoint_curve_figure, downstream_figure, validation_figure
from pipeline.progress import Every, seconds
from pipeline.stage_spec import Output, Stage
from pipeline.stages.convert import check_checkpoint_tokenizer, check_hf_dir
from pipeline.stages.tokenize import read_manifest
from pipeline.tokenizer import load_tokenizer

log = logging.getLogger("pipeline.evaluate")


@torch.no_grad()
def mean_loss(forward, batches: list[torch.Tensor]) -> tuple[float, int, float]:
    """(mean token loss, tokens, seconds) over the batches."""
    total, count = 0.0, 0
    start = time.perf_counter()
    for batch in batches:
        logits = forward(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].reshape(-1), reduction="sum")
        total += loss.item()
        count += batch[:, 1:].numel()
    return total / count, count, time.perf_counter() - start


@torch.no_grad()
def greedy(model: Transformer, prompt: list[int], new_tokens: int, eos_id: int, device: torch.device) -> list[int]:
    ids = list(prompt)
    for _ in range(new_tokens):
        if len(ids) >= model.cfg.max_seq_len:
            break
        logits = model(torch.tensor([ids], device=device))
        nxt = int(logits[0, -1].argmax())
        ids.append(nxt)
        if nxt == eos_id:
            break
    return ids[len(prompt) :]


def generation_length(requested: int, prompt_len: int, max_seq_len: int) -> tuple[int, bool]:
    """(tokens to generate, whether evaluate.generate_tokens was cut to what the model allows)."""
    room = max_seq_len - prompt_len
    if room < 1 and requested > 0:
        raise PipelineError(
            f"evaluate.prompt: {prompt_len} tokens leave no room to generate within the model's {max_seq_len} positions (model.max_seq_len)"
        )
    new_tokens = min(requested, room)
    if new_tokens < requested:
        log.warning(
            "evaluate.generate_tokens=%d: the model has %d positions (model.max_seq_len), %d after the %d-token prompt; generating %d",
            requested,
            max_seq_len,
            new_tokens,
            prompt_len,
            new_tokens,
        )
    return new_tokens, new_tokens < requested


def load_hf_model(hf_dir: Path, device: torch.device):
    """transformers' model of a directory that passed our validator first: from_pretrained initialises
    a missing tensor at random, and fails deep inside on a config that disagrees with the weights."""
    from transformers import AutoModelForCausalLM

    if not (hf_dir / "config.json").is_file():
        raise PipelineError(f"{hf_dir}: no converted model; run the convert stage first (moe convert)")
    check_hf_dir(hf_dir)
    hf, info = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, output_loading_info=True)
    if type(hf).__name__ != "OlmoeForCausalLM":
        raise PipelineError(f"{hf_dir}: transformers loaded {type(hf).__name__}, not OlmoeForCausalLM")
    if info["missing_keys"] or info["mismatched_keys"]:  # our names and transformers' disagree: never run on random weights
        raise PipelineError(f"{hf_dir}: transformers did not load {sorted(info['missing_keys'] or info['mismatched_keys'])[:3]}")
    return hf.to(device).eval()


EVAL_METRIC_KEYS = {
    "val_loss",
    "val_perplexity",
    "hf_val_loss",
    "hf_rel_diff",
    "val_tokens",
    "val_windows",
    "val_windows_total",
    "eval_tokens_per_s",
    "hf_eval_tokens_per_s",
    "generation_matches_hf",
    "generate_tokens",
    "generation_capped",
    "sample_sha256",
    "tasks",
    "suite",
    "checkpoint",
    "step",
    "format",
    "converted_sha256",
}
# evaluate.output (a DVC metric): the few numbers a table shows; per task and the rest beside it in _detail.json
SUMMARY_KEYS = {"step", "val_loss", "val_perplexity", "hf_rel_diff", "generation_matches_hf", "suite"}
recognise_metrics = json_keys_within(SUMMARY_KEYS, SUMMARY_KEYS)  # summary_metrics writes every one
DETAIL_FORMAT = "moe-eval/1"


_METRIC_NAME = Str(64, r"[a-z][a-z0-9_]*(/stderr)?")
_HEX64 = Str(64, r"[0-9a-f]{64}")
# One task's figures (compare_downstream): every metric a finite number, its standard error
# beside it; the documents scored, dropped and cut; chance and majority in [0, 1]; ours and
# transformers' headlines over the documents both scored.
_TASK = Map(
    required={"primary": Str(32, r"[a-z_]+"), "docs": Num(0, 1e9)},
    optional={
        "chance": Num(0, 1),
        "majority": Num(0, 1),
        "subjects": Num(0, 1e6),
        "about": Str(512),
        "hf": Map(other=Num(), keys=_METRIC_NAME, max_keys=64),
        "ours_on_hf_docs": Map(other=Num(), keys=_METRIC_NAME, max_keys=64),
        "sample_seed": Nullable(Int(0)),
        "doc_ids": List(Int(0), max_len=10**7),
        "docs_total": Num(0, 1e9),
        "dropped_docs": Num(0, 1e9),
        "truncated_docs": Num(0, 1e9),
        "truncated_requests": Num(0, 1e10),
        "truncated_tokens_max": Num(0, 1e9),
        "truncated_tokens_total": Num(0, 1e12),
        "requests": Num(0, 1e10),
        "seconds": Num(0),
    },
    other=Num(),
    keys=_METRIC_NAME,
    max_keys=256,
)
MAX_DETAIL_TASKS = 1000  # the task table's suites hold ~100; more is not an evaluation of ours
DETAIL_SCHEMA = Map(
    required={
        "format": Str(choices=(DETAIL_FORMAT,)),
        "step": Int(0),
        "tasks": Map(other=_TASK, keys=Str(128, r"[A-Za-z0-9_.:-]+"), max_keys=MAX_DETAIL_TASKS),
    },
    optional={
        "converted_sha256": Nullable(_HEX64),
        "sample_sha256": _HEX64,
        "suite": Map(other=Num(), keys=_METRIC_NAME, max_keys=64),
        "checkpoint": Str(4096),
        **{k: Num() for k in EVAL_METRIC_KEYS - {"format", "step", "tasks", "converted_sha256", "sample_sha256", "suite", "checkpoint"}},
    },
)
MAX_DETAIL_BYTES = 256 * 2**20


def read_detail(path: Path) -> dict[str, Any]:
    """The evaluate stage's detail file, every field checked (FileFormatError names the field)."""
    return read_json(path, DETAIL_SCHEMA, MAX_DETAIL_BYTES)


def recognise_detail(path: Path) -> bool:
    """Our detail file names its format (and holds no key of another schema)."""
    if not json_keys_within(EVAL_METRIC_KEYS, {"val_loss", "format"})(path):
        return False
    return read_json(path, Plain(), MAX_DETAIL_BYTES).get("format") == DETAIL_FORMAT


def output_paths(cfg: PipelineConfig) -> tuple[Path, Path]:
    out = Path(cfg.evaluate.output)
    return out, out.with_name(out.stem + "_sample.txt")


def detail_path(out: Path) -> Path:
    return out.with_name(out.stem + "_detail.json")


def recognise_sample(path: Path) -> bool:
    """Our sample: the detail file beside it records its sha256."""
    detail = detail_path(path.with_name(path.name[: -len("_sample.txt")] + ".json"))
    return detail.is_file() and read_json(detail, Plain(), MAX_DETAIL_BYTES).get("sample_sha256") == sha256_file(path)


def summary_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    """What `dvc metrics show` and `dvc exp show` print: numbers only, a dozen columns (the
    validation loss, the agreement with transformers, the suite's means); every task's numbers
    are in the detail file, MLflow and the CLI's table."""
    out = {k: metrics[k] for k in ("step", "val_loss", "val_perplexity", "hf_rel_diff", "generation_matches_hf")}
    out["suite"] = {k: v for k, v in metrics["suite"].items() if k != "seconds"}
    return out


def eval_tasks(cfg: PipelineConfig, tok_info, max_len: int) -> list[TaskRequests]:
    """evaluate.tasks tokenised: evaluate.limit's seeded sample, evaluate.truncation's choice."""
    e = cfg.evaluate
    return prepare_tasks(
        e.tasks,
        tok_info,
        limit=e.limit,
        data_dir=e.data_dir,
        key="evaluate.tasks",
        max_len=max_len,
        seed=e.seed,
        truncation_mode=e.truncation,
        truncation_key="evaluate.truncation",
    )


def check_inputs(cfg: PipelineConfig, checkpoint: str, out: Path, sample_path: Path):
    """Before any work: the outputs are ours to replace (never a user's file), the tokenizer is
    its manifest's, and the checkpoint was trained on that tokenizer's data. Returns the tokenizer."""
    check_output_file(out, "evaluate.output", recognise_metrics)
    check_output_file(detail_path(out), "evaluate.output (its _detail.json)", recognise_detail)
    check_output_file(sample_path, "evaluate.output (its _sample.txt)", recognise_sample)
    check_headline(out, EVAL_HEADLINE)
    manifest = read_manifest(cfg.tokenize.output)
    tok_file = Path(cfg.tokenize.output) / "tokenizer.json"
    tok_info = load_tokenizer(tok_file)
    if tok_info.sha256 != manifest["tokenizer"]["sha256"]:
        raise PipelineError(f"{cfg.tokenize.output}/tokenizer.json does not match its manifest (tokenizer hash differs)")
    check_checkpoint_tokenizer(checkpoint, tok_info, tok_file)  # the data is that tokenizer's (TokenDataset checks)
    return tok_info


def compare_generation(ours, hf, tok_info, cfg: PipelineConfig, device) -> tuple[str, int, bool, bool]:
    """Greedy generation from evaluate.prompt by both models: (our sample text, tokens generated,
    whether the model's length capped them, whether transformers generated the same ids)."""
    tok = tok_info.build()
    prompt = tok.encode(cfg.evaluate.prompt, add_special_tokens=False).ids or [tok_info.eos_id]
    # transformers generates past its max_position_embeddings: both stop where the model does
    max_len = min(ours.cfg.max_seq_len, hf.config.max_position_embeddings)
    new_tokens, capped = generation_length(cfg.evaluate.generate_tokens, len(prompt), max_len)
    ours_ids = greedy(ours, prompt, new_tokens, tok_info.eos_id, device)
    hf_ids: list[int] = []
    if new_tokens:  # transformers refuses max_new_tokens=0
        hf_out = hf.generate(
            torch.tensor([prompt], device=device),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=tok_info.eos_id,
            pad_token_id=tok_info.pad_id if tok_info.pad_id is not None else tok_info.eos_id,
        )
        hf_ids = hf_out[0, len(prompt) :].tolist()
    return cfg.evaluate.prompt + tok.decode(ours_ids, skip_special_tokens=False), new_tokens, capped, ours_ids == hf_ids


def run_evaluate(cfg: PipelineConfig, tracker=None, checkpoint: str | None = None, hf_dir: str | None = None) -> dict[str, Any]:
    try:
        device = pick_device(cfg.evaluate.device, key="evaluate.device")
    except RuntimeError as exc:
        raise PipelineError(str(exc)) from None
    checkpoint = checkpoint or cfg.checkpoint.dir
    hf_dir = Path(hf_dir or cfg.convert.output)
    out, sample_path = output_paths(cfg)
    tok_info = check_inputs(cfg, checkpoint, out, sample_path)
    print(f"evaluating {checkpoint} and its conversion {hf_dir}: validation loss, then evaluate.tasks ({' '.join(cfg.evaluate.tasks)})", flush=True)

    ours = load_model(checkpoint, device)
    tasks = eval_tasks(cfg, tok_info, ours.cfg.max_seq_len)  # every check before a model runs
    hf = load_hf_model(hf_dir, device)

    seq_len = min(cfg.data.seq_len, ours.cfg.max_seq_len)
    val = TokenDataset([str(Path(cfg.tokenize.output) / "val")], seq_len, tokenizer_hash=tok_info.sha256)
    limit = cfg.evaluate.max_batches
    n = len(val) if limit is None else min(len(val), cfg.evaluate.batch_size * limit)
    index = np.arange(n)
    batches = [val.batch(index[i : i + cfg.evaluate.batch_size]).to(device) for i in range(0, n, cfg.evaluate.batch_size)]

    loss, tokens, seconds = mean_loss(ours, batches)
    hf_loss, _, hf_seconds = mean_loss(lambda x: hf(x).logits, batches)
    rel = abs(loss - hf_loss) / max(abs(hf_loss), 1e-12)
    if not rel <= cfg.evaluate.max_rel_diff:
        raise PipelineError(
            f"our validation loss {loss:.6f} and transformers' {hf_loss:.6f} differ by {rel:.2e} "
            f"(> evaluate.max_rel_diff={cfg.evaluate.max_rel_diff}): the conversion is wrong"
        )

    pad = tok_info.pad_id if tok_info.pad_id is not None else tok_info.eos_id
    downstream = compare_downstream(ours, hf, tasks, cfg, device, pad)

    sample, new_tokens, capped, matches = compare_generation(ours, hf, tok_info, cfg, device)

    metrics = {
        "val_loss": loss,
        "val_perplexity": math.exp(min(loss, 80.0)),
        "hf_val_loss": hf_loss,
        "hf_rel_diff": rel,
        "val_tokens": tokens,
        # the windows evaluated and the split's total: equal unless evaluate.max_batches cut it
        "val_windows": n,
        "val_windows_total": len(val),
        "eval_tokens_per_s": tokens / seconds,
        "hf_eval_tokens_per_s": tokens / hf_seconds,
        "generation_matches_hf": float(matches),
        # the sample's length limit: evaluate.generate_tokens, or less where the model ends first
        "generate_tokens": new_tokens,
        "generation_capped": float(capped),
    }
    metrics["format"] = DETAIL_FORMAT
    metrics["step"] = int(read_meta(checkpoint)["step"])
    # which converted directory these numbers are of (its conversion record's sha256): `moe release`
    # puts them on that directory's card only
    metrics["converted_sha256"] = converted_model_identity(hf_dir)
    metrics["tasks"] = downstream
    metrics["suite"] = suite_summary(downstream)
    metrics["sample_sha256"] = hashlib.sha256((sample + "\n").encode()).hexdigest()
    write_output_file(sample_path, sample + "\n", "evaluate.output (its _sample.txt)", recognise_sample)  # first: the detail vouches for it
    write_output_file(detail_path(out), json.dumps(metrics, indent=2) + "\n", "evaluate.output (its _detail.json)", recognise_detail)
    write_output_file(out, json.dumps(summary_metrics(metrics), indent=2) + "\n", "evaluate.output", recognise_metrics)
    write_headline(out, metrics, EVAL_HEADLINE)  # what `dvc metrics show` prints (pipeline/dvc_views.py)
    train_rows = Path(cfg.executor.run_dir) / "metrics.jsonl"
    validation_figure(read_metric_rows(train_rows) if train_rows.is_file() else [], loss, hf_loss)
    downstream_figure(downstream)
    if tracker:
        identity = converted_model_identity(hf_dir)
        model_id = tracker.find_model(identity) if identity else None
        tracker.log_metrics(flat_metrics(metrics), model_id=model_id)  # also the logged model's scores
        if model_id:
            tracker.set_tags({"moe.model_id": model_id})
        tracker.log_artifact(sample_path)
        tracker.log_artifact(out)
        tracker.log_artifact(detail_path(out))
    return {**metrics, "sample": sample}


# ------------------------------------------------------------------ downstream tasks


def compare_downstream(ours, hf, tasks, cfg: PipelineConfig, device: torch.device, pad: int) -> dict[str, dict[str, Any]]:
    """Every task on our model; transformers' on each task's first ``evaluate.compare_docs``
    documents, where ours must agree with it within evaluate.max_rel_diff (the mean gold
    log-likelihood per byte, bpb, over the same documents): a conversion check, so it need not
    rescore every document."""
    max_len = ours.cfg.max_seq_len
    common = {"max_len": max_len, "device": device, "batch_tokens": cfg.evaluate.batch_tokens, "pad_id": pad}
    due = Every()  # one line per task would be 2 x evaluate.tasks lines: one per 10 s says as much
    mine, scores = evaluate_suite(lambda x: ours(x), tasks, **common, progress=_progress("ours", due))
    subsets = [first_documents(t, cfg.evaluate.compare_docs) for t in tasks]
    theirs, _ = evaluate_suite(lambda x: hf(x).logits, [sub for sub, _ in subsets], **common, progress=_progress("transformers", due))
    out: dict[str, dict[str, Any]] = {}
    for t, (sub, index) in zip(tasks, subsets, strict=True):
        m, h = mine[t.name], theirs[t.name]
        same = task_metrics(sub.requests, {j: scores[t.name][i] for j, i in enumerate(index) if i in scores[t.name]}, sub.metric)
        rel = abs(same["bpb_v2"] - h["bpb_v2"]) / max(abs(h["bpb_v2"]), 1e-12)
        if not rel <= cfg.evaluate.max_rel_diff:
            raise PipelineError(
                f"task {t.name}: our bpb {same['bpb_v2']:.6f} and transformers' {h['bpb_v2']:.6f} over its first "
                f"{h['docs']:.0f} documents differ by {rel:.2e} (> evaluate.max_rel_diff={cfg.evaluate.max_rel_diff}): the conversion is wrong"
            )
        hf_line = {**headline(h, t.metric), "docs": h["docs"]}
        ours_line = {t.metric: same[f"{t.metric}_v2"], "bpb": same["bpb_v2"], "docs": same["docs"]}  # what the figure sets beside hf
        out[t.name] = {**m, "primary": t.metric, "about": TASKS[t.name].about, "hf": hf_line, "ours_on_hf_docs": ours_line, "hf_rel_diff": rel}
        if t.sample is not None:  # evaluate.limit's sample: which documents, so a reader can rescore them
            out[t.name].update(sample_seed=cfg.evaluate.seed, doc_ids=list(t.sample))
        if t.dropped:
            out[t.name]["dropped_doc_ids"] = list(t.dropped)
    return out


def first_documents(task: TaskRequests, docs: int | None) -> tuple[TaskRequests, list[int]]:
    """The task cut to its first ``docs`` documents (all: None), and each kept request's index."""
    if docs is None:
        return task, list(range(len(task.requests)))
    keep: set[int] = set()
    for r in task.requests:
        if len(keep) == docs:
            break
        keep.add(r.doc_id)
    index = [i for i, r in enumerate(task.requests) if r.doc_id in keep]
    return dataclasses.replace(task, requests=tuple(task.requests[i] for i in index)), index


def _progress(model: str, due: Every):
    def say(line: str) -> None:
        if due():
            print(f"  [{model}] {line}", flush=True)

    return say


def suite_summary(downstream: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Means over the tasks, each of one kind of figure (a mean of plain and length-normalised
    accuracies is neither): ``acc_mean`` over the tasks whose primary metric is plain accuracy,
    ``len_norm_mean`` over those ranked by length-normalised accuracy, each with its tasks'
    chance and majority means beside it; ``bpb_mean`` over every task; and MMLU over its subjects
    (``mmlu_macro``), as OLMES reports it. Standard errors from the tasks' (independent samples:
    sqrt(sum se^2) / k). Where a context did not fit the model, the documents cut
    (``truncated_docs``) or left out (``dropped_docs``) over all the tasks stand beside them."""
    out = {
        "tasks": float(len(downstream)),
        "docs": float(sum(r["docs"] for r in downstream.values())),
        "seconds": float(sum(r["seconds"] for r in downstream.values())),
    }
    for count in ("truncated_docs", "dropped_docs"):  # beside the means where a context did not fit (each task's: its record)
        total = sum(r.get(count, 0.0) for r in downstream.values())
        if total:
            out[count] = float(total)
    for kind in RANKED:
        rows = [r for r in downstream.values() if r["primary"] == kind]
        if rows:
            out[f"{kind}_tasks"] = float(len(rows))
            out[f"{kind}_mean"] = sum(r[f"{kind}_v2"] for r in rows) / len(rows)
            out[f"{kind}_mean/stderr"] = combined_stderr([r[f"{kind}_v2/stderr"] for r in rows])
            for base in ("chance", "majority"):
                if all(base in r for r in rows):
                    out[f"{kind}_{base}_mean"] = sum(r[base] for r in rows) / len(rows)
    if downstream:
        out["bpb_mean"] = sum(r["bpb_v2"] for r in downstream.values()) / len(downstream)
        out["bpb_mean/stderr"] = combined_stderr([r["bpb_v2/stderr"] for r in downstream.values()])
    out.update(mmlu_means(downstream))
    return out


def mmlu_means(downstream: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Per MMLU formulation in the suite (its category tasks, e.g. mmlu_<category>_mc_5shot ->
    ``mmlu_mc_5shot``): the primary metric as OLMES averages MMLU, over the subjects (each task's
    mean over its subjects weighted by how many it has: the mean over all of them), its standard
    error, the subjects, and the mean over the documents beside it (how OLMo's in-loop logs it)."""
    formulations: dict[str, list[dict[str, Any]]] = {}
    for name, r in downstream.items():
        spec = TABLE["mmlu"].get(name)
        if spec and r.get("subjects") and f"{r['primary']}_v2_macro" in r:
            formulations.setdefault(name.replace(f"_{spec['category']}", "", 1), []).append(r)
    out = {}
    for label, rows in sorted(formulations.items()):
        key = f"{rows[0]['primary']}_v2"
        k = sum(r["subjects"] for r in rows)
        out[f"{label}_macro"] = sum(r["subjects"] * r[f"{key}_macro"] for r in rows) / k
        out[f"{label}_macro/stderr"] = math.sqrt(sum((r["subjects"] * r[f"{key}_macro/stderr"]) ** 2 for r in rows)) / k
        out[f"{label}_subjects"] = float(k)
        out[f"{label}_docs_mean"] = sum(r["docs"] * r[key] for r in rows) / sum(r["docs"] for r in rows)
    return out


def converted_model_identity(hf_dir: Path) -> str:
    """A converted model's identity: the sha256 of its conversion record (which lists every
    file's digest), the same for the convert stage that logs it and the evaluate stage that
    scores it."""
    from pipeline.stages.convert import MARKER

    record = hf_dir / MARKER
    return sha256_file(record) if record.is_file() else ""


def flat_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """eval.json as MLflow metrics: task/<name>/<metric> (a standard error as
    task/<name>/<metric>/stderr), suite/<figure>, the rest as they are."""
    flat = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    for name, r in metrics.get("tasks", {}).items():
        for k, v in r.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "sample_seed":
                flat[f"task/{name}/{k}"] = v
        for k, v in r.get("hf", {}).items():
            flat[f"task/{name}/hf_{k}"] = v
    flat.update({f"suite/{k}": v for k, v in metrics.get("suite", {}).items()})
    return flat


def run_checkpoint_curve(cfg: PipelineConfig, checkpoints: list[str], tracker=None) -> dict[str, Any]:
    """Our model at each checkpoint (no conversion needed): validation loss and the tasks, by step."""
    device = pick_device(cfg.evaluate.device, key="evaluate.device")
    out = Path(cfg.evaluate.output)
    curve_path = out.with_name(out.stem + "_checkpoints.json")
    check_output_file(curve_path, "evaluate.output (its _checkpoints.json)", recognise_curve)
    tok_file = Path(cfg.tokenize.output) / "tokenizer.json"
    tok_info = load_tokenizer(tok_file)
    for c in checkpoints:
        check_checkpoint_tokenizer(c, tok_info, tok_file)
    converted = {c: read_meta(c).get("source") for c in checkpoints if read_meta(c).get("source")}
    if converted and len(checkpoints) > 1:  # its "step 0" is not a step of the run beside it
        c, source = next(iter(converted.items()))
        raise PipelineError(
            f"--checkpoint: {c} was converted from the Hugging Face model {source} (`moe convert --from-hf`), not saved by "
            "training: it has no training step to plot beside the others; evaluate it on its own (one --checkpoint)"
        )
    by_step = {int(read_meta(c)["step"]): str(resolve_checkpoint(c)) for c in checkpoints}
    if len(by_step) < len(checkpoints):
        raise PipelineError("--checkpoint: two of the checkpoints are at the same step; name each step once")
    checkpoints = [by_step[s] for s in sorted(by_step)]  # MLflow's history in step order
    steps, names = ", ".join(str(s) for s in sorted(by_step)), " ".join(cfg.evaluate.tasks)
    print(f"evaluating {len(checkpoints)} checkpoints (steps {steps}): validation loss and evaluate.tasks ({names})", flush=True)
    first = read_meta(checkpoints[0])["config"]["model"]["max_seq_len"]
    tasks = eval_tasks(cfg, tok_info, first)
    pad = tok_info.pad_id if tok_info.pad_id is not None else tok_info.eos_id
    points = []
    due, began = Every(), time.monotonic()
    for i, c in enumerate(checkpoints):
        model = load_model(c, device)
        seq_len = min(cfg.data.seq_len, model.cfg.max_seq_len)
        val = TokenDataset([str(Path(cfg.tokenize.output) / "val")], seq_len, tokenizer_hash=tok_info.sha256)
        n = len(val) if cfg.evaluate.max_batches is None else min(len(val), cfg.evaluate.batch_size * cfg.evaluate.max_batches)
        index = np.arange(n)
        batches = [val.batch(index[i : i + cfg.evaluate.batch_size]).to(device) for i in range(0, n, cfg.evaluate.batch_size)]
        loss, _, _ = mean_loss(model, batches)
        step = int(read_meta(c)["step"])
        results, _ = evaluate_suite(
            lambda x, m=model: m(x),
            tasks,
            max_len=model.cfg.max_seq_len,
            device=device,
            batch_tokens=cfg.evaluate.batch_tokens,
            pad_id=pad,
            progress=_progress(f"step {step}", due),
        )
        point = {
            "step": step,
            "checkpoint": str(resolve_checkpoint(c)),
            "val_loss": loss,
            "tasks": {t.name: headline(results[t.name], t.metric) for t in tasks},
        }
        if read_meta(c).get("source"):
            point["converted_from"] = read_meta(c)["source"]  # step 0 of no training run
        points.append(point)
        each = (time.monotonic() - began) / (i + 1)
        left = len(checkpoints) - i - 1
        done = f"  checkpoint {i + 1} of {len(checkpoints)} (step {step}) evaluated"
        print(f"{done}: {seconds(each)} each, about {seconds(each * left)} left", flush=True)
        if tracker:
            tracker.log_metrics({"val_loss": loss, **{f"task/{n}/{k}": v for n, r in point["tasks"].items() for k, v in r.items()}}, step=step)
    payload = {"format": "moe-eval-checkpoints/1", "points": points}
    write_output_file(curve_path, json.dumps(payload, indent=2) + "\n", "evaluate.output (its _checkpoints.json)", recognise_curve)
    checkpoint_curve_figure(points)
    return payload


def recognise_curve(path: Path) -> bool:
    data = read_json(path, Plain())
    return isinstance(data, dict) and data.get("format") == "moe-eval-checkpoints/1" and set(data) == {"format", "points"}


# What dvc.yaml runs, reads and writes for this stage, and the code it runs (pipeline/stage_spec.py).
STAGE = Stage(
    name="evaluate",
    params=("evaluate",),
    deps=("runs/hf", "runs/train", "data/tokens"),
    outputs=(
        Output("metrics/headline/eval.json"),
        Output("metrics/eval.json"),
        Output("metrics/eval_sample.txt", recognise_sample),
        Output("metrics/eval_detail.json", recognise_detail),
        Output("plots/eval"),
    ),
    code=(
        "pipeline/stages/evaluate.py",
        "moe/eval",
        "pipeline/dvc_views.py",
        "pipeline/eval",
        "pipeline/plots.py",
        "pipeline/progress.py",
        "pipeline/redact.py",
        "pipeline/stages/convert.py",
        "pipeline/stages/tokenize.py",
        "pipeline/corpus.py",
        "pipeline/errors.py",
        "pipeline/hub.py",
        "pipeline/outputs.py",
        "pipeline/params.py",
        "pipeline/repository.py",
        "pipeline/tokenizer.py",
    ),
)
