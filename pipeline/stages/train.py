"""Train stage: params -> a training job on the chosen executor -> checkpoints and metrics.

``data.paths: []`` means the tokenise stage's ``train/`` split and ``data.tokenizer_hash:
null`` the tokenizer it recorded, so the data a run reads is always checked against the
tokenizer it was made with.
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from moe.config import ConfigError, ExperimentConfig, ResolvedLayout
from pipeline import expert_load
from pipeline.dvc_views import TRAIN_HEADLINE, write_headline, write_resolved_params
from pipeline.errors import JobFailed, PipelineError
from pipeline.executors import build_executor, world_size
from pipeline.executors.base import JobResult
from pipeline.executors.slurm import require_slurm
from pipeline.outputs import csv_header, json_keys_within, write_output_file
from pipeline.params import PipelineConfig
from pipeline.plots import TRAIN_DIR, eval_curve, train_figures
from pipeline.redact import has_password, redact
from pipeline.run_dirs import check_run_dirs
from pipeline.run_lock import RunLock, command_line
from pipeline.stage_spec import Output, Stage
from pipeline.stages.tokenize import read_manifest
from pipeline.tracking.job import SECRET_URI_ENV
from pipeline.train_job import TrainJob
from pipeline.verbosity import muted

METRICS_FILE = Path("metrics/train.json")
LOSS_PLOT = Path("plots/train_loss.csv")
THROUGHPUT_PLOT = Path("plots/train_throughput.csv")
EXPERT_LOAD_PLOT = Path("plots/expert_load.csv")


def resolve_experiment(cfg: PipelineConfig) -> ExperimentConfig:
    """The library config with the data defaults filled in from the tokenise output."""
    exp = cfg.experiment()
    data = exp.data
    manifest = read_manifest(cfg.tokenize.output)
    tok = manifest["tokenizer"]
    if not data.paths:
        data = data.replace(paths=[str(Path(cfg.tokenize.output) / "train")])
    if data.tokenizer_hash is None:
        data = data.replace(tokenizer_hash=tok["sha256"])
    if tok["vocab_size"] > exp.model.vocab_size:
        raise ConfigError(
            f"model.vocab_size: {exp.model.vocab_size} is smaller than the tokenizer's vocabulary "
            f"({tok['vocab_size']}, {cfg.tokenize.output}/manifest.json)"
        )
    return exp.replace(data=data).validate()


class Checked(NamedTuple):
    """A config check_train accepted, its layout on the job's world, and its in-loop tasks
    tokenised (a requests file's content, written at launch: None, no tasks or no data resolved)."""

    exp: ExperimentConfig
    layout: ResolvedLayout
    in_loop: bytes | None = None


def check_train(cfg: PipelineConfig, resolve_data: bool = True) -> Checked:
    """Everything `moe train` checks before any work (`moe params` runs it too): the layout
    against the process count (resolved here, once per run: the job carries it), directories,
    the device, the tokenizer against the model."""
    exp = resolve_experiment(cfg) if resolve_data else cfg.experiment()
    layout = exp.resolve(world_size(cfg))
    for key, value in (("executor.run_dir", cfg.executor.run_dir), ("checkpoint.dir", cfg.checkpoint.dir)):
        for p in (Path(value), *Path(value).parents):
            if p.exists() and not p.is_dir():
                raise ConfigError(f"{key}: {value} is not a directory ({p} is a file)")
    check_run_dirs(cfg.executor.run_dir, cfg.checkpoint.dir)  # read only: before the lock creates anything
    in_loop = None
    if exp.train.eval_every and exp.train.eval_tasks and resolve_data:
        from pipeline.eval.inloop import tokenise_in_loop

        in_loop = tokenise_in_loop(exp, cfg.tokenize.output, cfg.evaluate.data_dir)  # every task check, before any work; kept for the launch
    if cfg.executor.kind == "local":
        import torch

        if cfg.train.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("train.device: cuda, but no CUDA GPU is available here (use auto or cpu)")
        check_precision_here(exp)
    return Checked(exp, layout, in_loop)


def check_precision_here(exp: ExperimentConfig) -> None:
    """The precision recipe against this machine's device, as the trainer will check it (an
    FP8 recipe on a CPU or an older GPU is refused by `moe params` and `moe train` at once)."""
    import torch

    from moe.precision import recipe_for

    gpu = exp.train.device != "cpu" and torch.cuda.is_available()
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")  # the trainer's choice, without selecting a GPU here
    recipe_for(exp.precision, device)


def check_local_memory(cfg: PipelineConfig, exp: ExperimentConfig) -> None:
    """A local CPU run whose weights and optimizer state alone exceed this machine's memory is
    refused before anything is allocated (`moe params` shows any config; this is `moe train`'s)."""
    import torch

    if cfg.executor.kind == "local" and (cfg.train.device == "cpu" or not torch.cuda.is_available()):
        from moe.plan.host import check_host_memory

        check_host_memory(exp, world_size(cfg))


def make_job(cfg: PipelineConfig, tracker=None, resolve_data: bool = True, checked: Checked | None = None) -> TrainJob:
    """The job spec; ``checked``: the experiment and layout `preflight` already checked (not
    checked twice)."""
    exp, layout, _ = checked if checked is not None else check_train(cfg, resolve_data)
    uri = tracker.uri if tracker else None
    if uri and has_password(uri):  # job.json (a DVC output) keeps no password; jobs inherit it
        os.environ[SECRET_URI_ENV] = uri
    return TrainJob.of(
        exp,
        layout,
        Path(cfg.executor.run_dir),
        mlflow_uri=redact(uri) if uri else None,
        mlflow_run_id=tracker.run_id if tracker else None,
        mlflow_flush_every=cfg.mlflow.flush_every,
        max_requeues=cfg.slurm.max_requeues,
        eval_inputs=_eval_inputs(cfg, exp),
    )


def _eval_inputs(cfg: PipelineConfig, exp: ExperimentConfig) -> dict[str, Any] | None:
    if not exp.train.eval_every:
        return None
    from pipeline.eval.inloop import REQUESTS_FILE, eval_inputs

    return eval_inputs(Path(cfg.executor.run_dir) / REQUESTS_FILE if exp.train.eval_tasks else None, cfg.tokenize.output)


def prepare_run(job: TrainJob, act: bool = True, markers: tuple[str, ...] = ()) -> str:
    """Under the run's lock: its directories hold only what runs write, and the checkpoints
    there are resumed, extended or refused (pipeline.resume); never deleted unless stored.
    ``act=False`` checks and decides only (a Slurm job changes the directory once sbatch has
    accepted it). ``markers``: files the caller's own runs add to the run directory (the paper
    pipeline's)."""
    from pipeline.resume import prepare_checkpoints  # (torch's checkpoint reader: not before a config is valid)

    check_run_dirs(job.run_dir, job.checkpoint_dir, also=markers)
    start = prepare_checkpoints(job.config, act)  # DVC keeps the run dir (persist); resume only the same config
    if act and start in ("fresh", "restart") and job.metrics_path.is_file() and not job.metrics_path.is_symlink():
        job.metrics_path.unlink()  # our own history of a run whose checkpoints are gone; a resumed job keeps it
    return start


def prepare_slurm_run(job: TrainJob, markers: tuple[str, ...] = ()) -> tuple[str, Callable[[], None] | None]:
    """(how the job starts, what to change once sbatch accepted it): nothing is removed here."""
    start = prepare_run(job, act=False, markers=markers)
    if start not in ("fresh", "restart"):
        return start, None

    def before_start() -> None:
        with RunLock(job.run_dir, job.checkpoint_dir).acquire(f"{command_line()} (the queued Slurm job's run directory)"):
            prepare_run(job, markers=markers)

    return start, before_start


def preflight(cfg: PipelineConfig) -> Checked:
    """What `moe train` checks before it opens an MLflow run or touches the run directory:
    Slurm present for the Slurm executor, the config against the data and the world."""
    if cfg.executor.kind == "slurm":
        require_slurm("sbatch", "srun", "scontrol", "scancel")
    with muted("pipeline.eval", when=cfg.executor.kind == "local"):  # the local worker warns again, on this console
        return check_train(cfg)


@dataclass
class Launch:
    """A started training job: how it started (fresh, resume, extend, restart), and either its
    result (it ran to its end) or its Slurm job id (queued, not waited for)."""

    job: TrainJob
    start: str
    result: JobResult | None = None
    job_id: str | None = None


def launch_train(
    cfg: PipelineConfig, job: TrainJob, tracker=None, *, wait: bool = True, markers: tuple[str, ...] = (), in_loop: bytes | None = None
) -> Launch:
    """The one way a training job starts (`moe train`, `moe submit`, the paper stages): under the
    run's lock its directory is prepared (checkpoints resumed, extended or refused; on Slurm
    changed only once sbatch accepted the job, whose rank 0 then takes the lock), the tracker is
    tagged, and the configured executor runs the job to its end, or with ``wait=False`` (Slurm)
    until sbatch accepted it. ``markers``: files the caller's own runs add to the run directory.
    ``in_loop``: the in-loop tasks check_train tokenised, written where the job's ranks read them."""
    slurm = cfg.executor.kind == "slurm"
    if slurm:
        require_slurm("sbatch", "srun", "scontrol", "scancel")
    else:
        check_local_memory(cfg, ExperimentConfig.from_dict(job.config))
    if not (wait or slurm):
        raise ValueError("launch_train: only a Slurm job can be left running (wait=False)")
    holder = "local executor" if not slurm else "preparing the Slurm job"
    lock = RunLock(job.run_dir, job.checkpoint_dir).acquire(f"{command_line()} ({holder})")
    try:
        start, before_start = prepare_slurm_run(job, markers) if slurm else (prepare_run(job, markers=markers), None)
        place_in_loop_requests(cfg, job, in_loop)
        if tracker:
            tracker.set_tags({"train.start": start, **(container_tags(cfg) if slurm else {})})
        executor = build_executor(cfg)
        if not slurm:
            return Launch(job, start, result=executor.run(job))
        lock.release()  # the job's rank 0 takes it on the cluster
        if not wait:
            return Launch(job, start, job_id=submitted(executor.submit(job, before_start), job, tracker))
        return Launch(job, start, result=executor.run(job, before_start))
    except BaseException:
        if tracker and not wait:
            tracker.abandon()  # the job never ran: no FAILED run, the pipeline's parent as it was
        raise
    finally:
        lock.release()


def submitted(job_id: str, job: TrainJob, tracker) -> str:
    """A job sbatch accepted, on its run: tagged with its id; when nobody waits for it (the job
    ends its run itself: ``mlflow_finalize``), this process stops recording system metrics."""
    if tracker:
        tracker.set_tags({"slurm.job_id": job_id})
        if job.mlflow_finalize:
            tracker.stop_system_metrics()
    return job_id


def place_in_loop_requests(cfg: PipelineConfig, job: TrainJob, in_loop: bytes | None) -> None:
    """Under the run's lock: the job's record, then its tokenised in-loop tasks where its
    eval_inputs name them (tokenised here only for a caller that did not check the job first)."""
    path = (job.eval_inputs or {}).get("requests")
    if not path:
        return
    from pipeline.eval.inloop import tokenise_in_loop, write_in_loop_requests

    if in_loop is None:
        in_loop = tokenise_in_loop(ExperimentConfig.from_dict(job.config), cfg.tokenize.output, cfg.evaluate.data_dir)
    job.write()  # first: a run directory holds nothing else without its record
    write_in_loop_requests(path, in_loop)


def run_train(cfg: PipelineConfig, tracker=None, checked: Checked | None = None) -> dict[str, Any]:
    """`moe train` and the DVC stage: launch the job, wait for it, read its outputs."""
    checked = checked or check_train(cfg)
    job = make_job(cfg, tracker, checked=checked)
    run_job(cfg, job, tracker, in_loop=checked.in_loop)
    return finish_train(cfg, job, tracker)


def run_job(
    cfg: PipelineConfig, job: TrainJob, tracker=None, *, markers: tuple[str, ...] = (), in_loop: bytes | None = None, label: str = ""
) -> JobResult:
    """launch_train, waiting for the job's end (`moe train`, the paper's measured runs): a failed
    job is one JobFailed naming its log, after ``label`` (the paper names its variant)."""
    result = launch_train(cfg, job, tracker, markers=markers, in_loop=in_loop).result
    if not result.ok:
        raise JobFailed(f"{label}training job failed ({result.message}); log: {result.log_path}", result.exit_code)
    return result


def container_tags(cfg: PipelineConfig) -> dict[str, str]:
    c = cfg.container
    tags = {"executor": cfg.executor.kind, "container.runtime": c.runtime}
    if c.image:
        tags["container.image"] = c.image
    if c.image_digest:
        tags["container.image_digest"] = c.image_digest
    return tags


def finish_train(cfg: PipelineConfig, job: TrainJob, tracker=None) -> dict[str, Any]:
    """Read a finished job's summary and metrics; write the DVC metrics and plots."""
    from pipeline.worker import read_summary

    if not job.summary_path.is_file():
        raise PipelineError(f"training job ended without a summary ({job.summary_path}); logs: {Path(job.run_dir) / 'logs'}")
    summary = read_summary(job.summary_path)
    if summary.get("already_finished"):
        print(f"run already finished: its checkpoint is at step {summary['steps']} (train.max_steps); nothing trained", flush=True)
    rows = job.metric_rows()
    metrics = final_metrics(summary, rows)
    write_outputs(metrics, rows)
    write_headline(METRICS_FILE, metrics, TRAIN_HEADLINE)  # what `dvc metrics show` prints
    write_resolved_params(cfg.flatten())  # the values it ran with, for `dvc exp show` (pipeline/dvc_views.py)
    table = expert_load.load_table(rows)
    expert_load.write_csv(EXPERT_LOAD_PLOT, table)
    heatmap = Path(job.run_dir) / "expert_load.png"
    expert_load.write_png(heatmap, table)
    train_figures(rows)  # PNGs: `dvc plots show` renders them offline
    eval_curve(rows)  # the in-loop evaluation, when train.eval_every ran it
    expert_load.write_png(TRAIN_DIR / "expert_load_by_expert.png", table)
    if tracker:
        tracker.log_metrics({f"final/{k}": v for k, v in metrics.items() if isinstance(v, (int, float))})
        tracker.log_artifact(job.metrics_path)
        tracker.log_artifact(heatmap)
        tracker.set_tags(
            {
                "moe.load_alarm": "fired" if metrics["load_alarm"] else "quiet",
                "moe.router_health": "collapse" if metrics["router_collapse"] else "healthy",
            }
        )
    return metrics


def final_metrics(summary: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    full = [r for r in rows if "tokens_per_s" in r]
    # Throughput: mean over log intervals after the first (which holds warm-up/compilation).
    steady = full[1:] or full
    mean = lambda key: sum(r[key] for r in steady if key in r) / max(1, sum(1 for r in steady if key in r))  # noqa: E731
    last = full[-1] if full else {}
    out: dict[str, Any] = {
        "steps": summary["steps"],
        "final_loss": summary["final_loss"],
        "params_total": summary["params_total"],
        "params_active": summary["params_active"],
        "tokens_per_step": summary["tokens_per_step"],
        "tokens_per_s": mean("tokens_per_s"),
        "tokens_per_s_per_device": mean("tokens_per_s_per_device"),
        "tflops_per_device": mean("tflops_per_device"),
        "lb_loss": last.get("lb_loss"),
        "z_loss": last.get("z_loss"),
        "expert_load_max_over_mean": last.get("expert_load_max_over_mean"),
        "expert_load_min_over_mean": last.get("expert_load_min_over_mean"),
        "expert_load_cv": last.get("expert_load_cv"),
        "expert_load_entropy": last.get("expert_load_entropy"),
        **_numbers_only(load_alarm_metrics(rows)),
        **_numbers_only(router_collapse_metrics(rows)),
        "skipped_steps": last.get("skipped_steps", 0),
    }
    evaluated = [r for r in rows if any(k.startswith("eval/") for k in r)]
    if evaluated:  # the last in-loop evaluation (train.eval_every); per task: plots/eval_curve.csv
        e = evaluated[-1]
        out["eval"] = {"step": e["step"], **({"val_loss": e["eval/val_loss"]} if "eval/val_loss" in e else {})}
    if any("mfu" in r for r in steady):
        out["mfu"] = mean("mfu")
    return out


def _numbers_only(metrics: dict[str, Any]) -> dict[str, Any]:
    """A DVC metrics table shows numbers: a "never" step (None) is left out, not printed as null."""
    return {k: v for k, v in metrics.items() if v is not None}


def load_alarm_metrics(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """``load_alarm``: how many layers the token-gerrymandering alarm fired for at any log
    point; ``load_alarm_first_step``: the first such step (null: it never fired)."""
    layers, first = set(), None
    for r in rows:
        hit = [k for k, v in r.items() if k.startswith("load_alarm/layer_") and v]
        layers.update(hit)
        if hit and first is None:
            first = r["step"]
    return {"load_alarm": len(layers), "load_alarm_first_step": first}


def router_collapse_metrics(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """``router_collapse``: 1 if the router collapsed at any log point (train.router_health);
    ``router_collapse_first_step``: the first such step (null: never)."""
    first = next((r["step"] for r in rows if r.get("router_collapse")), None)
    return {"router_collapse": int(first is not None), "router_collapse_first_step": first}


TRAIN_METRIC_KEYS = {
    "steps",
    "final_loss",
    "params_total",
    "params_active",
    "tokens_per_step",
    "tokens_per_s",
    "tokens_per_s_per_device",
    "tflops_per_device",
    "lb_loss",
    "z_loss",
    "expert_load_max_over_mean",
    "expert_load_min_over_mean",
    "expert_load_cv",
    "expert_load_entropy",
    "load_alarm",
    "load_alarm_first_step",
    "skipped_steps",
    "mfu",
    "router_collapse",
    "router_collapse_first_step",
    "eval",
}
LOSS_COLUMNS = ["step", "loss"]
THROUGHPUT_COLUMNS = ["step", "tokens_per_s_per_device", "tflops_per_device"]


def csv_text(header: list[str], rows: list[list[Any]]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(header)
    w.writerows(rows)
    return buf.getvalue()


def write_outputs(metrics: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    write_output_file(METRICS_FILE, json.dumps(metrics, indent=2) + "\n", "metrics/train.json", json_keys_within(TRAIN_METRIC_KEYS, "final_loss"))
    loss = [[r["step"], r["loss"]] for r in rows if isinstance(r.get("loss"), (int, float))]
    write_output_file(LOSS_PLOT, csv_text(LOSS_COLUMNS, loss), str(LOSS_PLOT), csv_header(LOSS_COLUMNS))
    speed = [[r["step"], r["tokens_per_s_per_device"], r["tflops_per_device"]] for r in rows if "tokens_per_s_per_device" in r]
    write_output_file(THROUGHPUT_PLOT, csv_text(THROUGHPUT_COLUMNS, speed), str(THROUGHPUT_PLOT), csv_header(THROUGHPUT_COLUMNS))


# What dvc.yaml runs, reads and writes for this stage, and the code it runs (pipeline/stage_spec.py).
STAGE = Stage(
    name="train",
    params=("recipe", "model", "optim", "schedule", "data", "train", "checkpoint", "parallel", "precision", "executor"),
    deps=("data/tokens",),
    outputs=(
        Output("runs/train", "job.json"),  # its job spec (pipeline/run_dirs.py: is_job_spec)
        Output("plots/train_loss.csv"),
        Output("plots/train_throughput.csv"),
        Output("plots/expert_load.csv"),
        Output("plots/eval_curve.csv"),
        Output("metrics/train.json"),
        Output("metrics/resolved.yaml"),
        Output("metrics/headline/train.json"),
        Output("plots/train"),
    ),
    code=(
        "moe",
        "pipeline/stages/train.py",
        "pipeline/executors",
        "pipeline/eval",
        "pipeline/tracking",
        "pipeline/__init__.py",
        "pipeline/console.py",
        "pipeline/containers.py",
        "pipeline/dvc_views.py",
        "pipeline/expert_load.py",
        "pipeline/plots.py",
        "pipeline/progress.py",
        "pipeline/project.py",
        "pipeline/redact.py",
        "pipeline/requeue.py",
        "pipeline/resume.py",
        "pipeline/run_dirs.py",
        "pipeline/run_lock.py",
        "pipeline/slurm_task.py",
        "pipeline/stages/tokenize.py",
        "pipeline/verbosity.py",
        "pipeline/worker.py",
        "pipeline/train_job.py",
        "pipeline/corpus.py",
        "pipeline/errors.py",
        "pipeline/hub.py",
        "pipeline/outputs.py",
        "pipeline/params.py",
        "pipeline/repository.py",
        "pipeline/tokenizer.py",
    ),
)
