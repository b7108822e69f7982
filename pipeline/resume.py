"""Resume or start afresh when DVC reruns the train stage.

The run directory is a ``persist: true`` output in dvc.yaml, so DVC no longer deletes the
checkpoints before rerunning the stage: an interrupted ``dvc repro`` resumes where it stopped.
Whether the checkpoints belong to the run asked for now is decided by a hash of the
training-relevant config stored in every checkpoint's meta.json (model, optimiser, schedule,
data, steps, seeds, precision; not the layout, which checkpoints are independent of, nor
checkpoint/log cadence). Checkpoints of another config are removed (only the step directories
and ``latest`` the trainer wrote) and training starts afresh.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path
from typing import Any

from moe.train.checkpoint import _STEP_DIR, META, latest_checkpoint, read_meta

log = logging.getLogger("pipeline.resume")

# Keys that do not change what a run computes.
NOT_HASHED = {
    "checkpoint": {"dir", "every", "keep_last", "resume", "init_from"},
    "train": {"log_every", "peak_tflops", "device"},
    "parallel": None,  # checkpoints are layout-independent (tested); None: the whole section
}


def config_key(config: dict[str, Any]) -> str:
    """sha256 of the training-relevant part of an ExperimentConfig.to_dict()."""
    relevant = {}
    for section, values in sorted(config.items()):
        skip = NOT_HASHED.get(section, set())
        if skip is None:
            continue
        if section == "model" and isinstance(values, dict):  # labels, not shape
            values = {k: v for k, v in values.items() if k not in ("preset", "preset_overrides")}
        relevant[section] = {k: v for k, v in values.items() if k not in skip} if isinstance(values, dict) else values
    return hashlib.sha256(json.dumps(relevant, sort_keys=True, default=str).encode()).hexdigest()


def prepare_checkpoints(config: dict[str, Any]) -> str:
    """'resume', 'fresh' (nothing there) or 'restart' (checkpoints of another config removed)."""
    root = Path(config["checkpoint"]["dir"])
    latest = latest_checkpoint(root)
    if latest is None or config["checkpoint"].get("resume") == "never":
        return "fresh"
    theirs = config_key(read_meta(latest).get("config", {}))
    if theirs == config_key(config):
        log.info("resuming from %s (same training config)", latest)
        return "resume"
    for p in root.iterdir():  # only what the trainer wrote: step_* checkpoint dirs, their temps, `latest`
        if (_STEP_DIR.match(p.name) and (p / META).is_file()) or p.name.startswith(".tmp-step_"):
            shutil.rmtree(p)
        elif p.name == "latest" and p.is_file():
            p.unlink()
    log.warning("%s held checkpoints of another training config (%s): starting afresh", root, theirs[:12])
    return "restart"
