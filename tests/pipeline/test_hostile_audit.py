"""The hostile-input audit of main d3992cd (issue 25), one row per item it found, beside the
issue-10 table (test_hostile.py). Items 7, 10's evaluate rows and 13's convert/evaluate rows
are in test_hostile_hf.py; 8's and 12's tokenizer rows in test_hostile_tokenize.py.
The harness is tests/pipeline/hostile.py; the session prints every table and the counts.
"""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from tests.helpers import plant_bytes_entry, rewrite_checkpoint
from tests.pipeline.hostile import REPO, SECRET, Case, _app, ckpt, free_port, params_for, reseal, run_case, user_dir

TABLE = "issue 25: audit"
TRAIN = ["train", "--no-mlflow"]


def _no_exec(ws, result):
    return "executed" if (ws / "EXECUTED").exists() else None


def _run(ws: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], cwd=ws, env=full, capture_output=True, text=True, timeout=300)


# ---------------------------------------------------------------- 1: code through a checkpoint


def _plant_bytes(ws):
    plant_bytes_entry(ckpt(ws), ws / "EXECUTED")


def _plant_bytes_for_evaluate(ws):
    r = _run(ws, "convert", "--no-mlflow")
    assert r.returncode == 0, r.stderr
    _plant_bytes(ws)


def _unfinish(ws):
    """Make the run resumable (drop the newest step) and plant in the one it resumes from."""
    import shutil

    root = ws / "runs/train/checkpoints"
    steps = sorted(p for p in root.iterdir() if p.name.startswith("step_"))
    shutil.rmtree(steps[-1])
    (root / "latest").write_text(steps[-2].name + "\n")
    _plant_bytes(ws)


# ---------------------------------------------------------------- 2: outputs and users' files


def _webapp(ws):
    app = ws / "webapp"
    (app / "src").mkdir(parents=True)
    (app / "manifest.json").write_text(json.dumps({"name": "my app", "start_url": "/"}))
    (app / "index.html").write_text("<html>precious</html>")
    (app / "src/app.js").write_text("console.log('precious')")


def _adapter_dir(ws):
    d = ws / "adapter"
    d.mkdir()
    (d / "moe_conversion.json").write_text("{}\n")
    (d / "README.md").write_text("my adapter\n")
    (d / "adapter.bin").write_bytes(b"\0precious")


def _release_marker_beside_user_files(ws):
    d = ws / "release_mine"
    d.mkdir()
    (d / "moe_release.json").write_text("{}\n")
    (d / "README.md").write_text("my model card draft\n")
    (d / "weights.bin").write_bytes(b"\0precious")


def _own_conversion_edited(ws):
    r = _run(ws, "convert", "--no-mlflow", "--out", "hfmine")
    assert r.returncode == 0, r.stderr
    (ws / "hfmine/notes.txt").write_text("my notes about this model\n")


def _user_readme(ws):
    (ws / "README.md").write_text("# my project\n")
    r = _run(ws, "convert", "--no-mlflow")
    assert r.returncode == 0, r.stderr


def _user_sample(ws):
    _user_readme(ws)
    (ws / "metrics").mkdir(exist_ok=True)
    (ws / "metrics/notes_sample.txt").write_text("my sample notes\n")


# ---------------------------------------------------------------- 3: reruns and checkpoints


def _extended(ws, result):
    log = (ws / "runs/train/logs/rank0.log").read_text()
    rows = [json.loads(line)["step"] for line in (ws / "runs/train/metrics.jsonl").read_text().splitlines()]
    if "resumed from" not in log or "step_00000008" not in log or rows[0] != 1 or rows[-1] != 12:
        return "lost"
    return None if "extending the run" in result.output else "silent"


class Holder:
    """A process holding a run's lock (another `moe train`), ended by teardown."""

    procs: list[subprocess.Popen] = []

    @classmethod
    def start(cls, ws: Path, *dirs: str) -> None:
        code = (
            "import sys, time; from pipeline.run_lock import RunLock; RunLock(*sys.argv[1:]).acquire('moe train'); "
            "print('held', flush=True); time.sleep(120)"
        )
        proc = subprocess.Popen(
            [sys.executable, "-c", code, *dirs], cwd=ws, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout.readline().strip() == "held"
        cls.procs.append(proc)

    @classmethod
    def stop(cls, ws: Path) -> None:
        while cls.procs:
            p = cls.procs.pop()
            p.kill()
            p.wait()


# ---------------------------------------------------------------- 4: a path into sbatch


def _newline_cwd(ws):
    evil = ws / "evil\ntouch injected #"
    evil.mkdir()
    (evil / "params.yaml").write_text((ws / "params.yaml").read_text())
    cwd = os.getcwd()
    os.chdir(evil)
    try:
        r = CliRunner().invoke(_app(), ["submit", "--dry-run", "--set", "slurm.partition=gpu"])
    finally:
        os.chdir(cwd)
    assert r.exit_code == 2 and r.output.strip().splitlines()[-1].startswith("error:"), r.output
    assert "\ntouch injected" not in r.output and "control character" in r.output, r.output


# ---------------------------------------------------------------- 5: a trickling server


class TricklingServer:
    """Accepts HTTP and answers one byte every ``every`` seconds, forever."""

    def __init__(self, every: float = 4.0) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.every, self.stop = every, False
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._trickle, args=(conn,), daemon=True).start()

    def _trickle(self, conn) -> None:
        try:
            conn.recv(65536)
            for b in b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n{}" * 100:
                if self.stop:
                    break
                conn.send(bytes([b]))
                time.sleep(self.every)
        except OSError:
            pass
        finally:
            conn.close()


