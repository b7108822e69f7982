"""`moe train`: the training job on the configured executor (pipeline/stages/train.py); the
Slurm commands beside it are pipeline/slurm_cli.py's."""

from __future__ import annotations

from pathlib import Path

from pipeline.commands import StageRun, load_config, stage_tracker
from pipeline.console import NoTrackOpt, ParamsOpt, SetOpt, console
from pipeline.stage_commands.tokenize import log_tokens


def command(params: ParamsOpt = Path("params.yaml"), set_: SetOpt = None, no_mlflow: NoTrackOpt = False) -> None:
    """Train from params.yaml with the configured executor; writes checkpoints and metrics."""
    cfg = load_config(params, set_)  # a config error answers first, before the stage's imports
    from pipeline.stages.train import preflight, run_train

    console.print(model_line(cfg.model), highlight=False)
    checked = preflight(cfg)  # a refusal opens no MLflow run and marks no earlier one FAILED
    from pipeline.resume import continued_run_id

    resumed = continued_run_id(checked[0].to_dict(), cfg.executor.run_dir)  # resuming: the same MLflow run goes on
    with StageRun(stage_tracker(cfg, "train", params, not no_mlflow, resumed)) as tracker:
        if tracker and not cfg.data.paths:
            log_tokens(tracker, cfg.tokenize.output, "train", "training")
        metrics = run_train(cfg, tracker, checked)
        if tracker:
            tracker.log_artifacts("plots", "plots")
    loss = "n/a" if metrics["final_loss"] is None else f"{metrics['final_loss']:.4f}"
    console.print(f"trained {metrics['steps']} steps: final loss {loss}, {metrics['tokens_per_s_per_device']:.0f} tokens/s/device")


def model_line(m) -> str:
    """The resolved model shape, and what differs from its preset, as a run is labelled."""
    label = f"preset {m.preset}" + (f" with {', '.join(m.preset_overrides)} overridden" if m.preset_overrides else "") if m.preset else "no preset"
    return (
        f"model ({label}): d_model={m.d_model} n_layers={m.n_layers} n_heads={m.n_heads} vocab_size={m.vocab_size} "
        f"experts={m.moe.num_experts} top_k={m.moe.top_k} expert_hidden={m.moe.expert_hidden}"
    )
