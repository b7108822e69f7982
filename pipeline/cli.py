"""The `moe` command line: pipeline stages, benchmarks and tools.

Every stage reads params.yaml (``--params``) with ``--set key=value`` overrides. Exit codes:
0 done, 1 unexpected error, 2 bad input (params, data, files), 3 non-finite loss,
4 checkpoint problem, 5 a training job failed.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Annotated

try:
    import typer
    from rich.console import Console
    from rich.markup import escape
except ImportError as _exc:  # `pip install .` without the extra: say which one
    raise SystemExit(f"error: the moe command needs the pipeline extra ({_exc}): pip install 'moe-pipeline[pipeline]'") from None

from moe.config import ConfigError
from pipeline.errors import PipelineError
from pipeline.redact import redact

# Commands import torch, mlflow and the stages lazily: `moe --help` stays fast.
app = typer.Typer(add_completion=True, no_args_is_help=True, help=__doc__, rich_markup_mode="rich")
console = Console(stderr=True)


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
) -> None:
    """The `moe` command line: pipeline stages, benchmarks and tools."""

ParamsOpt = Annotated[Path, typer.Option("--params", "-p", help="params file")]
SetOpt = Annotated[list[str] | None, typer.Option("--set", "-s", help="override, e.g. model.moe.num_experts=16 (repeatable)")]
NoTrackOpt = Annotated[bool, typer.Option("--no-mlflow", help="do not log to MLflow")]
GpuOpt = Annotated[str, typer.Option("--gpu", help="GPU kind for the memory plan: h100, h200, b200 or b300")]


def fail(message: str, code: int) -> None:
    console.print(f"[bold red]error:[/] {escape(redact(message))}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def _unexpected(exc: BaseException) -> None:
    """A bug, not bad input: the traceback (credentials masked) and exit code 1."""
    import traceback

    sys.stderr.write(redact("".join(traceback.format_exception(exc))))
    fail(f"unexpected {type(exc).__name__}: {exc}", 1)


def handle_errors(fn):
    """One clear line and a meaningful exit code for every expected failure."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except typer.Exit:
            raise
        except PipelineError as exc:
            fail(str(exc), exc.exit_code)
        except ConfigError as exc:
            fail(str(exc), 2)
        except (ValueError, RuntimeError) as exc:
            code = _library_error_code(exc)
            if code is None:
                raise
            fail(str(exc), code)
        except ModuleNotFoundError as exc:
            fail(missing_module_message(exc.name or str(exc)), 2)
        except FileNotFoundError as exc:
            fail(f"{exc.filename}: not found", 2)
        except OSError as exc:
            if exc.filename is None and exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                _unexpected(exc)
            where = exc.filename or os.getcwd()
            fail(f"{where}: {exc.strerror or exc}" + (" (the disk is full)" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else ""), 2)
        except MemoryError:
            fail("out of memory (the input or the model is larger than this machine holds)", 2)
        except RecursionError:
            fail("the input is nested too deeply to read", 2)
        except KeyboardInterrupt:
            fail("interrupted", 130)
        except Exception as exc:
            _unexpected(exc)

    return wrapper


# What a missing module means: the extra (or option) that brings it.
MISSING_MODULE_HINTS = {
    "mlflow": "MLflow is not installed here: pip install 'moe-pipeline[pipeline]', or pass --no-mlflow",
    "transformers": "transformers is not installed here: pip install 'moe-pipeline[pipeline]'",
    "tokenizers": "tokenizers is not installed here: pip install 'moe-pipeline[pipeline]'",
    "safetensors": "safetensors is not installed here: pip install 'moe-pipeline[pipeline]'",
    "submitit": "submitit is not installed here: pip install 'moe-pipeline[pipeline]'",
    "pyarrow": "pyarrow is not installed here: pip install 'moe-pipeline[pipeline]'",
    "matplotlib": "matplotlib is not installed here: pip install 'moe-pipeline[pipeline]'",
    "psycopg2": "psycopg2 is not installed here (a PostgreSQL MLflow backend needs it)",
}


