"""`moe tokenize`: raw text -> token files (pipeline/stages/tokenize.py)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from pipeline.commands import StageRun, load_config, stage_tracker
from pipeline.console import NoTrackOpt, ParamsOpt, SetOpt, console, progress


def command(params: ParamsOpt = Path("params.yaml"), set_: SetOpt = None, no_mlflow: NoTrackOpt = False) -> None:
    """Raw text -> token files (train/ and val/), tokenizer.json and manifest.json."""
    cfg = load_config(params, set_)  # a config error answers first, before the stage's imports
    from pipeline.stages.tokenize import run_tokenize

    with StageRun(stage_tracker(cfg, "tokenize", params, not no_mlflow)) as tracker, progress("tokenize", "sources encoded") as update:
        manifest = run_tokenize(cfg.tokenize, progress=update)
        if tracker:
            tracker.log_metrics({f"{s}_{k}": v for s, d in manifest["splits"].items() for k, v in d.items() if k != "files"})
            tracker.set_tags({"tokenizer.sha256": manifest["tokenizer"]["sha256"]})
            for split in ("train", "val"):
                log_tokens(tracker, cfg.tokenize.output, split, "training" if split == "train" else "validation")
    sp = manifest["splits"]
    console.print(
        f"tokenized {sp['train']['documents'] + sp['val']['documents']} documents: "
        f"{sp['train']['tokens']} train / {sp['val']['tokens']} val tokens -> {cfg.tokenize.output}"
    )
    if manifest.get("skipped_files"):
        console.print(
            f"[yellow]warning:[/] skipped {len(manifest['skipped_files'])} input file(s) that are not UTF-8 text "
            f"(listed in {cfg.tokenize.output}/manifest.json)"
        )


def log_tokens(tracker, tokens_dir: str, split: str, context: str) -> None:
    """A token split as the run's MLflow dataset input; its digest covers the tokenizer and the
    files (the train and evaluate commands log theirs too)."""
    from pipeline.stages.tokenize import read_manifest

    if not os.path.lexists(Path(tokens_dir) / "manifest.json"):
        return  # nothing tokenised there yet: the stage itself says so
    manifest = read_manifest(tokens_dir)  # (a FIFO or a damaged manifest: one error naming it)
    part = {"tokenizer": manifest["tokenizer"]["sha256"], "split": manifest.get("splits", {}).get(split)}
    digest = hashlib.sha256(json.dumps(part, sort_keys=True).encode()).hexdigest()
    tracker.log_dataset(f"tokens/{split}", Path(tokens_dir) / split, digest, context)