_SERVERS: list[TricklingServer] = []


def _trickling(ws):
    srv = TricklingServer()
    _SERVERS.append(srv)
    (ws / "uri").write_text(f"http://127.0.0.1:{srv.port}")


def _trickle_train(ws):
    """`moe train` against the trickling server ends (offline, spooled) instead of hanging."""
    _trickling(ws)
    t0 = time.monotonic()
    r = _run(
        ws,
        "train",
        "--set",
        "train.max_steps=10",
        "--set",
        "checkpoint.dir=runs/t/ck",
        "--set",
        "executor.run_dir=runs/t",
        env={"MLFLOW_TRACKING_URI": (ws / "uri").read_text(), "MOE_TRACKING_DEADLINE_S": "5"},
    )
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert (ws / "runs/t/summary.json").is_file() and took < 150, took


def _stop_servers(ws):
    for s in _SERVERS:
        s.stop = True
        s.sock.close()
    _SERVERS.clear()


# ---------------------------------------------------------------- 6: checkpoint integrity


def _edit_meta(ws, **changes):
    path = ckpt(ws) / "meta.json"
    meta = json.loads(path.read_text())
    for k, v in changes.items():
        if v is None:
            meta.pop(k)
        else:
            meta[k] = v
    path.write_text(json.dumps(meta))


def _drop_files_list(ws):
    _edit_meta(ws, files=None)


def _drop_files_list_resealed(ws):
    _edit_meta(ws, files=None)
    reseal(ckpt(ws))


def _flip_after_drop(ws):
    from tests.pipeline.hostile import flip_byte

    _drop_files_list_resealed(ws)
    flip_byte(next(ckpt(ws).glob("*.distcp")))


def _edit_top_k(ws):
    path = ckpt(ws) / "meta.json"
    meta = json.loads(path.read_text())
    meta["config"]["model"]["moe"]["top_k"] = 1
    path.write_text(json.dumps(meta))


def _edit_step_resealed(ws):
    _unfinished_checkpoint_step(ws)
    _edit_meta(ws, step=18)
    reseal(ckpt(ws))


def _unfinished_checkpoint_step(ws):
    import shutil

    root = ws / "runs/train/checkpoints"
    steps = sorted(p for p in root.iterdir() if p.name.startswith("step_"))
    shutil.rmtree(steps[-1])
    (root / "latest").write_text(steps[-2].name + "\n")


def _nan_weights(ws):
    def nan(tree):
        tree["model"]["embed.weight"][1, 2] = float("nan")

    rewrite_checkpoint(ckpt(ws), nan)


# ---------------------------------------------------------------- 8: resources


def _yaml_bomb(ws):
    lines = ['a: &a ["x","x","x","x","x","x","x","x","x"]']
    for i in range(1, 12):
        lines.append(f"{chr(97 + i)}: &{chr(97 + i)} [{', '.join([f'*{chr(96 + i)}'] * 9)}]")
    (ws / "bomb.yaml").write_text("\n".join(lines) + "\n")


def _yaml_deep(ws):
    (ws / "deep.yaml").write_text("a: " + "[" * 50_000 + "]" * 50_000 + "\n")


def _yaml_duplicate(ws):
    text = (ws / "params.yaml").read_text()
    (ws / "dup.yaml").write_text(text + "\noptim:\n  lr: 0.5\n")


def _olmoe_params(ws):
    params = yaml.safe_load((ws / "params.yaml").read_text())
    params["model"] = {"preset": "olmoe-1b-7b"}
    (ws / "olmoe.yaml").write_text(yaml.safe_dump(params))


def _damaged_metrics(ws):
    path = ws / "runs/train/metrics.jsonl"
    lines = path.read_text().splitlines()
    lines.insert(1, '{"step": 2, "loss": 1.0, oops')
    path.write_text("\n".join(lines) + "\n")


def _damaged_metrics_kept(ws, result):
    return None if "metrics.jsonl:2" in result.output and "skipped" in result.output else "silent"


def _no_mlflow_module(ws):
    code = (
        "import sys; sys.modules['mlflow'] = None; sys.argv = ['moe', 'tokenize', '--set', 'tokenize.output=tok2']; "
        "from pipeline.cli import main; main()"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ws, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=300)
    last = (r.stdout + r.stderr).strip().splitlines()[-1]
    assert r.returncode == 2 and last.startswith("error:") and "moe-pipeline[pipeline]" in last and "--no-mlflow" in last, last


def _half_migrated_store(ws):
    """A store left between two schema versions (a migration that a full disk interrupted),
    made in another process (MLflow caches a store's engine per process)."""
    code = (
        "import sqlite3, sys; from mlflow.tracking import MlflowClient; MlflowClient('sqlite:///' + sys.argv[1]).search_experiments(); "
        "db = sqlite3.connect(sys.argv[1]); db.execute(\"UPDATE alembic_version SET version_num = '0584bdc529eb'\"); db.commit()"
    )
    subprocess.run([sys.executable, "-c", code, str(ws / "mlflow.db")], check=True, capture_output=True, timeout=120)


def _store_named(ws, result):
    return None if "mlflow.db" in result.output.strip().splitlines()[-1] else "silent"


SMALL_MOUNTS: list[Path] = []


