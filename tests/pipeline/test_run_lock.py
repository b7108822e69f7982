"""One writer per run directory: the lock names its holder and dies with it."""

import os
import signal
import subprocess
import sys

import pytest

from pipeline.run_lock import RunDirBusy, RunLock
from tests.workspace import REPO

HOLD = (
    "import sys, time; from pipeline.run_lock import RunLock; RunLock(sys.argv[1]).acquire('moe train'); print('held', flush=True); time.sleep(600)"
)


def test_second_writer_is_refused_naming_the_holder(tmp_path):
    with RunLock(tmp_path / "run").acquire("moe train"):
        with pytest.raises(RunDirBusy) as err:
            RunLock(tmp_path / "run").acquire("moe train")
        message = str(err.value)
        assert f"pid {os.getpid()}" in message and "moe train" in message and str(tmp_path / "run") in message
        with pytest.raises(RunDirBusy):
            RunLock(tmp_path / "run").check_free()
    RunLock(tmp_path / "run").check_free()  # released
    with RunLock(tmp_path / "run").acquire("again"):
        pass


def test_lock_of_a_killed_holder_is_free(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "run")], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(RunDirBusy, match=f"pid {proc.pid} "):
            RunLock(tmp_path / "run").check_free()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    RunLock(tmp_path / "run").check_free()
    assert (tmp_path / "run" / ".lock").exists()  # never removed: removal would let two hold it
