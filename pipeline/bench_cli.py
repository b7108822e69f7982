"""`moe bench ...`: the benchmarks of the repository's bench/ folder, loaded by name (bench/ and
pipeline/ stand beside each other), and `moe bench log`, which records their JSON in MLflow."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipeline.console import console, fail, handle_errors
from pipeline.errors import PipelineError
from pipeline.redact import redact

bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks (run on a GPU machine); JSON goes to bench/results/.")


def _bench_dir() -> Path:
    """The repository's bench/ folder (bench/ and pipeline/ stand beside each other: neither
    imports the other, so `moe bench` runs a benchmark as its own process)."""
    bench = Path.cwd() / "bench"
    if not (bench / "__init__.py").is_file() or not (bench / "common.py").is_file():
        fail("the benchmarks live in the repository's bench/ folder: run `moe bench` from the repository root", 2)
    return bench


@bench_app.command("layer", add_help_option=False, context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def bench_layer(ctx: typer.Context) -> None:
    """MoE layer fwd+bwd TFLOP/s next to transformers and TorchTitan (see bench/layer.py --help)."""
    _run_bench("layer", list(ctx.args))


@bench_app.command("model", add_help_option=False, context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def bench_model(ctx: typer.Context) -> None:
    """Full training steps of an OLMoE-width model: MFU, host syncs, peak memory (bench/model.py --help)."""
    _run_bench("model", list(ctx.args))


@bench_app.command("experts", add_help_option=False, context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def bench_experts(ctx: typer.Context) -> None:
    """Layer throughput from 8 to 128 experts at fixed top-k and expert size (bench/layer.py --experts)."""
    args = list(ctx.args)
    if not any(a.startswith("--experts") for a in args):
        args += ["--experts", "8,16,32,64,128"]
    if not any(a.startswith("--shape") for a in args):
        args += ["--shape", "2048,1024,64,8"]
    _run_bench("layer", args)


@bench_app.command("log")
@handle_errors
def bench_log(files: Annotated[list[Path], typer.Argument(help="bench/results/*.json files")]) -> None:
    """Record benchmark JSON results in MLflow (experiment "bench"), e.g. after a GPU run."""
    from pipeline.bench_tracking import load_result, log_result

    for f in files:
        if not f.is_file():
            fail(f"{f}: not found", 2)
        load_result(f)  # every file checked before the first is logged
    for f in files:
        console.print(_logged(f.name, *log_result(f)), highlight=False, soft_wrap=True)


def _logged(name: str, run_id: str, new: bool) -> str:
    from pipeline.tracking.spool import OFFLINE_PREFIX, STAGE_FALLBACK

    if run_id.startswith(OFFLINE_PREFIX):
        return f"{name} -> spooled to {STAGE_FALLBACK} (MLflow unreachable): `moe mlflow-sync` sends it"
    return f"{name} -> MLflow run {run_id}" + ("" if new else " (already logged)")


def _run_bench(name: str, args: list[str]) -> None:
    """Run ``python -m bench.<name> ARGS`` from the repository root; log the JSON it wrote to
    MLflow when MLflow is importable here."""
    import subprocess
    import sys

    bench = _bench_dir()
    results = bench / "results"  # bench/common.py's RESULTS
    before = set(results.glob("*.json")) if results.is_dir() else set()
    code = subprocess.call([sys.executable, "-m", f"bench.{name}", *args], cwd=bench.parent)
    new = sorted(set(results.glob("*.json")) - before) if results.is_dir() else []
    if new:
        try:
            from pipeline.bench_tracking import log_result
        except ImportError:
            new = []
        for f in new:
            try:
                console.print(_logged(f.name, *log_result(f)), highlight=False, soft_wrap=True)
            except PipelineError as exc:  # the benchmark's own exit code stands; the file stays for `moe bench log`
                console.print(f"warning: not logged to MLflow: {redact(str(exc))}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)
