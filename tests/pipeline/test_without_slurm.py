"""The Slurm commands on a machine without Slurm (a laptop, CI's own view with Slurm taken off
PATH): the dry run prints the script, every other command fails at once with one `error:`
line, and nothing is removed or recorded first (issue 36)."""

import os
import sys
from pathlib import Path

import pytest

from tests.helpers import moe
from tests.pipeline.test_slurm import DRY_RUN_ARGS, GOLDEN

SLURM_COMMANDS = {"sbatch", "srun", "scontrol", "scancel", "sacct", "squeue", "sinfo", "salloc", "slurmctld", "slurmd"}


@pytest.fixture(scope="module")
def path_without_slurm(tmp_path_factory) -> str:
    """A PATH with every command of today's PATH except Slurm's (links in one directory)."""
    bin_dir = tmp_path_factory.mktemp("bin-without-slurm")
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        if not directory or not Path(directory).is_dir():
            continue
        for entry in Path(directory).iterdir():
            link = bin_dir / entry.name
            if entry.name in SLURM_COMMANDS or link.exists() or link.is_symlink():
                continue
            if entry.is_file() and os.access(entry, os.X_OK):
                link.symlink_to(entry)
    return str(bin_dir)


def _no_slurm(path: str) -> dict[str, str]:
    return {"PATH": path}


def _one_error_line(stderr: str, needle: str) -> None:
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0], stderr
    assert "Traceback" not in stderr, stderr


def test_dry_run_prints_the_same_script_without_slurm(workspace, path_without_slurm):
    r = moe(*DRY_RUN_ARGS, env=_no_slurm(path_without_slurm))
    assert r.returncode == 0, r.stderr
    text = r.stdout.replace(str(workspace.resolve()), "<CWD>").replace(sys.executable, "<PYTHON>")
    assert text == GOLDEN.read_text()


def test_submit_without_slurm_changes_nothing_and_records_nothing(workspace, path_without_slurm):
    ck = workspace / "runs/train/checkpoints/step_00000004"
    ck.mkdir(parents=True)
    (ck / "marker").write_text("a checkpoint")
    metrics = workspace / "runs/train/metrics.jsonl"
    metrics.write_text('{"step": 1, "loss": 5.0}\n')
    r = moe("submit", env=_no_slurm(path_without_slurm))
    assert r.returncode != 0
    _one_error_line(r.stderr, "`sbatch` is not on PATH")
    assert (ck / "marker").read_text() == "a checkpoint"
    assert metrics.read_text() == '{"step": 1, "loss": 5.0}\n'
    assert not (workspace / "mlflow.db").exists()  # no run was opened, so no store was created
    assert not (workspace / "runs/train/job.json").exists()


def test_train_with_the_slurm_executor_fails_before_anything_without_slurm(workspace, path_without_slurm):
    r = moe("train", "--no-mlflow", "--set", "executor.kind=slurm", env=_no_slurm(path_without_slurm))
    assert r.returncode != 0
    _one_error_line(r.stderr, "Slurm is not available")


@pytest.mark.parametrize("command", [["status", "123"], ["cancel", "123"], ["logs", "123", "--follow"]])
def test_job_commands_without_slurm_are_one_error_line(workspace, path_without_slurm, command):
    r = moe(*command, env=_no_slurm(path_without_slurm))
    assert r.returncode != 0
    _one_error_line(r.stderr, "Slurm is not available")


def test_logs_of_a_finished_job_read_without_slurm(workspace, path_without_slurm):
    folder = workspace / "runs/slurm"
    folder.mkdir(parents=True)
    (folder / "77_0_log.out").write_text("step 1 loss 5.0\n")
    r = moe("logs", "77", env=_no_slurm(path_without_slurm))
    assert r.returncode == 0, r.stderr
    assert "step 1 loss 5.0" in r.stdout