def _full_disk(ws):
    mount = ws / "full"
    mount.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(mount)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({r.stderr.strip()})")
    SMALL_MOUNTS.append(mount)


def _unmount(ws):
    while SMALL_MOUNTS:
        subprocess.run(["umount", "-l", str(SMALL_MOUNTS.pop())], check=False)


def _nothing_partial(target: str):
    def check(ws, result):
        left = [p.name for p in (ws / "full").iterdir()] if (ws / "full").is_dir() else []
        out = result.output.strip().splitlines()[-1]
        if "disk is full" not in out and "No space left" not in out:
            return "silent"
        return "lost" if any(not n.startswith(".") and n == target for n in left) else None

    return check


def _full_disk_convert(ws):
    _full_disk(ws)


def _full_disk_checkpoint(ws):
    _full_disk(ws)


# ---------------------------------------------------------------- 9: credentials


def _live_server(ws, result):  # noqa: ARG001 - used as a call
    pass


def _credentials_masked_everywhere(ws):
    """A live MLflow server; the tracking URI carries a password: nothing keeps or prints it."""
    from mlflow.tracking import MlflowClient

    port = free_port()
    store = ws / "srv"
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--backend-store-uri",
            f"sqlite:///{store}.db",
            "--default-artifact-root",
            str(store),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
        ],
        cwd=ws,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                MlflowClient(f"http://127.0.0.1:{port}").search_experiments()
                break
            except Exception:
                time.sleep(0.5)
        uri = f"http://alice:{SECRET}@127.0.0.1:{port}"
        outputs = []
        for env in ({}, {"MLFLOW_TRACKING_URI": uri}):
            args = [
                "train",
                "--set",
                "train.max_steps=2",
                "--set",
                "train.eval_every=2",
                "--set",
                f"checkpoint.dir=runs/c{len(outputs)}/ck",
                "--set",
                f"executor.run_dir=runs/c{len(outputs)}",
            ]
            if not env:
                args += ["--set", f"mlflow.tracking_uri={uri}"]
            r = _run(ws, *args, env=env)
            assert r.returncode == 0, r.stdout[-1500:] + r.stderr[-1500:]
            outputs.append(r.stdout + r.stderr)
        for out in outputs:
            assert SECRET not in out, [line for line in out.splitlines() if SECRET in line][:4]
        found = [p for p in store.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]
        assert not found, f"the password is stored in {found[:3]}"
        with sqlite3.connect(f"{store}.db") as db:
            for table in ("params", "tags"):
                rows = db.execute(f"SELECT * FROM {table}").fetchall()  # noqa: S608 - a fixed table name
                assert not any(SECRET in str(row) for row in rows), table
    finally:
        os.killpg(server.pid, 9)
        server.wait()


# ---------------------------------------------------------------- 10, 11: locks, symlinks


def _hold_checkpoint_dir(ws):
    Holder.start(ws, "runs/first", "runs/train/checkpoints")


def _hold_run_dir(ws):
    Holder.start(ws, "runs/train")


def _symlink(name: str):
    def setup(ws):
        target = ws / "precious.txt"
        target.write_text("keep me\n")
        link = ws / name
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.exists() or link.is_symlink():
            link.unlink()
        link.symlink_to(target)

    return setup


def _symlinked_plot(ws):
    _symlink("plots/train_loss.csv")(ws)


def _symlinked_sample(ws):
    r = _run(ws, "convert", "--no-mlflow")
    assert r.returncode == 0, r.stderr
    _symlink("metrics/eval_sample.txt")(ws)


def _user_run_dir(ws):
    user_dir(ws / "mydir")


def _user_files_with_run_names(ws):
    """Issue 37: a user's experiment folder holding files under the names a run writes."""
    d = ws / "myexp"
    (d / "logs").mkdir(parents=True)
    (d / "summary.json").write_text(json.dumps({"accuracy": 0.91, "notes": "my baseline"}))
    (d / "metrics.jsonl").write_text('{"val_loss": 3.2}\n{"val_loss": 3.1}\n')
    (d / "logs/rank0.log").write_text("my own notes about rank 0\n")


def _user_files_through_symlink(ws):
    _user_files_with_run_names(ws)
    (ws / "runs").mkdir(exist_ok=True)
    (ws / "runs/linked").symlink_to(ws / "myexp")


def _user_baseline(ws):
    (ws / "res").mkdir()
    (ws / "res/baseline.json").write_text('{"val_loss": 3.2}\n')


def _names(fragment):
    def check(ws, result):
        return None if fragment in result.output else "silent"

    return check


def _bench_json(content):
    def setup(ws):
        (ws / "result.json").write_text(content)

    return setup


def _task_data_doc_id_text(ws):
    """Issue 37: evaluate.data_dir holding a request file whose doc_id is text."""
    import gzip

    from pipeline.eval.data import data_root

    src = data_root() / "oe_eval_tasks/arc_easy/rc_0shot/requests.jsonl.gz"
    dst = ws / "baddata/oe_eval_tasks/arc_easy/rc_0shot/requests.jsonl.gz"
    dst.parent.mkdir(parents=True)
    (ws / "baddata/hf_datasets").mkdir()
    lines = gzip.decompress(src.read_bytes()).decode().splitlines()
    row = json.loads(lines[2])
    row["doc_id"] = "seven"
    lines[2] = json.dumps(row)
    dst.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))


