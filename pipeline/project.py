"""Where the project lives, wherever DVC runs a stage.

``dvc exp run --temp`` and queued experiments run stages in a clone under
``<project>/.dvc/tmp/exps/``; what belongs to the project (the SQLite MLflow store, the
virtual environment) must resolve to the project itself, not to that throwaway clone.
"""

from __future__ import annotations

import os
from pathlib import Path

EXPS_MARK = f"{os.sep}.dvc{os.sep}tmp{os.sep}exps{os.sep}"


def project_root(start: Path | None = None) -> Path:
    """``$MOE_PROJECT_ROOT``; else the project that owns ``start`` (default: the cwd) when it is
    a DVC experiment workspace; else the nearest ancestor holding ``.dvc``; else ``start``."""
    if os.environ.get("MOE_PROJECT_ROOT"):
        return Path(os.environ["MOE_PROJECT_ROOT"]).resolve()
    here = (start or Path.cwd()).resolve()
    text = str(here) + os.sep
    if EXPS_MARK in text:
        return Path(text.split(EXPS_MARK, 1)[0])
    for d in (here, *here.parents):
        if (d / ".dvc").is_dir():
            return d
    return here


def main_project_root(start: Path | None = None) -> Path:
    """The outer project of a DVC project nested in it (bench/paper, whose runs belong to the
    main project's MLflow store); ``project_root`` where there is none."""
    root = project_root(start)
    if "MOE_PROJECT_ROOT" in os.environ or root.parent == root:
        return root
    outer = project_root(root.parent)
    return outer if (outer / ".dvc").is_dir() else root
