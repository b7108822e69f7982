"""What `dvc metrics show` and `dvc exp show` print: a few headline figures per stage, and the
values training ran with.

metrics/train.json and metrics/eval.json hold every figure (the MLflow parent run, the model
card and the tests read them) and are plain outputs in dvc.yaml; DVC's metrics are their
headlines, metrics/headline/<name>.json, a few keys each, so that the table of both fits in 120
columns. DVC reads params.yaml, where the recipe and the model preset supply most values
(`optim.lr` would show as `-`): the train stage also writes the values of its sections as they
resolved to metrics/resolved.yaml (a top-level `params:` file of dvc.yaml), under `resolved.`,
so a column of it never shares its name with one of params.yaml (DVC would then prefix both
with their file's path).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from moe.reader import FileFormatError, Map, Plain, read_yaml
from pipeline.outputs import check_output_file, json_keys_within, write_output_file
from pipeline.redact import redact

HEADLINE_DIR = "headline"
# dotted path in the full metrics file -> the headline key (its last part)
TRAIN_HEADLINE = ("final_loss", "tokens_per_s")
EVAL_HEADLINE = ("val_loss", "val_perplexity", "suite.bpb_mean", "suite.len_norm_mean")

RESOLVED_PARAMS = Path("metrics/resolved.yaml")
RESOLVED_KEY = "resolved"
# The params sections of the train stage in dvc.yaml (tests/pipeline/test_dvc_views.py holds them equal).
# Not slurm or container: where the job runs (partition, account, image) is no part of the model it trains.
TRAIN_SECTIONS = ("recipe", "model", "optim", "schedule", "data", "train", "checkpoint", "parallel", "precision", "executor")
MAX_RESOLVED_BYTES = 1 << 20


def headline_path(full: str | Path) -> Path:
    """metrics/train.json -> metrics/headline/train.json (beside whatever path a config names)."""
    full = Path(full)
    return full.parent / HEADLINE_DIR / full.name


def headline(metrics: Mapping[str, Any], paths: Sequence[str]) -> dict[str, Any]:
    """The figures at ``paths`` (dotted, into nested tables) under their last part; one absent is
    left out, except the first (the file's required key, null where the stage has none).
    Throughputs are whole numbers: DVC would print five decimals of a token count."""
    out: dict[str, Any] = {}
    for dotted in paths:
        value: Any = metrics
        for part in dotted.split("."):
            value = value.get(part) if isinstance(value, Mapping) else None
        name = dotted.rsplit(".", 1)[-1]
        if isinstance(value, float) and name.startswith("tokens_per_s"):
            value = round(value)
        if value is not None or dotted == paths[0]:
            out[name] = value
    return out


def _recognise_headline(paths: Sequence[str]):
    return json_keys_within({p.rsplit(".", 1)[-1] for p in paths}, paths[0].rsplit(".", 1)[-1])


def check_headline(full: str | Path, paths: Sequence[str]) -> None:
    """Before any work: the headline file is absent or this stage's (pipeline.outputs)."""
    path = headline_path(full)
    check_output_file(path, str(path), _recognise_headline(paths))


def write_headline(full: str | Path, metrics: Mapping[str, Any], paths: Sequence[str]) -> Path:
    """The headline file of the metrics file ``full`` (written by the same stage, after it)."""
    import json

    path = headline_path(full)
    return write_output_file(path, json.dumps(headline(metrics, paths), indent=2) + "\n", str(path), _recognise_headline(paths))


def resolved_params(flat: Mapping[str, Any], sections: Sequence[str] = TRAIN_SECTIONS) -> dict[str, Any]:
    """``{"resolved": {section: {...}}}`` from a config's flat keys (PipelineConfig.flatten()),
    for the sections given; a string that holds a password is written masked."""
    tree: dict[str, Any] = {}
    for key, value in flat.items():
        parts = key.split(".")
        if parts[0] not in sections:
            continue
        node = tree
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = redact(value) if isinstance(value, str) else value
    return {RESOLVED_KEY: tree}


def _is_resolved_file(path: Path) -> bool:
    """Whether ``path`` is a file this module wrote: one YAML mapping under RESOLVED_KEY."""
    try:
        read_yaml(path, Map(required={RESOLVED_KEY: Plain()}), MAX_RESOLVED_BYTES)
    except FileFormatError:
        return False
    return True


def write_resolved_params(flat: Mapping[str, Any], path: Path = RESOLVED_PARAMS) -> Path:
    import yaml

    header = "# The values the train stage ran with (params.yaml, the recipe, the model preset, the defaults): pipeline/dvc_views.py\n"
    text = header + yaml.safe_dump(resolved_params(flat), sort_keys=False)
    return write_output_file(path, text, str(path), _is_resolved_file)