def _from_hf_checkpoint(ws):
    r = _run(ws, "convert", "--no-mlflow")
    assert r.returncode == 0, r.stderr
    r = _run(ws, "convert", "--no-mlflow", "--from-hf", "runs/hf", "--out", "fromhf")
    assert r.returncode == 0, r.stderr


def _paper_results(ws, results: str = "paper/results"):
    import shutil

    (ws / "paper.yaml").write_text(json.dumps({"paper": {"results": results}}))
    if not results.startswith("/"):
        shutil.copytree(REPO / "bench/paper/h200x1/results", ws / results)


def _paper_users_report(ws):
    _paper_results(ws)
    (ws / "paper/REPORT.md").write_text("# my own report\n")


def _paper_plot_link(ws):
    _paper_results(ws)
    (ws / "paper/plots").mkdir()
    (ws / "precious.txt").write_text("precious\n")
    (ws / "paper/plots/experts.png").symlink_to(ws / "precious.txt")


def _paper_results_list(ws):
    _paper_results(ws)
    (ws / "paper/results/fp8.json").write_text("[1, 2]")


def _lock_fifo(ws):
    d = ws / "runs/fifo"
    d.mkdir(parents=True)
    os.mkfifo(d / ".lock")


def _ledger_fifo(ws):
    """A FIFO as the ledger of metrics/ (issue 50, item 8 of its audit: `moe train` and `moe evaluate` hung on it)."""
    ledger = ws / "metrics/.moe-outputs.json"
    ledger.parent.mkdir(exist_ok=True)
    if ledger.exists():
        ledger.unlink()
    os.mkfifo(ledger)


# ---------------------------------------------------------------- 13: mismatches


def _spool_for_another_store(ws):
    (ws / "runs/train/mlflow-fallback.jsonl").write_text(
        json.dumps({"run_id": "0123456789abcdef0123456789abcdef", "uri": "sqlite:////somewhere/mlflow.db", "step": 1, "metrics": {"loss": 1.0}})
        + "\n"
    )
    (ws / "elsewhere").mkdir()


def _sync_elsewhere(ws):
    r = _run(ws / "elsewhere", "mlflow-sync", str(ws / "runs/train"))
    last = (r.stdout + r.stderr).strip().splitlines()[-1]
    assert r.returncode == 2 and last.startswith("error:") and "is not in" in last, last
    assert (ws / "runs/train/mlflow-fallback.jsonl").is_file(), "the spool was marked synced"


CKPT_FILES = ("runs/train/checkpoints/*/*", "runs/train/metrics.jsonl")

# ---------------------------------------------------------------- issue 50: the release and the card


def _record_entry_outside(ws):
    from tests.pipeline.stages.test_release import plant_record_entry, ready_to_release

    ready_to_release(ws)
    (ws / "runs/victim.txt").write_text("victim original\n")
    (ws / "victim.txt").write_text("the attacker's\n")
    plant_record_entry(ws, "../../victim.txt")


def _ready_to_release(ws):
    from tests.pipeline.stages.test_release import ready_to_release

    ready_to_release(ws)


def _released_once(ws):
    _ready_to_release(ws)
    r = CliRunner().invoke(_app(), ["release"])
    assert r.exit_code == 0, r.output


def _edit_release_then_convert(ws):
    """`moe release; echo '{}' > runs/release/tokenizer_config.json`: runs/hf keeps its file and `moe convert` runs."""
    before = (ws / "runs/hf/tokenizer_config.json").read_bytes()
    with open(ws / "runs/release/tokenizer_config.json", "w") as f:
        f.write("{}\n")
    assert (ws / "runs/hf/tokenizer_config.json").read_bytes() == before, "editing the release changed runs/hf"
    r = CliRunner().invoke(_app(), ["convert", "--no-mlflow"])
    assert r.exit_code == 0, r.output


def _card_of(directory: Path) -> tuple[str, list[str]]:
    card = (directory / "README.md").read_text()
    return card, card.split("\n---\n", 1)[1].splitlines()


def _release_named_as_python(ws):
    """release.output's name never reaches the card's from_pretrained(...) line (issue 51: the card
    names the model, release.name or olmoe-<preset>-step<step>, not its folder); the line runs no command."""
    import ast

    name = 'm"),__import__("os").system("touch injected"),("'
    r = CliRunner().invoke(_app(), ["release", "--set", f"release.output=runs/{name}"])
    assert r.exit_code == 0, r.output
    card, body = _card_of(ws / "runs" / name)
    start = body.index("```python") + 1
    snippet = ast.parse("\n".join(body[start : body.index("```", start)]))
    calls = [n for n in ast.walk(snippet) if isinstance(n, ast.Call)]
    assert all(isinstance(c.func, ast.Attribute) and c.func.attr == "from_pretrained" and c.args[0].value == "olmoe-tiny-step8" for c in calls), card
    assert "__import__" not in card
    exec(compile(snippet, "card", "exec"), {"__builtins__": {"__import__": lambda *a, **k: _FakeTransformers}})  # the pasted line: no command runs


class _FakeTransformers:
    class AutoModelForCausalLM:
        from_pretrained = staticmethod(lambda name: name)

    AutoTokenizer = AutoModelForCausalLM


