"""What a pipeline stage declares of itself (its module's ``STAGE``): the command DVC runs, the
params sections that invalidate it, the paths it reads and writes, and the code it runs, so
that dvc.yaml can be held against the code (tests/pipeline/test_stage_declarations.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Output:
    """A path the stage writes, and what proves a path there is ours before it is replaced: the
    marker file a directory holds (pipeline/outputs.py), or a recogniser of the file."""

    path: str
    proof: str | Callable[[Path], bool] | None = None


@dataclass(frozen=True)
class Stage:
    name: str
    params: tuple[str, ...]  # params.yaml sections
    deps: tuple[str, ...]  # data the stage reads (other stages' outputs)
    outputs: tuple[Output, ...]  # dvc.yaml's outs, metrics and plots
    code: tuple[str, ...]  # files and folders covering the stage module's imports in pipeline/ and moe/

    @property
    def command(self) -> str:
        """The command dvc.yaml runs (scripts/moe: the `moe` command line)."""
        return f"sh scripts/moe {self.name}"
