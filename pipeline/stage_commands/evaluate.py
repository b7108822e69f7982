"""`moe evaluate`: the converted model's validation loss and downstream tasks, or a curve over
checkpoints (pipeline/stages/evaluate.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pipeline.commands import StageRun, load_config, stage_tracker
from pipeline.console import NoTrackOpt, ParamsOpt, SetOpt, console, typer
from pipeline.stage_commands.tokenize import log_tokens


def command(
    params: ParamsOpt = Path("params.yaml"),
    set_: SetOpt = None,
    no_mlflow: NoTrackOpt = False,
    checkpoint: Annotated[
        list[str] | None, typer.Option("--checkpoint", help="evaluate our model at this checkpoint (repeatable: a curve), without a conversion")
    ] = None,
) -> None:
    """Validation loss/perplexity and the downstream tasks (evaluate.tasks), ours and transformers', a greedy sample."""
    cfg = load_config(params, set_)  # a config error answers before torch loads
    from pipeline.stages.evaluate import run_checkpoint_curve, run_evaluate

    if checkpoint:
        with StageRun(stage_tracker(cfg, "evaluate-checkpoints", params, not no_mlflow)) as tracker:
            curve = run_checkpoint_curve(cfg, checkpoint, tracker)
        for p in curve["points"]:
            tasks = ", ".join(f"{n} bpb {_pm(r, 'bpb')}" for n, r in p["tasks"].items())
            console.print(f"step {p['step']}: val loss {p['val_loss']:.4f}; {tasks}", highlight=False, soft_wrap=True)
        return
    with StageRun(stage_tracker(cfg, "evaluate", params, not no_mlflow)) as tracker:
        if tracker:
            log_tokens(tracker, cfg.tokenize.output, "val", "evaluation")
        m = run_evaluate(cfg, tracker)
    subset = "" if m["val_windows"] == m["val_windows_total"] else f" over the first {m['val_windows']} of {m['val_windows_total']} windows"
    console.print(
        f"val loss{subset} {m['val_loss']:.4f} (transformers {m['hf_val_loss']:.4f}, rel diff {m['hf_rel_diff']:.1e}), "
        f"perplexity {m['val_perplexity']:.2f}, {m['eval_tokens_per_s']:.0f} tokens/s"
    )
    for name, r in m["tasks"].items():
        console.print(f"  {name}: {task_line(r)}", highlight=False, soft_wrap=True)
    capped = f" (capped at {m['generate_tokens']} tokens by model.max_seq_len)" if m.get("generation_capped") else ""
    console.print(f"sample{capped}: {m['sample']!r}", highlight=False)


def _pm(r: dict, key: str) -> str:
    """``0.412 ± 0.035``: a metric and its standard error (the number alone where it has none)."""
    err = r.get(f"{key}/stderr")
    return f"{r[key]:.3f}" + ("" if err is None else f" ± {err:.3f}")


def task_line(r: dict) -> str:
    """One task of the evaluate stage's table: the primary accuracy beside chance and majority,
    bpb, each with its standard error; how many documents of the task's total (a sample:
    evaluate.limit); and how many had their context cut (or were dropped) to fit the model."""
    majority = f", majority {r['majority']:.3f}" if "majority" in r else ""  # the best one fixed answer scores
    acc = f"{r['primary']} {_pm(r, r['primary'] + '_v2')} (chance {r['chance']:.3f}{majority}), " if "chance" in r else ""
    if f"{r['primary']}_v2_macro" in r:  # MMLU: the mean over its subjects as well, as OLMES reports it
        acc += f"{r['primary']} over its {int(r['subjects'])} subjects {_pm(r, r['primary'] + '_v2_macro')}, "
    line = f"{acc}bpb {_pm(r, 'bpb_v2')} over {int(r['docs'])} of {int(r['docs_total'])} documents"
    if r.get("truncated_docs"):
        line += f"; {int(r['truncated_docs'])} cut to fit (up to {int(r['truncated_tokens_max'])} tokens)"
    if r.get("dropped_docs"):
        line += f"; {int(r['dropped_docs'])} dropped (longer than the model's context)"
    return line
