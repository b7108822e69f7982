"""`python -m pipeline.dvc_run ARGS`: DVC's command line (`dvc ARGS`), with DVC's bookkeeping
off the console: a lock file generated or updated, the blank line between stages, the command
echoed under each `Running stage` line; its error for a stage stopped by Ctrl-C. Other errors,
warnings and the rest pass as DVC prints them; `moe -v` shows everything."""

from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path

# DVC's loggers of the lines above (logging.getLogger().getChild(__name__) in dvc's modules).
LOCK_FILE_LOGGER = "dvc.dvcfile"
STAGE_LOGGER = "dvc.stage.run"


def bookkeeping(record: logging.LogRecord) -> bool:
    if record.levelno != logging.INFO:
        return False
    message = record.getMessage()
    return record.name == LOCK_FILE_LOGGER or not message.strip() or (record.name == STAGE_LOGGER and message.startswith("> "))


def stage_interrupted(record: logging.LogRecord) -> bool:
    """DVC's error for a stage stopped by Ctrl-C (its command exited with 130): the stage has
    said so in its own line."""
    exc = record.exc_info[1] if record.exc_info else None
    while exc is not None:
        if str(exc).endswith(", exited with 130"):  # dvc.stage.exceptions.StageCmdFailedError
            return True
        exc = exc.__cause__
    return False


class DropBookkeeping(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (bookkeeping(record) or stage_interrupted(record))


def call(args: list[str], env: dict[str, str] | None = None, cwd: str | Path | None = None) -> int:
    """`dvc ARGS` through this module, in ``cwd`` (the DVC project: the paper pipeline is one of
    its own, bench/paper); its exit code (130: Ctrl-C, which DVC or its stage has answered in
    its one line)."""
    from pipeline.console import run_child

    return run_child([sys.executable, "-m", "pipeline.dvc_run", *args], env=env, cwd=cwd)


def main(argv: list[str]) -> int:
    import dvc  # noqa: F401 - importing dvc sets up its console handlers on the "dvc" logger
    from dvc.cli import main as dvc_main

    from pipeline.verbosity import verbose

    if not verbose():
        if not sys.warnoptions:
            warnings.simplefilter("ignore")  # DVC's dependencies' deprecations: -v shows them
        for handler in logging.getLogger("dvc").handlers:
            handler.addFilter(DropBookkeeping())
    return dvc_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
