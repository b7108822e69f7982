"""One measurement: a short training run of one configuration through the executor seam.

The run is the library's own training step launched exactly as the train stage launches it
(local processes or a Slurm job, per ``executor.kind``), on random token ids (never zeros)
unless a corpus is given. The first ``steps`` steps are warm-up (one log interval); the
figures come from the second interval of ``steps`` steps, which the trainer times between two
device synchronisations.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np

from moe.config import ExperimentConfig
from moe.data import write_token_file
from moe.train.step_profile import PREFIX as PROFILE_PREFIX
from pipeline.errors import JobFailed, PipelineError
from pipeline.executors import world_size
from pipeline.params import PipelineConfig
from pipeline.stages.train import run_job
from pipeline.train_job import TrainJob
from pipeline.units import gib

MARKER = ".moe-paper-run"  # marks a run directory this module created (safe to replace)


def random_tokens(directory: Path, tokens: int, vocab: int, seed: int = 0) -> Path:
    """Random ids in [1, vocab) in the library's token format (cached by size)."""
    path = directory / f"random-{vocab}-{tokens}" / "part-00000.npy"
    if not path.with_suffix(".json").is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(seed)
        write_token_file(path, rng.integers(1, vocab, size=tokens), vocab_size=vocab, eos_id=0)
    return path.parent


def fresh_run_dir(path: Path) -> Path:
    """An empty run directory; replaces only one this module made before: its marker alone is
    not proof, so everything in it must also read as a training run's own files (the run
    directory check), else nothing is removed."""
    from pipeline.outputs import write_atomic
    from pipeline.run_dirs import check_run_dirs

    if path.is_symlink():
        raise PipelineError(f"{path}: is a symlink; the paper pipeline's run directories are plain folders (remove it)")
    if path.exists():
        if not (path / MARKER).is_file():
            raise PipelineError(f"{path}: exists and was not made by the paper pipeline; move it away")
        check_run_dirs(path, path / "checkpoints", also=(MARKER,))
        shutil.rmtree(path)
    path.mkdir(parents=True)
    write_atomic(path / MARKER, "made by pipeline.paper.measure\n")
    return path


def _experiment(sections: dict[str, Any], data_dir: Path, run_dir: Path, steps: int, total_steps: int, profile: bool) -> ExperimentConfig:
    """The measured run's config: the stage's sections on the given tokens, logging every
    ``steps`` steps, no checkpoints, (``profile``) the last step under the profiler."""
    train = sections["train"]
    cfg = {
        **sections,
        "data": {"verify_checksums": False, **sections["data"], "paths": [str(data_dir)]},
        "train": {"log_every": steps, "max_steps": total_steps, **({"profile_step": total_steps} if profile else {}), **train},
        "schedule": {"warmup_steps": 1, **sections.get("schedule", {})},
        "checkpoint": {"dir": str(run_dir / "checkpoints"), "every": 0, "keep_last": 1, "save": False},
    }
    return ExperimentConfig.from_dict(cfg).validate()


def measure(
    base: PipelineConfig,
    name: str,
    sections: dict[str, Any],
    work_dir: Path,
    steps: int,
    data_dir: Path | None = None,
    tracker=None,
    profile: bool = False,
) -> dict[str, Any]:
    """Run ``sections`` (model/train/parallel/precision/... overrides) and return its figures;
    ``profile``: one more step under torch.profiler (moe.train.step_profile), after the timed
    ones and outside their throughput, for where the time goes."""
    world = world_size(base)
    run_dir = fresh_run_dir(work_dir / name)
    model = sections["model"]
    seq = sections["data"]["seq_len"]
    train = sections["train"]
    total_steps = 2 * steps + int(profile) if "max_steps" not in train else train["max_steps"]
    if data_dir is None:
        per_step = train["global_batch_size"] * (seq + 1)
        data_dir = random_tokens(work_dir / "data", per_step * (total_steps + 2), model["vocab_size"])
    exp = _experiment(sections, data_dir, run_dir, steps, total_steps, profile)
    layout = exp.resolve(world)
    job = TrainJob.of(exp, layout, run_dir)  # as the train stage builds, runs and reads its job
    run_job(base, job, markers=(MARKER,), label=f"{name}: ")
    rows = job.metric_rows()  # (a fresh run directory: one row per step)
    timed = [r for r in rows if "tokens_per_s_per_device" in r]
    if not timed:
        raise JobFailed(f"{name}: the job logged no throughput ({job.metrics_path})", 5)
    last = timed[-1]
    peak, at_rest = gib(last, "peak_mem_gib"), gib(last, "mem_at_rest_gib")
    profiled = next((r for r in rows if PROFILE_PREFIX + "total_ms" in r), None)
    micro, world_batch = exp.train.micro_batch_size, exp.train.global_batch_size
    out = {
        "name": name,
        "world": world,
        "layout": {
            "pp": layout.pp,
            "dp": layout.dp,
            "ep": layout.ep,
            "data_parallel": layout.data_parallel,
            "shard_optimizer": exp.parallel.shard_optimizer,
        },
        "model": exp.model.to_dict(),
        "seq_len": seq,
        "micro_batch_size": micro,
        "global_batch_size": world_batch,
        "accumulation": layout.grad_accum,
        "tokens_per_step_per_device": world_batch * seq / world,
        "routing": exp.model.moe.routing,
        "dropless": exp.parallel.ep_capacity_factor is None,
        # measured: routed slots no expert computed (moe.train.telemetry)
        "tokens_dropped_fraction": last.get("tokens_dropped_fraction"),
        "expert_grad_accum": exp.optim.expert_grad_accum,
        "precision": exp.precision.recipe,
        "steps_timed": steps if len(timed) > 1 else total_steps,
        "step_time_s": last["step_time_s"],
        "tokens_per_s_per_device": last["tokens_per_s_per_device"],
        "tflops_per_device": last["tflops_per_device"],
        "mfu": last.get("mfu"),
        # GiB (bytes / 2**30)
        "peak_mem_gib": peak,
        "mem_at_rest_gib": at_rest,
        # Peak minus the memory held between steps: activations, gradients and transients (not
        # activations alone; bench/memory.py measures those directly).
        "above_rest_gib": (peak - at_rest) if peak is not None and at_rest is not None else None,
        "peak_rss_gib": gib(last, "peak_rss_gib"),
        "final_loss": last["loss"],
        # ms of the profiled step per category (kernel time on GPUs, own CPU time on CPUs)
        "profile": {k.removeprefix(PROFILE_PREFIX).removesuffix("_ms"): v for k, v in profiled.items() if k.startswith(PROFILE_PREFIX)}
        if profiled
        else None,
        "rows": rows,
    }
    if tracker is not None:
        tracker.log_metrics({f"{name}/{k}": v for k, v in out.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
    return out