def missing_module_message(name: str) -> str:
    top = name.split(".")[0]
    return MISSING_MODULE_HINTS.get(top, f"the Python module {top} is not installed here (pip install it, or the extra that has it)")


def _library_error_code(exc: BaseException) -> int | None:
    """Exit code of the library's expected errors (their modules import torch: looked up only
    once imported, which raising them implies)."""
    tokens, ckpt = sys.modules.get("moe.data.tokens"), sys.modules.get("moe.train.checkpoint")
    if tokens is not None and isinstance(exc, tokens.TokenDataError):
        return 2
    if ckpt is not None and isinstance(exc, ckpt.CheckpointError):
        return 4
    return None


def _model_line(m) -> str:
    """The resolved model shape, and what differs from its preset, as a run is labelled."""
    label = f"preset {m.preset}" + (f" with {', '.join(m.preset_overrides)} overridden" if m.preset_overrides else "") if m.preset else "no preset"
    return (f"model ({label}): d_model={m.d_model} n_layers={m.n_layers} n_heads={m.n_heads} vocab_size={m.vocab_size} "
            f"experts={m.moe.num_experts} top_k={m.moe.top_k} expert_hidden={m.moe.expert_hidden}")


def _log_tokens(tracker, tokens_dir: str, split: str, context: str) -> None:
    """A token split as the run's MLflow dataset input; its digest covers the tokenizer and the files."""
    import hashlib

    manifest_path = Path(tokens_dir) / "manifest.json"
    if not manifest_path.is_file():
        return
    manifest = json.loads(manifest_path.read_text())
    part = {"tokenizer": manifest.get("tokenizer", {}).get("sha256"), "split": manifest.get("splits", {}).get(split)}
    digest = hashlib.sha256(json.dumps(part, sort_keys=True).encode()).hexdigest()
    tracker.log_dataset(f"tokens/{split}", Path(tokens_dir) / split, digest, context)


def _load(params: Path, overrides: list[str] | None):
    from pipeline.params import load_params

    return load_params(params, overrides or [])


def _tracker(cfg, stage: str, params: Path, enabled: bool):
    if not (enabled and cfg.mlflow.enabled):
        return None
    from pipeline.tracking import Tracker

    tracker = Tracker(cfg.mlflow, stage, params)  # never fails on an unreachable server: spools
    tracker.log_stage_start(cfg.flatten())
    return tracker


class _Stage:
    """Context for one stage's MLflow run: FINISHED on success, FAILED on any error."""

    def __init__(self, tracker):
        self.tracker = tracker

    def __enter__(self):
        return self.tracker

    def __exit__(self, exc_type, exc, tb):
        if self.tracker:
            self.tracker.end(ok=exc_type is None)
        return False


@app.command()
@handle_errors
def tokenize(params: ParamsOpt = Path("params.yaml"), set_: SetOpt = None, no_mlflow: NoTrackOpt = False) -> None:
    """Raw text -> token files (train/ and val/), tokenizer.json and manifest.json."""
    from pipeline.stages.tokenize import run_tokenize

    cfg = _load(params, set_)
    with _Stage(_tracker(cfg, "tokenize", params, not no_mlflow)) as tracker, _progress() as bar:
        task = bar.add_task("tokenize", total=None)
        manifest = run_tokenize(cfg.tokenize, progress=lambda done, total: bar.update(task, completed=done, total=total))
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
        console.print(f"[yellow]warning:[/] skipped {len(manifest['skipped_files'])} input file(s) that are not UTF-8 text "
                      f"(listed in {cfg.tokenize.output}/manifest.json)")


@app.command()
@handle_errors
def train(params: ParamsOpt = Path("params.yaml"), set_: SetOpt = None, no_mlflow: NoTrackOpt = False) -> None:
    """Train from params.yaml with the configured executor; writes checkpoints and metrics."""
    from pipeline.stages.train import run_train

    cfg = _load(params, set_)
    console.print(_model_line(cfg.model), highlight=False)
    with _Stage(_tracker(cfg, "train", params, not no_mlflow)) as tracker:
        if tracker and not cfg.data.paths:
            _log_tokens(tracker, cfg.tokenize.output, "train", "training")
        metrics = run_train(cfg, tracker)
        if tracker:
            tracker.log_artifacts("plots", "plots")
    loss = "n/a" if metrics["final_loss"] is None else f"{metrics['final_loss']:.4f}"
    console.print(f"trained {metrics['steps']} steps: final loss {loss}, {metrics['tokens_per_s_per_device']:.0f} tokens/s/device")


