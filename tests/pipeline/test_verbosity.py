"""The quiet console (pipeline/verbosity.py, issue 51): a command prints our lines; third-party
INFO logs, Python warnings and libraries' progress bars only with -v; config commands answer
before torch loads; Ctrl-C is one line."""

import os
import re
import signal
import subprocess
import sys
import time

from tests.helpers import moe
from tests.workspace import REPO, write_corpus

# What is not ours on a console: a library's INFO log line, a Python warning (and the source
# line it quotes), DVC's lock-file bookkeeping, transformers' progress bar.
NOISE = re.compile(r"\bINFO\b|Warning:|^\s+warnings\.warn|^WARNING:|lock file|Loading weights|Traceback")


def noise(text: str) -> list[str]:
    """The lines of a command's output that are not ours."""
    return [line for line in text.splitlines() if NOISE.search(line)]


def python(code: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("MOE_VERBOSE", "MLFLOW_LOGGING_LEVEL", "HF_HUB_DISABLE_PROGRESS_BARS")}
    base["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env={**base, **(env or {})}, timeout=120)


LOGS = """
import logging, os, warnings
from pipeline.verbosity import configure_logging
configure_logging()
logging.getLogger("mlflow.store.db.utils").info("Creating initial MLflow database tables...")
logging.getLogger("pipeline.eval").warning("ours")
logging.getLogger("urllib3").warning("a retry")
warnings.warn("old API", DeprecationWarning)
warnings.warn("ambiguous source", UserWarning)
print(os.environ.get("MLFLOW_LOGGING_LEVEL"), os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS"))
"""


def test_third_party_info_and_python_warnings_stay_off_the_console_unless_verbose():
    quiet = python(LOGS)
    assert quiet.stderr.splitlines() == ["warning: ours", "warning (urllib3): a retry"], quiet.stderr
    assert quiet.stdout.split() == ["WARNING", "1"]  # what MLflow and Hugging Face read when they load
    loud = python(LOGS, env={"MOE_VERBOSE": "1"})
    for line in ("Creating initial MLflow database tables", "DeprecationWarning: old API", "UserWarning: ambiguous source", "warning: ours"):
        assert line in loud.stderr, loud.stderr
    assert loud.stdout.split() == ["None", "None"]


# `moe ARGS` in this process: its exit code, and whether torch was imported on the way.
MOE = """
import os, sys
sys.argv = ["moe", *sys.argv[1:]]
from pipeline.cli import main
try:
    main()
except SystemExit as exc:
    print("exit", exc.code, "torch" in sys.modules, os.environ.get("MOE_VERBOSE"))
"""


def test_config_commands_answer_before_torch_loads(workspace):
    """`moe params` with a typo answered in ~3 s (torch imported first); now as fast as --help."""
    for args, code in [
        (["--help"], 0),
        (["params", "--set", "train.max_stepz=3"], 2),
        (["train", "--set", "model.moe.top_k=99"], 2),
        (["evaluate", "--set", "evaluate.taskz=[]"], 2),
        (["submit", "--set", "slurm.nodez=2"], 2),
        (["plan", "--set", "optim.lrr=1"], 2),
    ]:
        r = python(MOE, *args)
        assert r.stdout.split()[-4:-1] == ["exit", str(code), "False"], (args, r.stdout[-500:], r.stderr)
        assert code == 0 or r.stderr.startswith("error: "), r.stderr


def test_verbose_reaches_the_processes_a_command_starts(workspace):
    r = python(MOE, "-v", "params", "--set", "train.max_stepz=3")
    assert r.stdout.split()[-1] == "1"  # MOE_VERBOSE: what the stages, workers and jobs read


def test_a_stage_prints_its_progress_and_no_third_party_lines(workspace):
    """`moe tokenize` with MLflow on (a new database, system metrics, dataset inputs: each made
    MLflow INFO lines or a UserWarning on the console before)."""
    for name in ("b", "c"):
        write_corpus(workspace / "corpus" / name, docs=20)
    r = moe("tokenize")
    assert r.returncode == 0, r.stderr
    assert noise(r.stdout + r.stderr) == [], r.stdout + r.stderr
    lines = r.stderr.splitlines()
    assert lines[0].startswith("tokenize: 1 of 3 sources encoded"), lines
    assert lines[-1].startswith("tokenized ") and len(lines) == 2, lines


CHILD = """
import sys, time
try:
    print("ready", flush=True)
    time.sleep(30)
except KeyboardInterrupt:
    print("error: interrupted", file=sys.stderr, flush=True)
    sys.exit(130)
"""
PARENT = """
import sys
from pipeline.console import run_child
sys.exit(run_child([sys.executable, "-c", sys.argv[1]]))
"""


def test_ctrl_c_is_the_childs_one_line():
    """Ctrl-C reaches `moe repro` and the stage it runs alike: the stage says so, the parent
    nothing more (no second line, no traceback), with the stage's exit code."""
    p = subprocess.Popen(
        [sys.executable, "-c", PARENT, CHILD],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert p.stdout.readline() == "ready\n"
    time.sleep(0.2)
    os.killpg(p.pid, signal.SIGINT)  # what the terminal does: the whole foreground group
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130 and err.splitlines() == ["error: interrupted"], err
