"""Slurm executor: one training job through submitit's AutoExecutor.

nodes x tasks_per_node tasks, one training process (one GPU) each, started by srun inside
the chosen container runtime. ``run`` submits and blocks, streaming global rank 0's log;
``submit`` returns at once; ``sbatch_script`` is the exact script sbatch would receive.
Job states are read with ``scontrol show job`` (works without Slurm accounting), falling
back to ``sacct``.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.errors import PipelineError, SubmissionRefused
from pipeline.executors.base import JobResult
from pipeline.params import ContainerConfig, SlurmConfig, describe_char, unsafe_char
from pipeline.run_lock import RunLock
from pipeline.slurm_task import SlurmTrainTask
from pipeline.train_job import TrainJob

# The batch shell runs srun in the background and passes USR2 on to it (srun forwards it to
# every task): `scancel --signal=USR2 --batch` and `#SBATCH --signal=B:USR2@N` reach only
# the batch shell, and bash runs no trap while a foreground command runs.
FORWARD_USR2_TO_TASKS = [
    "srun() {  # USR2 to this batch shell goes on to the tasks",
    '  command srun "$@" & local pid=$! rc',
    "  trap 'kill -USR2 '\"$pid\"' 2>/dev/null' USR2",
    '  while :; do wait "$pid" && rc=0 || rc=$?; kill -0 "$pid" 2>/dev/null || break; done',
    '  trap - USR2; return "$rc"',
    "}",
]
# A Slurm job id as the commands take one: digits, an array task (12345_7), tasks of an array
# (12345_[1-3,5]) or a heterogeneous job's component (12345+1).
JOB_ID = re.compile(r"[0-9]+(_[0-9]+|_\[[0-9]+(-[0-9]+)?(,[0-9]+(-[0-9]+)?)*\]|\+[0-9]+)?")
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED"}


def require_slurm(*commands: str) -> None:
    """Slurm's client commands must be here before anything is prepared or changed: one
    error naming the missing command (not a traceback from submitit or subprocess)."""
    missing = [c for c in commands if shutil.which(c) is None]
    if missing:
        raise PipelineError(
            f"Slurm is not available on this machine: `{missing[0]}` is not on PATH. "
            "Run this on a Slurm login node; `moe submit --dry-run` prints the job script anywhere"
        )
    down = controller_down()
    if down:
        raise PipelineError(f"Slurm's controller does not answer here ({down}); `moe submit --dry-run` prints the job script anywhere")


PING_TIMEOUT_S = 10


def controller_down() -> str | None:
    """What `scontrol ping` says when the controller is down (None: it answered, or there is
    no scontrol to ask). Asked first because scontrol, scancel and sbatch retry a controller
    that is down for tens of seconds before they fail; the ping answers at once."""
    if shutil.which("scontrol") is None:
        return None
    try:
        r = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=PING_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"scontrol ping: no answer in {PING_TIMEOUT_S} s"
    if r.returncode == 0:
        return None
    said = next((line.strip() for line in (r.stdout + r.stderr).splitlines() if line.strip() and not line.startswith("*")), "")
    return f"scontrol ping: {said or f'exit code {r.returncode}'}"


def check_job_id(job_id: str) -> str:
    """A job id given on the command line is one before it reaches scancel, scontrol or sacct
    (``--me`` would be read as a flag: cancel every job of the user) or a log path (``../x``)."""
    if not JOB_ID.fullmatch(str(job_id)):
        raise PipelineError(f"job id: {str(job_id)!r} is not a Slurm job id (digits, e.g. 12345; an array task, 12345_7)")
    return str(job_id)


def _slurm_executor_class(render_only: bool):
    """submitit's Slurm executor; ``render_only``: one that only renders the batch script
    (submitit refuses to build its executor where `srun` is missing, which a dry run must not)."""
    import submitit

    if not render_only:
        return submitit.SlurmExecutor

    class ScriptOnly(submitit.SlurmExecutor):
        @classmethod
        def affinity(cls) -> int:
            return 1

    return ScriptOnly


def check_script_value(value: str, what: str) -> str:
    """A value written into the batch script (a path, most often) must be one line: a newline
    or another control character would end an ``#SBATCH`` line or a quoted word there and start
    a command of its own (quoting protects spaces, not line breaks inside #SBATCH comments);
    a bidi override would show the script other than it runs (pipeline.params.unsafe_char)."""
    bad = unsafe_char(value)
    if bad is not None:
        raise PipelineError(
            f"{what}: {value!r} contains {describe_char(bad)}; it would reach the sbatch script: rename it or run from another directory"
        )
    return value


def check_script_paths(slurm: SlurmConfig, container: ContainerConfig) -> None:
    """Every path the generated script names, derived from the working directory included."""
    check_script_value(os.getcwd(), "the working directory")
    if container.runtime != "none" and any(c in os.getcwd() for c in ",:"):
        raise PipelineError(
            f"the working directory: {os.getcwd()!r} contains ',' or ':', which would split the repository's "
            f"container mount (container.runtime={container.runtime}): run from another directory"
        )
    check_script_value(str(Path(slurm.folder).absolute()), "slurm.folder (absolute)")
    check_script_value(sys.executable, "the Python interpreter")
    for name in ("image", "workdir"):
        value = getattr(container, name)
        if value:
            check_script_value(str(value), f"container.{name}")
    for m in container.mounts:
        check_script_value(m, "container.mounts")


def launch_python(container: ContainerConfig, gpus: bool) -> tuple[str, list[str]]:
    """(python command, extra srun args) that start a task in the container runtime."""
    workdir = container.workdir or os.getcwd()
    python = " ".join(shlex.quote(word) for word in container.python.split())  # validated; quoted again
    mounts = [f"{os.getcwd()}:{workdir}", *container.mounts]
    if container.runtime == "none":
        return shlex.quote(sys.executable), []
    if container.runtime == "pyxis":
        srun = [f"--container-image={container.image}", f"--container-mounts={','.join(mounts)}", f"--container-workdir={workdir}"]
        return python, srun
    if container.runtime == "apptainer":
        binds = " ".join(f"-B {shlex.quote(m)}" for m in mounts)
        nv = "--nv " if gpus else ""
        return f"apptainer exec {nv}{binds} --pwd {shlex.quote(workdir)} {shlex.quote(container.image)} {python}", []
    if container.runtime == "charliecloud":
        binds = " ".join(f"-b {shlex.quote(m)}" for m in mounts)
        # --set-env: the image's ENV (its venv first on PATH) over the host's environment
        return f"ch-run --set-env {binds} --cd {shlex.quote(workdir)} {shlex.quote(container.image)} -- {python}", []
    raise PipelineError(f"container.runtime: unknown runtime {container.runtime!r}")


def _additional(extra: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in extra:
        key, sep, value = item[2:].partition("=")
        out[key] = value if sep else True
    return out


class SlurmExecutor:
    def __init__(self, slurm: SlurmConfig, container: ContainerConfig, stream: bool = True) -> None:
        self.slurm, self.container, self.stream = slurm, container, stream

    def _executor(self, render_only: bool = False, hold: bool = False):
        check_script_paths(self.slurm, self.container)
        s = self.slurm
        python, srun_args = launch_python(self.container, s.gpus_per_node > 0)
        ex = _slurm_executor_class(render_only)(folder=s.folder, max_num_timeout=s.max_requeues, python=python)
        additional = _additional(s.extra_sbatch)
        if hold:
            additional["hold"] = True
        params: dict[str, Any] = {  # submitit's Slurm names (AutoExecutor's generic ones translated)
            "job_name": s.job_name,
            "nodes": s.nodes,
            "ntasks_per_node": s.tasks_per_node,
            "time": s.time_min,
            "signal_delay_s": s.signal_delay_s,
            "setup": [*FORWARD_USR2_TO_TASKS, *s.setup],
            "srun_args": srun_args,
            "additional_parameters": additional,
        }
        if s.gpus_per_node:
            params["gpus_per_node"] = s.gpus_per_node
        optional = {
            "cpus_per_task": s.cpus_per_task,
            "partition": s.partition,
            "account": s.account,
            "qos": s.qos,
            "constraint": s.constraint,
            "mem": s.mem,
        }
        params.update({k: v for k, v in optional.items() if v is not None})
        if s.exclusive:
            params["exclusive"] = True
        ex.update_parameters(**params)
        return ex

    def sbatch_script(self, job: TrainJob) -> str:
        """The exact batch script `submit` hands to sbatch (its pickle name aside); needs no
        Slurm on this machine."""
        ex = self._executor(render_only=True)
        return ex._make_submission_file_text(ex._submitit_command_str, "<uid>")

    def submit(self, job: TrainJob, before_start: Callable[[], None] | None = None) -> str:
        """Queue the job; its id. ``before_start`` (what changes the run directory: removing
        stale checkpoints) runs only once sbatch has accepted the job, which is queued held
        until it returns (a failure cancels the job: nothing changed unless the job exists)."""
        require_slurm("sbatch", "srun", "scontrol", "scancel")
        RunLock(job.run_dir, job.checkpoint_dir).check_free()  # the job's rank 0 takes it when it starts
        job.max_requeues = self.slurm.max_requeues
        job.write()
        if self.container.runtime == "charliecloud" and self.container.image:
            from pipeline.containers import ensure_mount_points

            workdir = self.container.workdir or os.getcwd()
            ensure_mount_points(self.container.image, [workdir, *(m.split(":", 1)[1] for m in self.container.mounts)])
        try:
            submitted = self._executor(hold=before_start is not None).submit(SlurmTrainTask(str(job.spec_path.resolve())))
        except Exception as exc:  # sbatch refused (bad partition, no cluster, ...)
            raise SubmissionRefused(f"sbatch failed: {str(exc).strip().splitlines()[-1] if str(exc).strip() else exc}") from None
        job_id = str(submitted.job_id)
        if before_start is not None:
            try:
                before_start()
            except BaseException:
                subprocess.run(["scancel", job_id], capture_output=True, text=True)
                raise
            try:
                r = subprocess.run(["scontrol", "release", job_id], capture_output=True, text=True)
            except BaseException:  # interrupted: no held job is left behind
                subprocess.run(["scancel", job_id], capture_output=True, text=True)
                raise
            if r.returncode != 0:
                subprocess.run(["scancel", job_id], capture_output=True, text=True)
                raise PipelineError(f"scontrol release {job_id} failed ({r.stderr.strip()}); the job was cancelled")
        return job_id

    def log_paths(self, job_id: str, task: int = 0) -> tuple[Path, Path]:
        check_job_id(job_id)
        folder = Path(self.slurm.folder)
        return folder / f"{job_id}_{task}_log.out", folder / f"{job_id}_{task}_log.err"

    def wait(self, job_id: str, out=None) -> JobResult:
        out = out or sys.stdout
        stdout, stderr = self.log_paths(job_id)
        offsets = {stdout: 0, stderr: 0}
        state, code = "PENDING", None
        while True:
            state, code = job_state(job_id)
            if self.stream:
                for path in (stdout, stderr):
                    offsets[path] = _tail(path, offsets[path], out)
            if state in FINAL_STATES:
                break
            time.sleep(self.slurm.poll_s)
        time.sleep(0.5)
        if self.stream:
            for path in (stdout, stderr):
                _tail(path, offsets[path], out)
        ok = state == "COMPLETED"
        message = f"slurm job {job_id} {state}" + (f" (exit code {code})" if code else "")
        if not ok:
            detail = _last_error(stderr) or _last_error(stdout)
            if detail:
                message += f": {detail}"
        exit_code = int(code.split(":")[0]) if code and code.split(":")[0].isdigit() else (0 if ok else 1)
        return JobResult(ok, exit_code, str(stderr), message, job_id=job_id)

    def run(self, job: TrainJob, before_start: Callable[[], None] | None = None) -> JobResult:
        job_id = self.submit(job, before_start)
        print(f"submitted slurm job {job_id} (logs: {self.log_paths(job_id)[0]})", flush=True)
        return self.wait(job_id)


def job_state(job_id: str) -> tuple[str, str | None]:
    """(state, exit code "N:S") from scontrol, else sacct; UNKNOWN when neither knows it."""
    check_job_id(job_id)
    require_slurm("scontrol")
    r = subprocess.run(["scontrol", "show", "job", "-o", str(job_id)], capture_output=True, text=True)
    if r.returncode == 0 and "JobState=" in r.stdout:
        fields = dict(kv.split("=", 1) for kv in r.stdout.split() if "=" in kv)
        return fields.get("JobState", "UNKNOWN"), fields.get("ExitCode")
    if shutil.which("sacct") is None:
        return "UNKNOWN", None
    r = subprocess.run(["sacct", "-n", "-X", "-P", "-j", str(job_id), "-o", "State,ExitCode"], capture_output=True, text=True)
    if r.returncode == 0 and r.stdout.strip():
        state, code = r.stdout.strip().splitlines()[0].split("|")
        return state.split()[0], code
    return "UNKNOWN", None


def cancel(job_id: str) -> None:
    check_job_id(job_id)
    require_slurm("scancel")
    r = subprocess.run(["scancel", str(job_id)], capture_output=True, text=True)
    if r.returncode != 0:
        raise PipelineError(f"scancel {job_id} failed: {r.stderr.strip()}")


def _tail(path: Path, offset: int, out) -> int:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return offset
    if data:
        out.write(data.decode(errors="replace"))
        out.flush()
    return offset + len(data)


def _last_error(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    for line in reversed(lines):
        if line.startswith("error:"):
            return line.strip()
    return ""