@app.command()
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
    from pipeline.executors.slurm import SlurmExecutor
    from pipeline.run_lock import RunLock, command_line
    from pipeline.stages.train import container_tags, finish_train, make_job, prepare_run

    flags = {"slurm.nodes": nodes, "slurm.tasks_per_node": tasks_per_node, "slurm.gpus_per_node": gpus_per_node,
             "slurm.partition": partition, "slurm.time_min": time_min}
    overrides = [*(set_ or []), "executor.kind=slurm", *(f"{k}={v}" for k, v in flags.items() if v is not None)]
    cfg = _load(params, overrides)
    executor = SlurmExecutor(cfg.slurm, cfg.container)
    if cfg.slurm.gpus_per_node:
        _check_plan(cfg, gpu, cfg.slurm.nodes * cfg.slurm.tasks_per_node, show=dry_run, ignore=ignore_plan or dry_run)
    if dry_run:
        job = make_job(cfg, resolve_data=False)
        print(executor.sbatch_script(job), end="")
        return
    tracker = _tracker(cfg, "train", params, not no_mlflow)
    job = make_job(cfg, tracker)
    try:
        with RunLock(job.run_dir, job.checkpoint_dir).acquire(f"{command_line()} (preparing the job)"):
            start = prepare_run(job)  # resume, extend or refuse, before the job is queued
    except BaseException:
        if tracker:
            tracker.end(ok=False)
        raise
    if tracker:
        tracker.set_tags({"train.start": start})
    job.mlflow_finalize = not wait
    if tracker:
        tracker.set_tags(container_tags(cfg))
    try:
        job_id = executor.submit(job)  # a resuming job appends to metrics.jsonl
    except BaseException:
        if tracker:
            tracker.end(ok=False)
        raise
    if tracker:
        tracker.set_tags({"slurm.job_id": job_id})
    print(job_id, flush=True)
    if not wait:
        if tracker:
            tracker.stop_system_metrics()
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
    from moe.train.plan import format_plan, make_plan

    plan = make_plan(cfg, gpu, gpus)
    if show:
        console.print(format_plan(plan), highlight=False, soft_wrap=True)
    if not plan.fits and not ignore:
        fail(f"moe plan: {plan.verdict()} (--ignore-plan submits anyway)", 2)


@app.command()
@handle_errors
def plan(
    params: ParamsOpt = Path("params.yaml"),
    set_: SetOpt = None,
    gpu: GpuOpt = "h200",
    gpus: Annotated[int | None, typer.Option(help="GPUs of the job (default: slurm.nodes x slurm.tasks_per_node for "
                                                  "executor.kind=slurm, else executor.nprocs)")] = None,
    mfu: Annotated[float, typer.Option(help="model FLOPs utilisation for the predicted step time")] = 0.4,
    as_json: Annotated[bool, typer.Option("--json", help="print the plan as JSON")] = False,
) -> None:
    """Parameters, per-GPU memory, FLOPs and step time of a config; does it fit, and what helps."""
    from moe.train.plan import format_plan, make_plan

    cfg = _load(params, set_)
    if gpus is None:
        gpus = cfg.slurm.nodes * cfg.slurm.tasks_per_node if cfg.executor.kind == "slurm" else cfg.executor.nprocs
    result = make_plan(cfg, gpu, gpus, mfu)
    if as_json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(format_plan(result))