def _convert_out_as_html(ws):
    """`moe convert --out '<img src=x onerror=alert(1)>'`: the card's title is the model's name, never the folder's or an image."""
    out = "<img src=x onerror=alert(1)>"
    r = CliRunner().invoke(_app(), ["convert", "--no-mlflow", "--out", out])
    assert r.exit_code == 0, r.output
    _, body = _card_of(ws / out)
    assert not any("<img" in line for line in body), "raw <img in the card"
    assert [line for line in body if line.startswith("# ")] == ["# olmoe-tiny-step8"]


def _corpus_as_markdown(ws):
    """tokenize.inputs as the tokens' manifest records them (a file name may hold a newline and
    `<`) cannot add a heading or HTML to the card."""
    manifest = json.loads((ws / "data/tokens/manifest.json").read_text())
    manifest["inputs"].append("x\n# Injected\n<img src=x onerror=alert(1)>")
    (ws / "data/tokens/manifest.json").write_text(json.dumps(manifest))
    r = CliRunner().invoke(_app(), ["convert", "--no-mlflow", "--out", "hf_card"])
    assert r.exit_code == 0, r.output
    _, body = _card_of(ws / "hf_card")
    assert "# Injected" not in [line.strip() for line in body] and not any("<img" in line for line in body)
    assert any("x # Injected &lt;img src=x onerror=alert(1)&gt;" in line for line in body if line.startswith("| training data |"))


# ---------------------------------------------------------------- issue 50: run directories, Slurm values, job.json


def _users_run_shaped_metrics(ws):
    """A user's folder whose metrics.jsonl reads like a run's (step rows), without a run's job.json."""
    (ws / "mymetrics").mkdir()
    (ws / "mymetrics/metrics.jsonl").write_text('{"step": 1, "loss": 2.5}\n{"step": 2, "loss": 2.4}\n')


def _users_eval_beside_run_files(ws):
    (ws / "myeval/eval").mkdir(parents=True)
    (ws / "myeval/eval/notes.txt").write_text("my notes\n")
    (ws / "myeval/metrics.jsonl").write_text('{"step": 1, "loss": 2.5}\n')


def _job_json_layout_dp_zero(ws):
    """A job.json whose layout says dp 0 (a ZeroDivisionError in every worker before)."""
    spec = json.loads((ws / "runs/train/job.json").read_text())
    spec["layout"]["dp"] = 0
    (ws / "edited.json").write_text(json.dumps(spec))
    r = subprocess.run([sys.executable, "-m", "pipeline.worker", "edited.json"], cwd=ws, capture_output=True, text=True, timeout=300)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(errors) == 1, r.stderr[-1500:]
    assert "job.json: layout.dp: must be >= 1, got 0" in errors[0], errors[0]


