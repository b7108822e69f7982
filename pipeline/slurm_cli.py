"""The Slurm commands: submit the training job, plan it, write its spec for sbatch, and follow,
read or cancel a submitted job (`moe submit`, `plan`, `job`, `status`, `logs`, `cancel`,
`image-digest`). Registered on the `moe` app by pipeline/cli.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

from pipeline.commands import StageRun as _Stage
from pipeline.commands import load_config as _load
from pipeline.commands import stage_tracker as _tracker
from pipeline.console import GpuOpt, NoTrackOpt, ParamsOpt, SetOpt, console, fail, handle_errors, typer

_app = typer.Typer()  # the commands are defined here, then copied onto the `moe` app (register)


@_app.command()
@handle_errors
def submit(
    params: ParamsOpt = Path("params.yaml"),
    set_: SetOpt = None,
    wait: Annotated[bool, typer.Option("--wait", help="block until the job ends, streaming rank 0's log")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="print the exact sbatch script; submit nothing")] = False,
    nodes: Annotated[int | None, typer.Option(help="slurm.nodes")] = None,
    tasks_per_node: Annotated[int | None, typer.Option(help="slurm.tasks_per_node")] = None,
    gpus_per_node: Annotated[int | None, typer.Option(help="slurm.gpus_per_node")] = None,
    partition: Annotated[str | None, typer.Option(help="slurm.partition")] = None,
    time_min: Annotated[int | None, typer.Option(help="slurm.time_min")] = None,
    gpu: GpuOpt = "h200",
    ignore_plan: Annotated[bool, typer.Option("--ignore-plan", help="submit even when the plan predicts it does not fit")] = False,
    no_mlflow: NoTrackOpt = False,
) -> None:
    """Submit the training job to Slurm (submitit); prints the job id. GPU jobs are planned
    first (`moe plan`) and refused when predicted not to fit (--ignore-plan overrides)."""
    flags = {
        "slurm.nodes": nodes,
        "slurm.tasks_per_node": tasks_per_node,
        "slurm.gpus_per_node": gpus_per_node,
        "slurm.partition": partition,
        "slurm.time_min": time_min,
    }
    overrides = [*(set_ or []), "executor.kind=slurm", *(f"{k}={v}" for k, v in flags.items() if v is not None)]
    cfg = _load(params, overrides)  # a config error answers first, before the stage's imports
    from pipeline.executors.slurm import SlurmExecutor
    from pipeline.stages.train import finish_train, launch_train, make_job, preflight

    executor = SlurmExecutor(cfg.slurm, cfg.container)
    if cfg.slurm.gpus_per_node:
        _check_plan(cfg, gpu, cfg.slurm.nodes * cfg.slurm.tasks_per_node, show=dry_run, ignore=ignore_plan or dry_run)
    if dry_run:
        job = make_job(cfg, resolve_data=False)
        print(executor.sbatch_script(job), end="")
        return
    # Every check before anything is created or changed: Slurm here, the job's inputs (a refusal
    # opens no MLflow run); then launch_train prepares the run directory (checkpoints resumed,
    # extended or refused; stale ones removed only once sbatch has accepted the job).
    checked = preflight(cfg)
    from pipeline.resume import continued_run_id

    tracker = _tracker(cfg, "train", params, not no_mlflow, continued_run_id(checked[0].to_dict(), cfg.executor.run_dir))
    job = make_job(cfg, tracker, checked=checked)  # (checked already: it refuses nothing now)
    job.mlflow_finalize = not wait
    # launch_train owns the run's endings: abandoned if the job never ran, tagged with its id, and
    # left to the job (system metrics stopped here) when nobody waits
    job_id = launch_train(cfg, job, tracker, wait=False, in_loop=checked.in_loop).job_id  # a resuming job appends to metrics.jsonl
    print(job_id, flush=True)
    if not wait:
        return
    with _Stage(tracker):
        result = executor.wait(job_id)
        if not result.ok:
            from pipeline.errors import JobFailed

            raise JobFailed(f"{result.message}; log: {result.log_path}", result.exit_code)
        metrics = finish_train(cfg, job, tracker)
    loss = "n/a" if metrics["final_loss"] is None else f"{metrics['final_loss']:.4f}"
    console.print(f"slurm job {job_id} done: final loss {loss}")


def _check_plan(cfg, gpu: str, gpus: int, show: bool, ignore: bool) -> None:
    """Plan the job; refuse one predicted not to fit unless told to go ahead."""
    from moe.plan.planner import make_plan
    from moe.plan.report import format_plan

    plan = make_plan(cfg, gpu, gpus)
    if show:
        console.print(format_plan(plan), highlight=False, soft_wrap=True)
    if not plan.fits and not ignore:
        fail(f"moe plan: {plan.verdict()} (--ignore-plan submits anyway)", 2)


@_app.command()
@handle_errors
def plan(
    params: ParamsOpt = Path("params.yaml"),
    set_: SetOpt = None,
    gpu: GpuOpt = "h200",
    gpus: Annotated[
        int | None, typer.Option(help="GPUs of the job (default: slurm.nodes x slurm.tasks_per_node for executor.kind=slurm, else executor.nprocs)")
    ] = None,
    mfu: Annotated[float, typer.Option(help="model FLOPs utilisation for the predicted step time")] = 0.4,
    as_json: Annotated[bool, typer.Option("--json", help="print the plan as JSON")] = False,
) -> None:
    """Parameters, per-GPU memory, FLOPs and step time of a config; does it fit, and what helps."""
    cfg = _load(params, set_)  # a config error answers before torch loads
    from moe.plan.planner import make_plan
    from moe.plan.report import format_plan

    if gpus is None:
        gpus = cfg.slurm.nodes * cfg.slurm.tasks_per_node if cfg.executor.kind == "slurm" else cfg.executor.nprocs
    result = make_plan(cfg, gpu, gpus, mfu)
    if as_json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(format_plan(result))


@_app.command()
@handle_errors
def job(
    params: ParamsOpt = Path("params.yaml"),
    set_: SetOpt = None,
    out: Annotated[Path | None, typer.Option(help="where to write the spec (default: <slurm.folder>/job.json)")] = None,
) -> None:
    """Write the resolved training job spec for slurm/train.sbatch; print its path.

    The spec goes outside the run directory (a DVC output), so DVC does not see a change. It
    carries no resolved layout: sbatch's own flags choose the world size, so the job's layout
    resolves the config against the world it starts in."""
    import dataclasses

    cfg = _load(params, set_)  # a config error answers first, before the stage's imports
    from pipeline.outputs import check_output_file, write_output_file
    from pipeline.run_dirs import is_job_spec
    from pipeline.stages.train import check_train, make_job

    spec = out or Path(cfg.slurm.folder) / "job.json"
    checked = check_train(cfg)
    plain = dataclasses.replace(make_job(cfg, checked=checked), layout=None)
    check_output_file(spec, "--out", is_job_spec)  # before anything is written
    if checked.in_loop is not None:  # the in-loop tasks tokenised beside the spec, where its ranks read them
        from pipeline.eval.inloop import REQUESTS_FILE, eval_inputs, write_in_loop_requests

        requests = write_in_loop_requests(spec.with_name(REQUESTS_FILE), checked.in_loop)
        plain.eval_inputs = eval_inputs(requests, cfg.tokenize.output)
    write_output_file(spec, json.dumps(dataclasses.asdict(plain), indent=2), "--out", is_job_spec)  # never a user's file
    print(spec)


@_app.command()
@handle_errors
def status(job_id: Annotated[str, typer.Argument(help="Slurm job id")]) -> None:
    """State and exit code of a Slurm job."""
    from pipeline.executors.slurm import job_state

    state, code = job_state(job_id)
    print(f"{job_id} {state}" + (f" exit={code}" if code else ""))
    if state == "UNKNOWN":
        raise typer.Exit(2)


@_app.command()
@handle_errors
def logs(
    job_id: Annotated[str, typer.Argument(help="Slurm job id")],
    params: ParamsOpt = Path("params.yaml"),
    task: Annotated[int, typer.Option(help="task (global rank)")] = 0,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="keep streaming until the job ends")] = False,
) -> None:
    """Print a task's log (stdout and stderr) of a submitted job."""
    from pipeline.executors.slurm import SlurmExecutor

    cfg = _load(params, [])
    executor = SlurmExecutor(cfg.slurm, cfg.container)
    out, err = executor.log_paths(job_id, task)
    if follow:
        executor.wait(job_id)
        return
    if not out.exists() and not err.exists():
        fail(f"no logs for job {job_id} task {task} in {cfg.slurm.folder}", 2)
    for path in (out, err):
        if path.exists():
            sys.stdout.write(path.read_text(errors="replace"))


@_app.command()
@handle_errors
def cancel(job_id: Annotated[str, typer.Argument(help="Slurm job id")]) -> None:
    """Cancel a Slurm job."""
    from pipeline.executors.slurm import cancel as scancel

    scancel(job_id)
    print(f"cancelled {job_id}")


@_app.command("image-digest")
@handle_errors
def image_digest(image: Annotated[Path, typer.Argument(help="a directory image (e.g. from ch-convert)")]) -> None:
    """Content digest of a directory image, for container.image_digest."""
    from pipeline.containers import directory_image_digest

    if not image.is_dir():
        fail(f"{image}: not a directory image", 2)
    print(directory_image_digest(image))


def register(app: typer.Typer) -> None:
    """Add the Slurm commands to ``app`` in the order `moe --help` lists them."""
    app.registered_commands.extend(_app.registered_commands)
