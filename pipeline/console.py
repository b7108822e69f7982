"""What both command lines share (`moe` and `moe paper`): the console, the one error policy
(every expected failure is one `error:` line and its exit code, moe.errors), option types."""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated

try:
    import typer
    from rich.console import Console
    from rich.markup import escape
except ImportError as _exc:  # `pip install .` without the extra: say which one
    raise SystemExit(f"error: the moe command needs the pipeline extra ({_exc}): pip install 'moe-pipeline[pipeline]'") from None

from moe.errors import MoeError, one_line
from pipeline.redact import redact

console = Console(stderr=True, soft_wrap=True)  # a line longer than the terminal is one line still: never cut in two


def _flags_show_no_type() -> None:
    """typer (0.29) prints a type beside every option in --help, flags too (`--dry-run <bool>`,
    `--help <bool>`), though a flag takes no value: show none for them."""
    from typer.core import TyperOption

    shown = getattr(TyperOption, "display_type_rich", None)
    if shown is None:  # an older typer prints no type for flags anyway
        return

    def display_type_rich(self, ctx):
        return None if getattr(self, "is_flag", False) and not getattr(self, "metavar", None) else shown(self, ctx)

    TyperOption.display_type_rich = display_type_rich


_flags_show_no_type()

ParamsOpt = Annotated[Path, typer.Option("--params", "-p", help="params file")]
SetOpt = Annotated[list[str] | None, typer.Option("--set", "-s", help="override, e.g. model.moe.num_experts=16 (repeatable)")]
NoTrackOpt = Annotated[bool, typer.Option("--no-mlflow", help="do not log to MLflow")]
GpuOpt = Annotated[str, typer.Option("--gpu", help="GPU kind for the memory plan: h100, h200, b200 or b300")]


def fail(message: str, code: int) -> None:
    console.print(f"[bold red]error:[/] {escape(one_line(redact(without_unsafe_advice(message))))}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


_WEIGHTS_ONLY = re.compile(r"weights only load failed|weights_only\s*(=|set to)\s*false|weights_only argument", re.IGNORECASE)


def without_unsafe_advice(message: str) -> str:
    """torch's refusal to unpickle advises rerunning with ``weights_only`` off (which would run
    the file's code): never pass that advice on to a user handed a hostile file. The message is
    cut at the sentence that first mentions it."""
    found = _WEIGHTS_ONLY.search(message)
    if found is None:
        return message
    head = message[: found.start()]
    cut = max(head.rfind(". "), head.rfind(": "), head.rfind("("), head.rfind("\n"))
    kept = head[: cut + 1].rstrip(" (") if cut >= 0 else ""
    return (kept + " " if kept else "") + "(the file holds objects that need unpickling, which is refused)"


def _unexpected(exc: BaseException) -> None:
    """A bug, not bad input: the traceback (credentials masked) and exit code 1."""
    import traceback

    sys.stderr.write(redact("".join(traceback.format_exception(exc))))
    fail(f"unexpected {type(exc).__name__}: {exc}", 1)


def handle_errors(fn):
    """One clear line and a meaningful exit code for every expected failure."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except typer.Exit:
            raise
        except MoeError as exc:
            fail(str(exc), exc.exit_code)
        except ModuleNotFoundError as exc:
            fail(missing_module_message(exc.name or str(exc)), 2)
        except FileNotFoundError as exc:
            fail(f"{exc.filename}: not found", 2)
        except OSError as exc:
            if exc.filename is None and exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                _unexpected(exc)
            where = exc.filename or os.getcwd()
            fail(f"{where}: {exc.strerror or exc}" + (" (the disk is full)" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else ""), 2)
        except MemoryError:
            fail("out of memory (the input or the model is larger than this machine holds)", 2)
        except RecursionError:
            fail("the input is nested too deeply to read", 2)
        except KeyboardInterrupt:
            fail("interrupted", 130)
        except Exception as exc:
            _unexpected(exc)

    return wrapper


# What a missing module means: the extra (or option) that brings it.
MISSING_MODULE_HINTS = {
    "mlflow": "MLflow is not installed here: pip install 'moe-pipeline[pipeline]', or pass --no-mlflow",
    "transformers": "transformers is not installed here: pip install 'moe-pipeline[pipeline]'",
    "tokenizers": "tokenizers is not installed here: pip install 'moe-pipeline[pipeline]'",
    "safetensors": "safetensors is not installed here: pip install 'moe-pipeline[pipeline]'",
    "submitit": "submitit is not installed here: pip install 'moe-pipeline[pipeline]'",
    "pyarrow": "pyarrow is not installed here: pip install 'moe-pipeline[pipeline]'",
    "matplotlib": "matplotlib is not installed here: pip install 'moe-pipeline[pipeline]'",
    "psycopg2": "psycopg2 is not installed here (a PostgreSQL MLflow backend needs it)",
}


def missing_module_message(name: str) -> str:
    top = name.split(".")[0]
    return MISSING_MODULE_HINTS.get(top, f"the Python module {top} is not installed here (pip install it, or the extra that has it)")


@contextlib.contextmanager
def progress(what: str, unit: str) -> Iterator[Callable[[int, int | None], None]]:
    """``update(done, total)`` for a stage's units: a bar on a terminal (gone once done), else a
    line now and then with the rate and the time left (pipeline.progress)."""
    if not console.is_terminal:
        from pipeline.progress import ProgressLines

        yield ProgressLines(what, unit, lambda line: console.print(line, highlight=False))
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(f"{what} ({unit})", total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


INTERRUPTED = 130  # a command's exit code after Ctrl-C


def run_child(cmd: list[str], **popen) -> int:
    """A child command's exit code. Ctrl-C meanwhile reaches the child too (one terminal, one
    process group), which stops and says so in its one line: this process waits for it, says
    nothing more, and returns 130 (the child's code where Ctrl-C did not stop it)."""
    import signal
    import subprocess
    import threading

    interrupted: list[int] = []
    in_main = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGINT, lambda signum, frame: interrupted.append(signum)) if in_main else None
    try:
        code = subprocess.call(cmd, **popen)
    finally:
        if in_main:
            signal.signal(signal.SIGINT, old)
    return INTERRUPTED if interrupted and code != 0 else code