CASES = [
    # 1: no checkpoint path reaches an unrestricted unpickling
    Case("bytes-entry-convert", 1, ["convert", "--out", "hf2", "--no-mlflow"], setup=_plant_bytes, check=_no_exec),
    Case("bytes-entry-evaluate", 1, ["evaluate", "--no-mlflow"], setup=_plant_bytes_for_evaluate, check=_no_exec, slow=True),
    Case(
        "bytes-entry-init-from",
        1,
        [
            *TRAIN,
            "--set",
            "checkpoint.init_from=runs/train/checkpoints",
            "--set",
            "checkpoint.dir=runs/other/ck",
            "--set",
            "executor.run_dir=runs/other",
        ],
        setup=_plant_bytes,
        check=_no_exec,
        slow=True,
    ),
    Case("bytes-entry-resume", 1, TRAIN, setup=_unfinish, check=_no_exec, slow=True),
    Case("bytes-entry-rerun-finished", 1, TRAIN, setup=_plant_bytes, check=_no_exec, slow=True),
    # 2: replace only what we provably wrote
    Case(
        "tokenize-output-webapp-with-manifest",
        2,
        ["tokenize", "--no-mlflow", "--set", "tokenize.output=webapp"],
        setup=_webapp,
        keep=("webapp/**/*",),
    ),
    Case("convert-out-marker-beside-user-files", 2, ["convert", "--no-mlflow", "--out", "adapter"], setup=_adapter_dir, keep=("adapter/*",)),
    Case(
        "convert-out-own-output-with-user-notes", 2, ["convert", "--no-mlflow", "--out", "hfmine"], setup=_own_conversion_edited, keep=("hfmine/*",)
    ),
    Case(
        "release-output-marker-beside-user-files",
        2,
        ["release", "--set", "release.output=release_mine"],
        setup=_release_marker_beside_user_files,
        keep=("release_mine/*",),
    ),
    Case(
        "evaluate-output-user-file",
        2,
        ["evaluate", "--no-mlflow", "--set", "evaluate.output=README.md"],
        setup=_user_readme,
        keep=("README.md", "README_sample.txt"),
        slow=True,
    ),
    Case(
        "evaluate-output-sample-sibling",
        2,
        ["evaluate", "--no-mlflow", "--set", "evaluate.output=metrics/notes.json"],
        setup=_user_sample,
        keep=("metrics/notes_sample.txt",),
        slow=True,
    ),
    # 3: reruns never destroy checkpoints
    Case("rerun-extend-max-steps", 3, [*TRAIN, "--set", "train.max_steps=12"], expect="ok", check=_extended, slow=True),
    Case("rerun-changed-config-refused", 3, [*TRAIN, "--set", "optim.lr=0.001"], keep=CKPT_FILES),
    Case(
        "init-from-own-checkpoint-dir",
        3,
        [*TRAIN, "--set", "checkpoint.init_from=runs/train/checkpoints", "--set", "optim.lr=0.001"],
        keep=CKPT_FILES,
    ),
    Case(
        "lock-refusal-touches-nothing",
        3,
        [*TRAIN, "--set", "optim.lr=0.001", "--set", "checkpoint.resume=auto"],
        setup=_hold_run_dir,
        teardown=Holder.stop,
        keep=CKPT_FILES,
    ),
    # 4: a path into the sbatch script
    Case("sbatch-working-directory-newline", 4, call=_newline_cwd),
    # 5: tracking calls have a total deadline
    Case("mlflow-trickling-server-train", 5, call=_trickle_train, expect="ok", teardown=_stop_servers, slow=True),
    # 6: integrity
    Case("meta-files-list-removed", 6, ["convert", "--out", "hf2", "--no-mlflow"], setup=_drop_files_list),
    Case("meta-files-list-removed-resealed", 6, ["convert", "--out", "hf2", "--no-mlflow"], setup=_drop_files_list_resealed),
    Case("meta-files-removed-then-shard-flipped", 6, ["convert", "--out", "hf2", "--no-mlflow"], setup=_flip_after_drop),
    Case("meta-top-k-edited", 6, ["convert", "--out", "hf2", "--no-mlflow"], setup=_edit_top_k),
    Case("meta-step-edited-resealed", 6, TRAIN, setup=_edit_step_resealed, keep=CKPT_FILES),
    Case("nan-weights-resealed-convert", 6, ["convert", "--out", "hf2", "--no-mlflow"], setup=_nan_weights),
    # 8: resources
    Case("yaml-alias-bomb", 8, ["params", "--params", "bomb.yaml"], setup=_yaml_bomb, subprocess=True, timeout=60),
    Case("yaml-50000-deep", 8, ["params", "--params", "deep.yaml"], setup=_yaml_deep, subprocess=True, timeout=60),
    Case("yaml-duplicate-keys", 8, ["params", "--params", "dup.yaml"], setup=_yaml_duplicate),
    Case("max-seq-len-1e9", 8, [*TRAIN, "--set", "model.max_seq_len=1000000000"]),
    Case(
        "olmoe-preset-on-cpu",
        8,
        [*TRAIN, "--params", "olmoe.yaml", "--set", "executor.run_dir=runs/big", "--set", "checkpoint.dir=runs/big/ck"],
        setup=_olmoe_params,
        subprocess=True,
        timeout=240,
    ),
    Case("metrics-jsonl-damaged-rerun", 8, TRAIN, setup=_damaged_metrics, expect="ok", check=_damaged_metrics_kept, slow=True),
    Case("mlflow-not-installed-tokenize", 8, call=_no_mlflow_module),
    Case(
        "mlflow-store-half-migrated",
        8,
        ["tokenize", "--set", "tokenize.output=tok2"],
        setup=_half_migrated_store,
        check=_store_named,
        subprocess=True,
    ),
    Case(
        "disk-full-tokenize",
        8,
        ["tokenize", "--no-mlflow", "--set", "tokenize.output=full/tokens"],
        setup=_full_disk,
        teardown=_unmount,
        check=_nothing_partial("tokens"),
    ),
    Case(
        "disk-full-convert",
        8,
        ["convert", "--no-mlflow", "--out", "full/hf"],
        setup=_full_disk_convert,
        teardown=_unmount,
        check=_nothing_partial("hf"),
    ),
    Case(
        "disk-full-checkpoint",
        8,
        [*TRAIN, "--set", "checkpoint.dir=full/ck", "--set", "executor.run_dir=runs/full"],
        setup=_full_disk_checkpoint,
        teardown=_unmount,
        check=_nothing_partial("step_00000004"),
        slow=True,
    ),
    # 9: credentials never leave in clear text
    Case("credentials-live-server-train", 9, call=_credentials_masked_everywhere, expect="ok", slow=True),
    # 10: one lock over everything a run writes
    Case(
        "same-checkpoint-dir-other-run-dir",
        10,
        [*TRAIN, "--set", "executor.run_dir=runs/second"],
        setup=_hold_checkpoint_dir,
        teardown=Holder.stop,
        keep=CKPT_FILES,
    ),
    # 11: writes never follow symlinks; user directories are not run directories
    Case("lock-file-symlink", 11, TRAIN, setup=_symlink("runs/train/.lock"), keep=("precious.txt",)),
    Case("job-json-symlink", 11, TRAIN, setup=_symlink("runs/train/job.json"), keep=("precious.txt",)),
    Case("rank0-log-symlink", 11, [*TRAIN, "--set", "train.max_steps=9"], setup=_symlink("runs/train/logs/rank0.log"), keep=("precious.txt",)),
    Case("plot-csv-symlink", 11, TRAIN, setup=_symlinked_plot, keep=("precious.txt",), slow=True),
    Case("eval-sample-symlink", 11, ["evaluate", "--no-mlflow"], setup=_symlinked_sample, keep=("precious.txt",), slow=True),
    Case(
        "run-dir-is-a-user-dir",
        11,
        [*TRAIN, "--set", "executor.run_dir=mydir", "--set", "checkpoint.dir=runs/x/ck"],
        setup=_user_run_dir,
        keep=("mydir/*",),
    ),
    Case(
        "run-dir-user-files-named-like-ours",
        11,
        [*TRAIN, "--set", "executor.run_dir=myexp", "--set", "checkpoint.dir=runs/x/ck"],
        setup=_user_files_with_run_names,
        keep=("myexp/*", "myexp/logs/*"),
    ),
    Case(
        "run-dir-user-files-through-symlink",
        11,
        [*TRAIN, "--set", "executor.run_dir=runs/linked", "--set", "checkpoint.dir=runs/y/ck"],
        setup=_user_files_through_symlink,
        keep=("myexp/*", "myexp/logs/*"),
    ),
    Case(
        "evaluate-output-users-val-loss-json",
        11,
        ["evaluate", "--no-mlflow", "--set", "evaluate.output=res/baseline.json"],
        setup=_user_baseline,
        check=_names("res/baseline.json exists and was not written by this stage"),
        keep=("res/baseline.json",),
    ),
    Case(
        "evaluate-output-is-the-train-stages-metrics",
        11,
        ["evaluate", "--no-mlflow", "--set", "evaluate.output=metrics/train.json"],
        check=_names("metrics/train.json exists and was not written by this stage"),
        keep=("metrics/train.json",),
    ),
    Case("bench-log-a-list", 12, ["bench", "log", "result.json"], setup=_bench_json("[1, 2]"), check=_names("result.json: the top level is a list")),
    Case(
        "bench-log-broken-json", 12, ["bench", "log", "result.json"], setup=_bench_json("{broken"), check=_names("result.json: the file is not JSON")
    ),
    Case(
        "bench-log-artifact-elsewhere",
        12,
        ["bench", "log", "result.json"],
        setup=_bench_json('{"artifacts": ["/etc/passwd"]}'),
        check=_names("artifacts names passwd, which is not a file beside it"),
    ),
    Case(
        "task-data-doc-id-text",
        12,
        ["evaluate", "--no-mlflow", "--set", "evaluate.data_dir=baddata", "--set", "evaluate.tasks=[arc_easy_rc_0shot]"],
        setup=_task_data_doc_id_text,
        check=_names("requests.jsonl.gz:3: field 'doc_id' is 'seven'"),
    ),
    Case(
        "checkpoint-curve-with-a-from-hf-conversion",
        13,
        ["evaluate", "--no-mlflow", "--checkpoint", "runs/train/checkpoints/step_00000008", "--checkpoint", "fromhf"],
        setup=_from_hf_checkpoint,
        check=_names("was converted from the Hugging Face model"),
        slow=True,
    ),
    Case(
        "task-data-doc-id-text-in-loop",
        12,
        [
            *TRAIN,
            "--set",
            "train.eval_every=4",
            "--set",
            "train.eval_tasks=[arc_easy_rc_0shot]",
            "--set",
            "evaluate.data_dir=baddata",
            "--set",
            "executor.run_dir=runs/inloop",
            "--set",
            "checkpoint.dir=runs/inloop/ck",
        ],
        setup=_task_data_doc_id_text,
        check=_names("requests.jsonl.gz:3: field 'doc_id' is 'seven'"),
    ),
    Case(
        "job-spec-out-over-a-users-file",
        11,
        ["job", "--out", "notes.json"],
        setup=lambda ws: (ws / "notes.json").write_text('{"my": "notes"}\n'),
        check=_names("notes.json exists and was not written by this stage"),
        keep=("notes.json",),
    ),
    Case(
        "paper-report-over-a-users-report",
        11,
        ["paper", "report", "--no-mlflow", "-p", "paper.yaml"],
        setup=_paper_users_report,
        check=_names("REPORT.md exists and was not written by this stage"),
        keep=("paper/REPORT.md",),
    ),
    Case(
        "paper-report-plot-symlink",
        11,
        ["paper", "report", "--no-mlflow", "-p", "paper.yaml"],
        setup=_paper_plot_link,
        check=_names("is a symlink"),
        keep=("precious.txt",),
    ),
    Case(
        "paper-report-results-at-the-root",
        11,
        ["paper", "report", "--no-mlflow", "-p", "paper.yaml"],
        setup=lambda ws: _paper_results(ws, "/etc"),
        check=_names("outside this project"),
    ),
    Case(
        "paper-report-results-a-list",
        12,
        ["paper", "report", "--no-mlflow", "-p", "paper.yaml"],
        setup=_paper_results_list,
        check=_names("fp8.json: the top level is a list"),
    ),
    Case("lock-file-is-a-fifo", 11, [*TRAIN, "--set", "executor.run_dir=runs/fifo", "--set", "checkpoint.dir=runs/fifo/ck"], setup=_lock_fifo),
    Case("set-recompute-none", 11, ["params", "--set", "train.recompute=none"], expect="ok"),
    Case("set-container-runtime-none", 11, ["params", "--set", "container.runtime=none"], expect="ok"),
    # 13: mismatches
    Case("mlflow-sync-from-another-directory", 13, call=_sync_elsewhere, setup=_spool_for_another_store),
    # issue 50: the release stays in its folder and shares nothing; the card escapes what it pastes
    Case(
        "release-record-entry-outside-its-folder",
        50,
        ["release", "--set", "release.output=runs/deep/release"],
        setup=_record_entry_outside,
        keep=("runs/victim.txt", "victim.txt"),
    ),
    Case("release-edit-changes-no-conversion", 50, call=_edit_release_then_convert, setup=_released_once, expect="ok"),
    Case("release-inside-convert-output", 50, ["release", "--set", "release.output=runs/hf/release"], setup=_ready_to_release, keep=("runs/hf/*",)),
    Case(
        "release-inside-an-earlier-release",
        50,
        ["release", "--set", "release.output=runs/release/inner"],
        setup=_released_once,
        keep=("runs/release/*",),
    ),
    Case("release-output-name-is-python", 50, call=_release_named_as_python, setup=_ready_to_release, expect="ok"),
    Case("convert-out-is-html", 50, call=_convert_out_as_html, expect="ok"),
    Case("tokenize-inputs-as-markdown-in-the-card", 50, call=_corpus_as_markdown, expect="ok"),
    # issue 50 (from item 12): `moe bench log` says what MLflow would refuse, before making a run
    Case(
        "bench-log-name-mlflow-refuses",
        50,
        ["bench", "log", "result.json"],
        setup=_bench_json('{"result": {"layers": 4, "bad key!": 1.0}}'),
        check=_names("result.json: result.bad key! names the metric '4/bad key!'"),
    ),
    Case(
        "bench-log-empty-object",
        50,
        ["bench", "log", "result.json"],
        setup=_bench_json("{}"),
        check=_names("result.json: the file holds no number to log"),
    ),
    Case(
        "bench-log-number-as-text",
        50,
        ["bench", "log", "result.json"],
        setup=_bench_json('{"result": {"layers": 4, "tflops": "12.5"}}'),
        check=_names("result.json: result.tflops is '12.5', a number written as text"),
    ),
    Case(
        "bench-log-server-unreachable-token-in-uri",
        50,
        ["bench", "log", "result.json"],
        setup=_bench_json('{"result": {"layers": 4, "tflops": 1.0}}'),
        env={"MLFLOW_TRACKING_URI": f"http://127.0.0.1:9/?private_token={SECRET}", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"},
        expect="ok",
        check=_names("result.json -> spooled to mlflow-fallback.jsonl (MLflow unreachable)"),
    ),
    # issue 50: run directories, Slurm values, job ids, init_from, job.json
    Case(
        "run-dir-users-metrics-shaped-like-a-runs",
        50,
        [*TRAIN, "--set", "executor.run_dir=mymetrics", "--set", "checkpoint.dir=runs/m/ck"],
        setup=_users_run_shaped_metrics,
        check=_names("holds metrics.jsonl but no job.json"),
        keep=("mymetrics/*",),
    ),
    Case(
        "run-dir-users-eval-folder",
        50,
        [*TRAIN, "--set", "executor.run_dir=myeval", "--set", "checkpoint.dir=runs/e/ck"],
        setup=_users_eval_beside_run_files,
        check=_names("holds eval, which a training run does not write"),
        keep=("myeval/*", "myeval/eval/*"),
    ),
    Case("slurm-cpus-per-task-negative", 50, ["params", "--set", "slurm.cpus_per_task=-4"], check=_names("slurm.cpus_per_task: must be between")),
    Case("slurm-mem-negative-job", 50, ["job", "--set", "slurm.mem=-5G"], check=_names("slurm.mem: '-5G' must be")),
    Case("slurm-time-min-1e12-submit", 50, ["submit", "--dry-run", "--set", "slurm.time_min=1000000000000"], check=_names("slurm.time_min")),
    Case("slurm-job-name-bidi-override", 50, ["submit", "--dry-run", "--set", "slurm.job_name=ab\u202ecd"], check=_names("U+202E")),
    Case("cancel-job-id-a-flag", 50, ["cancel", "--", "--me"], check=_names("'--me' is not a Slurm job id")),
    Case(
        "params-init-from-missing",
        50,
        ["params", "--set", "checkpoint.init_from=/nonexistent", "--set", "checkpoint.dir=runs/fresh/ck", "--set", "executor.run_dir=runs/fresh"],
        check=_names("checkpoint.init_from: /nonexistent: no complete checkpoint found"),
    ),
    Case(  # a checkpoint to resume: init_from is not read, by the worker nor by `moe params`
        "params-init-from-missing-but-resuming",
        50,
        ["params", "--set", "checkpoint.init_from=/nonexistent"],
        expect="ok",
    ),
    Case("job-json-layout-dp-zero", 50, call=_job_json_layout_dp_zero),
    Case(
        "ledger-is-a-fifo-train",
        50,
        TRAIN,
        setup=_ledger_fifo,
        subprocess=True,
        timeout=180,
        check=_names("metrics/.moe-outputs.json: not a regular file"),
    ),
    Case(
        "ledger-is-a-fifo-evaluate",
        50,
        ["evaluate", "--no-mlflow"],
        setup=_ledger_fifo,
        subprocess=True,
        timeout=180,
        check=_names("metrics/.moe-outputs.json: not a regular file"),
    ),
]


@pytest.mark.parametrize("case", params_for(CASES))
def test_audit(case: Case, ws, monkeypatch):
    run_case(TABLE, case, ws, monkeypatch)


def test_parse_params_yaml_limits():
    """The strict loader itself: aliases, depth and duplicates refused; an ordinary file loads."""
    from moe.config import ConfigError
    from pipeline.params import parse_params_text

    assert parse_params_text("a: {b: [1, 2]}\n", "x") == {"a": {"b": [1, 2]}}
    for text, message in (("a: &x 1\nb: *x\n", "aliases"), ("a: 1\na: 2\n", "duplicate key 'a'"), ("a: " + "[" * 40 + "]" * 40, "nested deeper")):
        with pytest.raises(ConfigError, match=message):
            parse_params_text(text, "x")
    assert yaml.safe_load("a: 1") == {"a": 1}