@app.command()
@handle_errors
def job(
    params: ParamsOpt = Path("params.yaml"),
    set_: SetOpt = None,
    out: Annotated[Path | None, typer.Option(help="where to write the spec (default: <slurm.folder>/job.json)")] = None,
) -> None:
    """Write the resolved training job spec for slurm/train.sbatch; print its path.

    The spec goes outside the run directory (a DVC output), so DVC does not see a change."""
    import dataclasses

    from pipeline.stages.train import make_job

    cfg = _load(params, set_)
    spec = out or Path(cfg.slurm.folder) / "job.json"
    spec.parent.mkdir(parents=True, exist_ok=True)
    tmp = spec.with_name(spec.name + ".tmp")
    tmp.write_text(json.dumps(dataclasses.asdict(make_job(cfg)), indent=2))
    tmp.replace(spec)
    print(spec)


@app.command()
@handle_errors
def status(job_id: Annotated[str, typer.Argument(help="Slurm job id")]) -> None:
    """State and exit code of a Slurm job."""
    from pipeline.executors.slurm import job_state

    state, code = job_state(job_id)
    print(f"{job_id} {state}" + (f" exit={code}" if code else ""))
    if state == "UNKNOWN":
        raise typer.Exit(2)


@app.command()
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


@app.command()
@handle_errors
def cancel(job_id: Annotated[str, typer.Argument(help="Slurm job id")]) -> None:
    """Cancel a Slurm job."""
    from pipeline.executors.slurm import cancel as scancel

    scancel(job_id)
    print(f"cancelled {job_id}")


@app.command("image-digest")
@handle_errors
def image_digest(image: Annotated[Path, typer.Argument(help="a directory image (e.g. from ch-convert)")]) -> None:
    """Content digest of a directory image, for container.image_digest."""
    from pipeline.containers import directory_image_digest

    if not image.is_dir():
        fail(f"{image}: not a directory image", 2)
    print(directory_image_digest(image))


@app.command("mlflow-server")
@handle_errors
def mlflow_server(
    backend: Annotated[str, typer.Option(help="backend store URI (user, no password: see --password-file)", envvar="MOE_MLFLOW_BACKEND")] = "postgresql+psycopg2://mlflow@127.0.0.1:5432/mlflow",
    password_file: Annotated[Path | None, typer.Option(help="file holding the backend's password (else $MOE_MLFLOW_BACKEND_PASSWORD)")] = None,
    artifacts: Annotated[Path, typer.Option(help="artifact root directory")] = Path("mlartifacts"),
    host: Annotated[str, typer.Option(help="bind address")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port")] = 5000,
    workers: Annotated[int, typer.Option(help="server worker processes")] = 2,
) -> None:
    """A tracking server for many jobs (PostgreSQL backend); point jobs at it with MLFLOW_TRACKING_URI.

    The backend URI reaches the server through its environment, never its command line (`ps`)."""
    from pipeline.redact import read_password, redact, with_password

    password = read_password("MOE_MLFLOW_BACKEND_PASSWORD", password_file)
    if password is not None:
        try:
            backend = with_password(backend, password)
        except ValueError as exc:
            fail(f"--backend: {exc}", 2)
    artifacts.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "mlflow", "server", "--artifacts-destination",
           str(artifacts.resolve()), "--serve-artifacts", "--host", host, "--port", str(port), "--workers", str(workers)]
    console.print(f"MLflow server on http://{host}:{port} (store {redact(backend)})", highlight=False, soft_wrap=True)
    raise typer.Exit(_serve(cmd, env={**os.environ, "MLFLOW_BACKEND_STORE_URI": backend}))


