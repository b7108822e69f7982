"""How much reaches the console. By default our own lines: third-party INFO logs (MLflow's
database and system-metrics lines), Python warnings (deprecations, UserWarnings, each repeated
by every process) and libraries' progress bars stay off it; `moe -v` shows them. The setting
travels in the environment (MOE_VERBOSE), so the stages, workers and jobs a command starts
follow it; MLflow runs and the workers' log files keep what their processes log."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from collections.abc import Iterator

VERBOSE_ENV = "MOE_VERBOSE"
OURS = ("moe", "pipeline", "bench")
# Read by the libraries when they load, so set before they do (and inherited by child
# processes): MLflow logs its warnings only; Hugging Face (transformers' "Loading weights")
# draws no progress bar.
QUIET_ENV = {"MLFLOW_LOGGING_LEVEL": "WARNING", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
LOG_FILE_FORMAT = "%(asctime)s %(name)s %(message)s"  # a worker's log: rank<N>.log, a Slurm task's


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


def set_verbose() -> None:
    """`moe -v`: this process and every one it starts show everything."""
    os.environ[VERBOSE_ENV] = "1"
    for key, value in QUIET_ENV.items():
        if os.environ.get(key) == value:
            del os.environ[key]


class ConsoleFormatter(logging.Formatter):
    """A warning reads as the console's own do (``warning: ...``); a third party's names its logger."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if record.levelno < logging.WARNING:
            return text
        ours = record.name.split(".")[0] in OURS
        return f"{record.levelname.lower()}: {text}" if ours else f"{record.levelname.lower()} ({record.name}): {text}"


def configure_logging(level: int = logging.WARNING, stream=None, log_file_format: bool = False) -> None:
    """This process's logging: our loggers at ``level``; the others at WARNING (INFO with -v);
    Python warnings off the console unless -v (or -W / PYTHONWARNINGS chose). ``log_file_format``:
    timestamped lines with the logger's name (a worker's stdout is its log file)."""
    loud = verbose()
    if not loud:
        for key, value in QUIET_ENV.items():
            os.environ.setdefault(key, value)
    handler = logging.StreamHandler(sys.stderr if stream is None else stream)
    handler.setFormatter(logging.Formatter(LOG_FILE_FORMAT) if log_file_format else ConsoleFormatter("%(message)s"))
    root = logging.getLogger()
    for old in root.handlers[:]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.INFO if loud else logging.WARNING)
    for name in OURS:
        logging.getLogger(name).setLevel(min(level, logging.INFO) if loud else level)
    if not sys.warnoptions:
        warnings.simplefilter("default" if loud else "ignore")
    from pipeline.redact import install_log_redaction

    install_log_redaction()


@contextlib.contextmanager
def muted(logger: str, when: bool = True) -> Iterator[None]:
    """Within the block, ``logger`` says nothing (when ``when``): a check whose warnings the
    process it prepares repeats (a local training job's worker), so that they show once."""
    log = logging.getLogger(logger)
    was = log.disabled
    log.disabled = was or when
    try:
        yield
    finally:
        log.disabled = was
