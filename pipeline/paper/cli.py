"""`moe paper ...`: the paper-reproduction pipeline's commands (bench/paper/dvc.yaml)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from pipeline.console import handle_errors, run_child

PIPELINE_DIR = Path("bench/paper")
paper_app = typer.Typer(no_args_is_help=True, help="Reproduce the paper's system claims (bench/paper/dvc.yaml).")

ParamsOpt = Annotated[Path, typer.Option("--params", "-p", help="params file (the paper pipeline's)")]
SetOpt = Annotated[list[str] | None, typer.Option("--set", "-s", help="override, e.g. paper.steps=10 (repeatable)")]
NoTrackOpt = Annotated[bool, typer.Option("--no-mlflow", help="do not log to MLflow")]


def _tracker(params, stage: str, enabled: bool):
    if not (enabled and params.base.mlflow.enabled):
        return None
    from pipeline.tracking.stage_run import Tracker

    tracker = Tracker(_main_store(params.base.mlflow), f"paper/{stage}", params.path, parent_name="paper reproduction")
    flat = {f"paper.{k}": v for k, v in params.paper.flatten().items()}
    flat.update({k: v for k, v in params.base.flatten().items() if k.split(".")[0] in ("executor", "slurm", "container", "tokenize")})
    tracker.log_stage_start(flat)
    return tracker


def _main_store(cfg):
    """The paper pipeline's runs go to the main project's store (`make ui` shows them), though
    bench/paper is a DVC project of its own; a tracking URI set anywhere wins."""
    import dataclasses

    from pipeline.project import main_project_root
    from pipeline.tracking.client import tracking_uri

    if cfg.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI"):
        return cfg
    return dataclasses.replace(cfg, tracking_uri=tracking_uri(cfg, main_project_root()))


@paper_app.command("tokenize")
def tokenize_cmd(params: ParamsOpt = Path("params.yaml"), set_: SetOpt = None, no_mlflow: NoTrackOpt = False) -> None:
    """Tokenise the corpus the learned-routing stage reads (tokenize: section); it logs no MLflow
    run, and takes --no-mlflow as every stage does."""
    del no_mlflow

    @handle_errors
    def go():
        from pipeline.paper.config import load_paper_params
        from pipeline.stages.tokenize import run_tokenize

        p = load_paper_params(params, set_ or [])
        run_tokenize(p.base.tokenize)

    go()


@paper_app.command("stage")
def stage_cmd(
    name: Annotated[str, typer.Argument(help="resident | experts | fp8 | recompute | ep | gerrymander")],
    params: ParamsOpt = Path("params.yaml"),
    set_: SetOpt = None,
    no_mlflow: NoTrackOpt = False,
) -> None:
    """Measure one claim; writes <paper.results>/<name>.json."""

    @handle_errors
    def go():
        from pipeline.paper.config import load_paper_params
        from pipeline.paper.stages import run_stage

        p = load_paper_params(params, set_ or [])
        tracker = _tracker(p, name, not no_mlflow)
        ok = False
        try:
            path = run_stage(name, p, tracker)
            ok = True
        finally:
            if tracker is not None:
                tracker.end(ok)
        typer.echo(f"wrote {path}")

    go()


@paper_app.command("report")
def report_cmd(params: ParamsOpt = Path("params.yaml"), set_: SetOpt = None, no_mlflow: NoTrackOpt = False) -> None:
    """REPORT.md and plots/*.png from the stages' results."""

    @handle_errors
    def go():
        from pipeline.paper.config import load_paper_params
        from pipeline.paper.report import write_report

        p = load_paper_params(params, set_ or [])
        report = write_report(p.paper.results, Path(p.paper.results).parent if Path(p.paper.results).parent != Path("") else ".")
        tracker = _tracker(p, "report", not no_mlflow)
        if tracker is not None:
            tracker.log_artifact(report)
            pngs = sorted((report.parent / "plots").glob("*.png"))
            for png in pngs:
                tracker.log_artifact(png, "plots")
            if not tracker.failed:  # the parent gets the report too (best effort, like the Tracker)
                try:
                    for png in pngs:
                        tracker.client.log_artifact(tracker.parent_id, str(png), "plots")
                    tracker.client.log_artifact(tracker.parent_id, str(report))
                    _log_parent_metrics(tracker, Path(p.paper.results))
                except Exception as exc:  # noqa: BLE001 - tracking never fails the stage
                    typer.echo(f"warning: could not log the report to the parent MLflow run ({type(exc).__name__})", err=True)
            tracker.end(True)
        typer.echo(f"wrote {report}")

    go()


def _log_parent_metrics(tracker, results: Path) -> None:
    """The parent 'paper reproduction' run holds every stage's derived figures."""
    import time

    from mlflow.entities import Metric

    from pipeline.paper.claims import STAGES
    from pipeline.paper.results import load_stage_result
    from pipeline.units import GIB_NAME

    now = int(time.time() * 1000)
    items = []
    for stage in STAGES:  # the result files the report has just read
        path = results / f"{stage}.json"
        if not path.is_file():
            continue
        r = load_stage_result(path)
        for k, v in r.get("derived", {}).items():
            pairs = v.items() if isinstance(v, dict) else [(None, v)]
            for kk, vv in pairs:
                if isinstance(vv, (int, float)) and not isinstance(vv, bool):
                    # a GiB figure under its name now, from results older than issue 49 too
                    name = f"{k}/{GIB_NAME.get(kk, kk)}" if kk else GIB_NAME.get(k, k)
                    items.append(Metric(f"{stage}/{name}", float(vv), now, 0))
    for i in range(0, len(items), 900):
        tracker.client.log_batch(tracker.parent_id, metrics=items[i : i + 900])


@paper_app.command("repro")
def repro_cmd(
    no_dvc: Annotated[bool, typer.Option("--no-dvc", help="run the stages in order here, without DVC (e.g. in a GPU image)")] = False,
    set_: SetOpt = None,
    no_mlflow: NoTrackOpt = False,
) -> None:
    """Run the whole paper pipeline: `dvc repro` in bench/paper, a DVC project of its own (or in
    order with --no-dvc): it never takes the main pipeline's lock nor shows in its `dvc status`."""
    if not PIPELINE_DIR.is_dir():
        typer.echo(f"error: {PIPELINE_DIR}: not found (run from the repository root)", err=True)
        raise typer.Exit(2)
    if not no_dvc:
        if set_:
            typer.echo("error: --set applies with --no-dvc; with DVC edit bench/paper/params.yaml or use `dvc exp run -S` in bench/paper", err=True)
            raise typer.Exit(2)
        from pipeline.dvc_run import call

        raise typer.Exit(call(["repro"], cwd=PIPELINE_DIR))
    from pipeline.paper.claims import STAGES

    root = str(Path.cwd().resolve())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(x for x in (root, os.environ.get("PYTHONPATH")) if x)}
    args = [a for s in (set_ or []) for a in ("--set", s)] + (["--no-mlflow"] if no_mlflow else [])
    steps = [["tokenize", *args]] + [["stage", s, *args] for s in STAGES] + [["report", *args]]
    for step in steps:
        code = run_child([sys.executable, "-m", "pipeline.paper", *step], cwd=PIPELINE_DIR, env=env)
        if code:
            raise typer.Exit(code)