@app.command("mlflow-sync")
@handle_errors
def mlflow_sync(
    run_dir: Annotated[Path, typer.Argument(help="a run directory holding mlflow-fallback.jsonl")] = Path("runs/train"),
    params: ParamsOpt = Path("params.yaml"),
) -> None:
    """Upload what a job or stage could not send (the tracking server was unreachable)."""
    from pipeline.params import MlflowConfig
    from pipeline.redact import redact
    from pipeline.tracking import STAGE_FALLBACK, sync_fallback, tracking_uri

    cfg = _load(params, []) if params.is_file() else None
    uri = tracking_uri(cfg.mlflow if cfg else MlflowConfig())
    try:
        n = sync_fallback([STAGE_FALLBACK, run_dir / "mlflow-fallback.jsonl"], uri)
    except PipelineError:
        raise
    except Exception as exc:  # unreachable or unsupported store: keep the spool, say so in one line
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise PipelineError(f"cannot upload to {uri} ({first[:300]}); the spool files are kept, sync again later") from None
    console.print(f"uploaded {n} metric values to {redact(uri)}", highlight=False, soft_wrap=True)


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
    from pipeline.stages.convert import convert_from_hf, convert_to_hf, load_tokens_tokenizer

    if from_hf is not None:
        if out is None:
            fail("--from-hf needs --out (the checkpoint directory to write)", 2)
        model_cfg = convert_from_hf(from_hf, out)
        console.print(f"wrote {out}/step_00000000; train from it with checkpoint.init_from={out} and this model section:")
        import yaml

        print(yaml.safe_dump({"model": model_cfg.to_dict()}, sort_keys=False))
        return
    cfg = _load(params, set_)
    with _Stage(_tracker(cfg, "convert", params, not no_mlflow)) as tracker:
        prov = convert_to_hf(
            checkpoint or cfg.checkpoint.dir, out or cfg.convert.output, load_tokens_tokenizer(cfg.tokenize.output),
            dtype=cfg.convert.dtype, max_shard_bytes=cfg.convert.max_shard_bytes,
            tokenizer_file=Path(cfg.tokenize.output) / "tokenizer.json",
        )
        if tracker:
            tracker.set_tags({"convert.checkpoint": prov["checkpoint"], "convert.step": prov["step"]})
            if cfg.convert.log_model:  # the converted Hugging Face model, loadable from the run's artifacts
                tracker.log_artifacts(out or cfg.convert.output, "hf_model")
    console.print(f"converted {prov['checkpoint']} -> {out or cfg.convert.output}")


@app.command()
@handle_errors
def evaluate(params: ParamsOpt = Path("params.yaml"), set_: SetOpt = None, no_mlflow: NoTrackOpt = False) -> None:
    """Validation loss/perplexity (ours and transformers'), eval tokens/s, a greedy sample."""
    from pipeline.stages.evaluate import run_evaluate

    cfg = _load(params, set_)
    with _Stage(_tracker(cfg, "evaluate", params, not no_mlflow)) as tracker:
        if tracker:
            _log_tokens(tracker, cfg.tokenize.output, "val", "evaluation")
        m = run_evaluate(cfg, tracker)
    subset = "" if m["val_windows"] == m["val_windows_total"] else f" over the first {m['val_windows']} of {m['val_windows_total']} windows"
    console.print(f"val loss{subset} {m['val_loss']:.4f} (transformers {m['hf_val_loss']:.4f}, rel diff {m['hf_rel_diff']:.1e}), "
                  f"perplexity {m['val_perplexity']:.2f}, {m['eval_tokens_per_s']:.0f} tokens/s")
    capped = f" (capped at {m['generate_tokens']} tokens by model.max_seq_len)" if m.get("generation_capped") else ""
    console.print(f"sample{capped}: {m['sample']!r}", highlight=False)


@app.command()
@handle_errors
def params(params: ParamsOpt = Path("params.yaml"), set_: SetOpt = None) -> None:
    """Validate params.yaml (+ overrides), check it as `moe train` would, print the flat values."""
    from pipeline.stages.train import check_train

    cfg = _load(params, set_)
    check_train(cfg, resolve_data=(Path(cfg.tokenize.output) / "manifest.json").is_file())
    for k, v in cfg.flatten().items():
        print(redact(f"{k} = {json.dumps(v)}"))


@app.command()
@handle_errors
def repro(
    force: Annotated[bool, typer.Option("--force", "-f", help="rerun every stage")] = False,
    args: Annotated[list[str] | None, typer.Argument(help="extra `dvc repro` arguments (after --)")] = None,
) -> None:
    """`dvc repro` with one MLflow parent run for this invocation."""
    key = uuid.uuid4().hex[:16]
    cmd = [sys.executable, "-m", "dvc", "repro", *(["--force"] if force else []), *(args or [])]
    console.print(f"pipeline key {key}: dvc {' '.join(cmd[3:])}")
    code = subprocess.call(cmd, env={**os.environ, "MOE_PIPELINE_KEY": key})
    if code != 0:
        fail(f"dvc repro failed with exit code {code}", code)
    from pipeline.params import load_params
    from pipeline.tracking import finalize_pipeline

    cfg = load_params(Path("params.yaml"))
    if cfg.mlflow.enabled:
        finalize_pipeline(cfg.mlflow, key)


