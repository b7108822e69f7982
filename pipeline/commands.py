"""What every stage command shares: the params as loaded (one warning line when the preset
outgrew the recipe) and the stage's MLflow run with its ending. Here, not in cli.py, so that the
Slurm commands (pipeline/slurm_cli.py) and the stage commands use the same ones."""

from __future__ import annotations

from pathlib import Path

from pipeline.console import console


def load_config(params: Path, overrides: list[str] | None):
    """The validated params, after one warning line when the model preset outgrew the recipe."""
    from pipeline.params import load_params, params_sources

    cfg = load_params(params, overrides or [])
    _, warning = params_sources(params, overrides or [])
    if warning:
        console.print(f"[bold yellow]warning:[/] {warning}", highlight=False, soft_wrap=True)
    return cfg


def stage_tracker(cfg, stage: str, params: Path, enabled: bool, continue_run: str | None = None):
    """The stage's MLflow run; ``continue_run``: the run of the training this one resumes."""
    if not (enabled and cfg.mlflow.enabled):
        return None
    from pipeline.tracking.stage_run import Tracker

    tracker = Tracker(cfg.mlflow, stage, params, continue_run=continue_run)  # never fails on an unreachable server: spools
    tracker.log_stage_start(cfg.flatten())
    return tracker


class StageRun:
    """Context for one stage's MLflow run: FINISHED on success, FAILED on any error; deleted
    (the parent left as it was) when the command was refused: the scheduler refused the job,
    or bad input (exit code 2) stopped the stage before it logged a figure."""

    def __init__(self, tracker):
        self.tracker = tracker

    def __enter__(self):
        return self.tracker

    def __exit__(self, exc_type, exc, tb):
        from pipeline.errors import SubmissionRefused

        if self.tracker and exc_type is not None and (issubclass(exc_type, SubmissionRefused) or self.tracker.refused(exc)):
            self.tracker.abandon()
        elif self.tracker:
            self.tracker.end(ok=exc_type is None)
        return False
