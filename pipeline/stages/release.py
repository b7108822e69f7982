"""Release stage: the converted model with its final evaluation on the model card.

The convert stage writes its card before evaluate has run, so that card can hold only the in-loop
numbers. After evaluate, this stage writes ``release.output`` (runs/release): copies of the converted
files (copy-on-write clones where the filesystem offers them, never hard links: editing the
release must not change runs/hf) and a README.md with the evaluate stage's numbers for exactly
that directory: the detail file names the conversion record's sha256, and any other pairing is
refused. The conversion record's file names are taken only inside runs/hf, and the release is
never put inside another stage's output (it would block that stage's next run). Written to a
temporary directory and renamed, like convert.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from moe.config import ModelConfig
from moe.eval.suite import headline
from moe.reader import FileFormatError, read_json
from moe.train.checkpoint import CheckpointError, read_meta
from pipeline.errors import PipelineError
from pipeline.eval.tasks import TASKS, task_source
from pipeline.model_card import CardEvaluation
from pipeline.outputs import (
    MAX_RECORD_BYTES,
    check_own_output,
    clone_file,
    enclosing_output,
    fresh_temp_dir,
    inside,
    replace_own_output,
    seal_output,
    write_atomic,
)
from pipeline.stage_spec import Output, Stage
from pipeline.stages.convert import CONVERSION_RECORD_SCHEMA
from pipeline.stages.convert import MARKER as CONVERTED
from pipeline.stages.evaluate import converted_model_identity, detail_path, read_detail, recognise_detail

MARKER = "moe_release.json"  # marks a directory as our release output (replaceable)
TOKENS_MANIFEST = "manifest.json"  # the tokenize stage's record
STAGE_RECORDS = (MARKER, CONVERTED, TOKENS_MANIFEST)  # a directory holding one is a stage's output


# what a card says of a task's contexts that did not fit the model (the detail file's counts)
CUT_COUNTS = ("truncated_docs", "truncated_tokens_max", "dropped_docs")


def final_evaluation(detail: dict[str, Any], data_dir: str | None) -> CardEvaluation:
    """The card's evaluation from the evaluate stage's detail file: the validation loss and
    perplexity; each task's headline figures (primary metric, accuracy, bpb, each with its
    standard error), documents, chance and the documents whose context was cut or left out."""
    tasks, docs, chance, cut = {}, {}, {}, {}
    for name, r in (detail.get("tasks") or {}).items():
        metric = TASKS[name].metric if name in TASKS else "bpb"
        tasks[name] = {k: float(v) for k, v in headline(r, metric).items()}
        docs[name] = int(r["docs"])
        if "chance" in r:
            chance[name] = float(r["chance"])
        cut[name] = {k: float(r.get(k, 0.0)) for k in CUT_COUNTS}
    validation = {k: float(detail[k]) for k in ("val_loss", "val_perplexity", "val_tokens") if k in detail}
    sources = {t: task_source(t, data_dir) for t in tasks}
    return CardEvaluation(int(detail["step"]), True, tasks, docs, chance, sources, validation=validation, cut=cut)


def other_outputs(cfg) -> dict[str, Path]:
    """The directories the other stages write, by the key (or DVC output) that names each."""
    from pipeline.plots import EVAL_DIR, TRAIN_DIR

    return {
        "tokenize.output": Path(cfg.tokenize.output),
        "executor.run_dir": Path(cfg.executor.run_dir),
        "checkpoint.dir": Path(cfg.checkpoint.dir),
        "convert.output": Path(cfg.convert.output),
        f"the train stage's {TRAIN_DIR}": TRAIN_DIR,
        f"the evaluate stage's {EVAL_DIR}": EVAL_DIR,
    }


def check_outside_other_outputs(cfg, out: Path) -> None:
    """A release inside another stage's output would be a foreign file there, and that stage
    would refuse to replace its output from then on (and one around another output would hold
    that stage's files): refuse it before any work."""
    target = out.resolve()
    for key, other in other_outputs(cfg).items():
        if target.is_relative_to(other.resolve()):
            where = "is" if target == other.resolve() else "is inside"
            raise PipelineError(
                f"release.output: {out} {where} {key} ({other}), another stage's output; a release there would "
                "block that stage: choose a directory outside it"
            )
        if other.resolve().is_relative_to(target):
            raise PipelineError(f"release.output: {out} holds {key} ({other}), another stage's output: choose a directory outside it")
    record = enclosing_output(target.parent, STAGE_RECORDS)
    if record is not None:
        around = record.parent.relative_to(Path.cwd().resolve()) if record.is_relative_to(Path.cwd().resolve()) else record.parent
        raise PipelineError(
            f"release.output: {out} is inside {around}, another stage's output ({record.name} lists its files); "
            "a release there would block that stage: choose a directory outside it"
        )


def read_conversion_record(hf: Path) -> dict[str, Any]:
    """The convert stage's record in ``hf``: the checkpoint it converted and the files it wrote."""
    try:
        return read_json(hf / CONVERTED, CONVERSION_RECORD_SCHEMA, MAX_RECORD_BYTES)
    except FileFormatError as exc:
        raise PipelineError(f"convert.output: {exc}: not the convert stage's record; run `moe convert` again") from None


def copy_converted_files(hf: Path, files: dict[str, Any], tmp: Path) -> None:
    """Every file the conversion wrote but its card, copied from ``hf`` into ``tmp``; each name
    the record lists must stay inside both."""
    where = f"{hf / CONVERTED}: written_files"
    for rel in sorted(files):
        src, dst = inside(hf, rel, where), inside(tmp, rel, where)
        if rel == "README.md":
            continue  # the convert stage's card: the release writes its own
        if not src.is_file() or src.is_symlink():
            raise PipelineError(f"convert.output: {src} is missing (listed in {hf / CONVERTED}): run `moe convert` again")
        dst.parent.mkdir(parents=True, exist_ok=True)
        clone_file(src, dst)


def run_release(cfg, card_text) -> dict[str, Any]:
    """``card_text(cfg, out, model config, checkpoint meta, evaluation)`` writes the card."""
    out = Path(cfg.release.output)
    hf = Path(cfg.convert.output)
    check_outside_other_outputs(cfg, out)
    check_own_output(out, MARKER, "release.output")  # before any work: never someone's folder
    if not (hf / CONVERTED).is_file():
        raise PipelineError(f"convert.output: {hf} holds no converted model (no {CONVERTED}): run `moe convert` first")
    check_own_output(hf, CONVERTED, "convert.output")  # every file as the conversion wrote it
    detail_file = detail_path(Path(cfg.evaluate.output))
    if not detail_file.is_file():
        raise PipelineError(f"evaluate.output: {detail_file} does not exist: run `moe evaluate` first")
    try:
        if not recognise_detail(detail_file):
            raise PipelineError(f"evaluate.output: {detail_file} is not the evaluate stage's detail file")
        detail = read_detail(detail_file)  # every field typed and bounded before it reaches the card
    except FileFormatError as exc:
        raise PipelineError(f"evaluate.output: {exc}") from None
    identity = converted_model_identity(hf)
    if detail.get("converted_sha256") != identity:
        raise PipelineError(
            f"evaluate.output: {detail_file} is not the evaluation of the model now in {hf} "
            "(it was converted again since, or evaluated elsewhere): run `moe evaluate` again"
        )
    record = read_conversion_record(hf)
    try:
        meta = read_meta(record["checkpoint"])
    except (CheckpointError, OSError, KeyError, ValueError) as exc:
        raise PipelineError(f"convert.output: {hf} was converted from {record.get('checkpoint')}, which cannot be read now ({exc})") from None
    if int(meta.get("step", -1)) != int(detail["step"]):
        raise PipelineError(f"evaluate.output: {detail_file} is of step {detail['step']}, the converted checkpoint of step {meta.get('step')}")
    model_cfg = ModelConfig.from_dict(meta["config"]["model"]).validate("model")
    evaluation = final_evaluation(detail, cfg.evaluate.data_dir)
    tmp = fresh_temp_dir(out)
    try:
        copy_converted_files(hf, record["written_files"], tmp)
        write_atomic(tmp / "README.md", card_text(cfg, out, model_cfg, meta, evaluation))
        provenance = {"converted": str(hf), "converted_sha256": identity, "step": evaluation.step, "evaluation": str(detail_file)}
        seal_output(tmp, MARKER, provenance)
        replace_own_output(tmp, out, MARKER, "release.output")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return provenance


# What dvc.yaml runs, reads and writes for this stage, and the code it runs (pipeline/stage_spec.py).
STAGE = Stage(
    name="release",
    params=("release",),
    deps=("runs/hf", "metrics/eval_detail.json"),
    outputs=(Output("runs/release", MARKER),),
    code=(
        "pipeline/stages/release.py",
        "pipeline/model_card.py",
        "pipeline/escape.py",
        "pipeline/stages/evaluate.py",
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