@app.command()
def ui(
    port: Annotated[int, typer.Option(help="port")] = 5000,
    host: Annotated[str, typer.Option(help="bind address")] = "127.0.0.1",
) -> None:
    """Serve the MLflow UI for this repository's tracking store on 127.0.0.1."""
    from pipeline.params import MlflowConfig
    from pipeline.tracking import tracking_uri

    uri = tracking_uri(MlflowConfig())
    from pipeline.redact import redact

    console.print(f"MLflow UI for {redact(uri)} on http://{host}:{port}", highlight=False, soft_wrap=True)
    raise typer.Exit(_serve([sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri, "--host", host, "--port", str(port)]))


def _serve(cmd: list[str], env: dict[str, str] | None = None) -> int:
    """Run a server in its own process group; SIGTERM/SIGINT/SIGHUP end the whole group (MLflow's
    workers included), so nothing is left behind."""
    import signal

    proc = subprocess.Popen(cmd, start_new_session=True, env=env)

    def stop(signum, _frame):
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=wait)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, stop)
    code = proc.wait()
    with contextlib.suppress(ProcessLookupError):  # the server exited on its own: its workers go too
        os.killpg(proc.pid, signal.SIGTERM)
    return code


bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks (run on a GPU machine); JSON goes to bench/results/.")
app.add_typer(bench_app, name="bench")
from pipeline.paper.cli import paper_app  # noqa: E402

app.add_typer(paper_app, name="paper")


@bench_app.command("layer", add_help_option=False, context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def bench_layer(ctx: typer.Context) -> None:
    """MoE layer fwd+bwd TFLOP/s next to transformers and TorchTitan (see bench/layer.py --help)."""
    from bench.layer import main

    _run_bench(main, list(ctx.args))


@bench_app.command("model", add_help_option=False, context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def bench_model(ctx: typer.Context) -> None:
    """Full training steps of an OLMoE-width model: MFU, host syncs, peak memory (bench/model.py --help)."""
    from bench.model import main

    _run_bench(main, list(ctx.args))


@bench_app.command("experts", add_help_option=False, context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def bench_experts(ctx: typer.Context) -> None:
    """Layer throughput from 8 to 128 experts at fixed top-k and expert size (bench/layer.py --experts)."""
    from bench.layer import main

    args = list(ctx.args)
    if not any(a.startswith("--experts") for a in args):
        args += ["--experts", "8,16,32,64,128"]
    if not any(a.startswith("--shape") for a in args):
        args += ["--shape", "2048,1024,64,8"]
    _run_bench(main, args)


@bench_app.command("log")
@handle_errors
def bench_log(files: Annotated[list[Path], typer.Argument(help="bench/results/*.json files")]) -> None:
    """Record benchmark JSON results in MLflow (experiment "bench"), e.g. after a GPU run."""
    from pipeline.bench_tracking import log_result

    for f in files:
        if not f.is_file():
            fail(f"{f}: not found", 2)
        run_id, new = log_result(f)
        console.print(f"{f.name} -> MLflow run {run_id}" + ("" if new else " (already logged)"))


def _run_bench(main, args: list[str]) -> None:
    """Run a benchmark; log what it wrote to MLflow when MLflow is importable here."""
    from bench.common import RESULTS

    before = set(RESULTS.glob("*.json")) if RESULTS.is_dir() else set()
    code = main(args)
    new = sorted(set(RESULTS.glob("*.json")) - before) if RESULTS.is_dir() else []
    if new:
        try:
            from pipeline.bench_tracking import log_result
        except ImportError:
            new = []
        for f in new:
            console.print(f"{f.name} -> MLflow run {log_result(f)[0]}")
    raise typer.Exit(code)


def _progress():
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=True, disable=not console.is_terminal)


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    app()


if __name__ == "__main__":
    main()
