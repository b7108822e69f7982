"""Release stage: the converted model with its final evaluation on the model card.

The convert stage writes its card before evaluate has run, so that card can hold only the in-loop
numbers. After evaluate, this stage writes ``release.output`` (runs/release): the converted files
(hard links where the filesystem allows, else copies) and a README.md with the evaluate stage's
numbers for exactly that directory: the detail file names the conversion record's sha256, and
any other pairing is refused. Written to a temporary directory and renamed, like convert.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from moe.config import ModelConfig
from moe.eval.suite import headline
from moe.train.checkpoint import CheckpointError, read_meta
from pipeline.errors import PipelineError
from pipeline.eval.tasks import TASKS, task_source
from pipeline.model_card import CardEvaluation
from pipeline.outputs import check_own_output, fresh_temp_dir, replace_own_output, seal_output, write_atomic
from pipeline.stages.convert import MARKER as CONVERTED
from pipeline.stages.evaluate import converted_model_identity, detail_path, recognise_detail

MARKER = "moe_release.json"  # marks a directory as our release output (replaceable)
MAX_DETAIL_BYTES = 64 << 20


def final_evaluation(detail: dict[str, Any], data_dir: str | None) -> CardEvaluation:
    """The card's evaluation from the evaluate stage's detail file: each task's headline figures
    (primary metric, accuracy, bpb, each with its standard error), documents and chance."""
    tasks, docs, chance = {}, {}, {}
    for name, r in (detail.get("tasks") or {}).items():
        metric = TASKS[name].metric if name in TASKS else "bpb"
        tasks[name] = {k: float(v) for k, v in headline(r, metric).items()}
        docs[name] = int(r["docs"])
        if "chance" in r:
            chance[name] = float(r["chance"])
    return CardEvaluation(int(detail["step"]), True, tasks, docs, chance, {t: task_source(t, data_dir) for t in tasks})


def run_release(cfg, card_text) -> dict[str, Any]:
    """``card_text(cfg, out, model config, checkpoint meta, evaluation)`` writes the card."""
    out = Path(cfg.release.output)
    hf = Path(cfg.convert.output)
    check_own_output(out, MARKER, "release.output")  # before any work: never someone's folder
    if not (hf / CONVERTED).is_file():
        raise PipelineError(f"convert.output: {hf} holds no converted model (no {CONVERTED}): run `moe convert` first")
    check_own_output(hf, CONVERTED, "convert.output")  # every file as the conversion wrote it
    detail_file = detail_path(Path(cfg.evaluate.output))
    if not detail_file.is_file():
        raise PipelineError(f"evaluate.output: {detail_file} does not exist: run `moe evaluate` first")
    if detail_file.stat().st_size > MAX_DETAIL_BYTES or not recognise_detail(detail_file):
        raise PipelineError(f"evaluate.output: {detail_file} is not the evaluate stage's detail file")
    detail = json.loads(detail_file.read_text())
    identity = converted_model_identity(hf)
    if detail.get("converted_sha256") != identity:
        raise PipelineError(
            f"evaluate.output: {detail_file} is not the evaluation of the model now in {hf} "
            "(it was converted again since, or evaluated elsewhere): run `moe evaluate` again"
        )
    record = json.loads((hf / CONVERTED).read_text())
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
        for rel in sorted(record["written_files"]):
            if rel == "README.md":
                continue  # the convert stage's card: replaced below
            dst = tmp / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(hf / rel, dst)
            except OSError:  # another filesystem, or links not allowed
                shutil.copy2(hf / rel, dst)
        write_atomic(tmp / "README.md", card_text(cfg, out, model_cfg, meta, evaluation))
        provenance = {"converted": str(hf), "converted_sha256": identity, "step": evaluation.step, "evaluation": str(detail_file)}
        seal_output(tmp, MARKER, provenance)
        replace_own_output(tmp, out, MARKER, "release.output")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return provenance
