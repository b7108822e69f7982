"""The MLflow commands of `moe`: a tracking server for many jobs, the local UI, and the upload
of what stages and jobs spooled while the server was unreachable."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Annotated

import typer

from pipeline.console import ParamsOpt, console, fail, handle_errors
from pipeline.errors import PipelineError


def register(app: typer.Typer) -> None:
    app.command("mlflow-server")(handle_errors(mlflow_server))
    app.command("mlflow-sync")(handle_errors(mlflow_sync))
    app.command("ui")(ui)


def mlflow_server(
    backend: Annotated[
        str, typer.Option(help="backend store URI (user, no password: see --password-file)", envvar="MOE_MLFLOW_BACKEND")
    ] = "postgresql+psycopg2://mlflow@127.0.0.1:5432/mlflow",
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
    given = backend
    if password is not None:
        try:
            backend = with_password(backend, password)
        except ValueError as exc:
            fail(f"--backend: {exc}", 2)
    check_backend(backend, shown=given, secret=password)
    artifacts.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--artifacts-destination",
        str(artifacts.resolve()),
        "--serve-artifacts",
        "--host",
        host,
        "--port",
        str(port),
        "--workers",
        str(workers),
    ]
    console.print(f"MLflow server on http://{host}:{port} (store {redact(backend)})", highlight=False, soft_wrap=True)
    raise typer.Exit(_serve(cmd, env={**os.environ, "MLFLOW_BACKEND_STORE_URI": backend}))


def check_backend(uri: str, timeout_s: int = 10, shown: str | None = None, secret: str | None = None) -> None:
    """One connection to the backend store, bounded in time, before the server starts: the
    server itself retries a database that is down for ever (issue 36). The error names the URI
    as the user gave it (``shown``, before the password was added) and never the password."""
    from pipeline.redact import MASK, redact

    try:
        import sqlalchemy

        connect_args = {"connect_timeout": timeout_s} if uri.startswith("postgresql") or uri.startswith("mysql") else {}
        engine = sqlalchemy.create_engine(uri, connect_args=connect_args)
        try:
            with engine.connect():
                pass
        finally:
            engine.dispose()
    except Exception as exc:  # refused, unknown host, bad credentials, bad URI, missing driver
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if secret:
            detail = detail.replace(secret, MASK)
        fail(f"--backend: cannot connect to the backend store {redact(shown or uri)}: {redact(detail)}", 2)


def mlflow_sync(
    run_dir: Annotated[Path, typer.Argument(help="a run directory holding mlflow-fallback.jsonl")] = Path("runs/train"),
    params: ParamsOpt = Path("params.yaml"),
) -> None:
    """Upload what a job or stage could not send (the tracking server was unreachable)."""
    from pipeline.params import MlflowConfig, load_params
    from pipeline.project import project_root
    from pipeline.redact import redact
    from pipeline.tracking.client import tracking_uri
    from pipeline.tracking.spool import STAGE_FALLBACK, sync_fallback

    if not run_dir.is_dir() and run_dir != Path("runs/train"):  # the default may not exist yet (a stage's spool alone)
        fail(f"{run_dir}: not a directory (the run directory holding mlflow-fallback.jsonl)", 2)
    # the project that owns the spool, wherever this runs from: its params, store and stage spool
    here = run_dir.resolve() if run_dir.is_dir() else Path.cwd().resolve()
    owner = next((d for d in (here, *here.parents) if (d / ".dvc").is_dir() or (d / "params.yaml").is_file()), None)
    root = project_root(owner) if owner else project_root()
    if not params.is_file() and params == Path("params.yaml") and (root / "params.yaml").is_file():
        params = root / "params.yaml"
    cfg = load_params(params, []) if params.is_file() else None
    uri = tracking_uri(cfg.mlflow if cfg else MlflowConfig(), root)
    spools = list(dict.fromkeys(p.resolve() for p in (root / STAGE_FALLBACK, run_dir / "mlflow-fallback.jsonl")))
    if not any(p.is_file() for p in spools):
        console.print(f"nothing to sync: no mlflow-fallback.jsonl in {run_dir} or {root}", highlight=False, soft_wrap=True)
        return
    try:
        n = sync_fallback(spools, uri)
    except PipelineError:
        raise
    except Exception as exc:  # unreachable or unsupported store: keep the spool, say so in one line
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise PipelineError(
            f"cannot upload to {redact(uri)} ({redact(first[:300])}); the spool files are kept: sync again later "
            "(values already sent are not sent twice)"
        ) from None
    console.print(f"uploaded {n} metric values to {redact(uri)}", highlight=False, soft_wrap=True)


def ui(
    port: Annotated[int, typer.Option(help="port")] = 5000,
    host: Annotated[str, typer.Option(help="bind address")] = "127.0.0.1",
) -> None:
    """Serve the MLflow UI for this repository's tracking store on 127.0.0.1."""
    from pipeline.params import MlflowConfig
    from pipeline.tracking.client import tracking_uri

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
