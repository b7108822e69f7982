"""Fixtures of the pipeline suites: a trained workspace (shared, and private copies of it), a
password-protected MLflow server."""

import os
from pathlib import Path

import pytest
import yaml

from tests.workspace import REPO, TINY_PARAMS, load, write_corpus


@pytest.fixture(scope="session")
def trained_dir(tmp_path_factory):
    """A workspace where tokenize and train (8 steps, MLflow on) have run once."""
    from pipeline.stages.tokenize import run_tokenize
    from pipeline.stages.train import run_train
    from pipeline.tracking.stage_run import Tracker

    root = tmp_path_factory.mktemp("trained")
    old = os.getcwd()
    os.chdir(root)
    saved = {k: os.environ.pop(k, None) for k in ("MLFLOW_TRACKING_URI", "MOE_PIPELINE_KEY")}
    os.environ["PYTHONPATH"] = str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")
    try:
        write_corpus(root / "corpus")
        (root / "params.yaml").write_text(yaml.safe_dump(TINY_PARAMS, sort_keys=False))
        cfg = load()
        run_tokenize(cfg.tokenize)
        tracker = Tracker(cfg.mlflow, "train", Path("params.yaml"))
        tracker.log_stage_start(cfg.flatten())
        run_train(cfg, tracker)
        tracker.end(ok=True)
    finally:
        os.chdir(old)
        for k, v in saved.items():
            if v is not None:
                os.environ[k] = v
    return root


@pytest.fixture
def in_trained(trained_dir, monkeypatch):
    monkeypatch.chdir(trained_dir)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return trained_dir


@pytest.fixture
def ws(trained_dir, tmp_path, monkeypatch):
    """A private copy of the shared trained workspace (tokens, checkpoints), as cwd."""
    from tests.pipeline.hostile import make_workspace

    return make_workspace(trained_dir, tmp_path, monkeypatch)


class BasicAuthProxy:
    """A password-protected tracking server: a reverse proxy that demands HTTP basic auth in
    front of a real `mlflow server` (what a site's nginx does), answering 401 without it."""

    def __init__(self, backend_port: int, user: str, password: str) -> None:
        import base64
        import http.client
        import http.server
        import threading

        expected = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _relay(self):
                if self.headers.get("Authorization") != expected:
                    self.send_response(401)
                    self.send_header("WWW-Authenticate", 'Basic realm="mlflow"')
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                conn = http.client.HTTPConnection("127.0.0.1", backend_port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "authorization")}
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "content-length", "connection"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PATCH = do_DELETE = do_PUT = _relay

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


@pytest.fixture(scope="module")
def password_mlflow(tmp_path_factory):
    """(full URI with the password, backend URI without): a real MLflow server behind basic auth."""
    import socket
    import subprocess
    import sys
    import time

    from mlflow.tracking import MlflowClient

    root = tmp_path_factory.mktemp("mlflow-auth")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--backend-store-uri",
            f"sqlite:///{root}/db.sqlite",
            "--default-artifact-root",
            str(root / "artifacts"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    backend = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            MlflowClient(backend).search_experiments()
            break
        except Exception:
            if time.monotonic() > deadline or server.poll() is not None:
                raise
            time.sleep(0.5)
    proxy = BasicAuthProxy(port, "alice", "s3cret-pw")
    try:
        yield f"http://alice:s3cret-pw@127.0.0.1:{proxy.port}", backend
    finally:
        proxy.close()
        os.killpg(server.pid, 9)
        server.wait()
