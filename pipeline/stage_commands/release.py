"""`moe release`: the converted model with the final evaluation on its card
(pipeline/stages/release.py)."""

from __future__ import annotations

from pathlib import Path

from pipeline.commands import load_config
from pipeline.console import NoTrackOpt, ParamsOpt, SetOpt, console


def command(params: ParamsOpt = Path("params.yaml"), set_: SetOpt = None, no_mlflow: NoTrackOpt = False) -> None:
    """The converted model with the final evaluation on its card (release.output), after evaluate.
    It logs no MLflow run (evaluate's holds the numbers); --no-mlflow is taken as by every stage."""
    del no_mlflow
    cfg = load_config(params, set_)  # a config error answers before torch loads
    from pipeline.model_card import card_text
    from pipeline.stages.release import run_release

    done = run_release(cfg, card_text)
    console.print(
        f"wrote {cfg.release.output}: the converted model of step {done['step']} with the evaluate stage's numbers on its card", highlight=False
    )
