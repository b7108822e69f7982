"""Hostile but fair input and faults (issue 10): every case is one row of CASES.

The harness (outcomes, workspace, running) is tests/pipeline/hostile.py; the later audit's
cases are in test_hostile_audit.py. The session prints every table and the counts.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.pipeline.hostile import (
    REPO,
    SECRET,
    Case,
    _app,
    ckpt,
    flip_byte,
    free_port,
    params_for,
    plant_pickle,
    reseal,
    run_case,
    user_dir,
)

# ------------------------------------------------------------------------ the cases

INJECT = "gpu\ntouch injected #"


def sbatch(key: str, value: str = INJECT) -> list[str]:
    return ["submit", "--dry-run", "--set", f"{key}={value}"]


def params(*sets: str) -> list[str]:
    return ["params", *(a for s in sets for a in ("--set", s))]


def _corrupt_manifest(ws):
    (ws / "data/tokens/manifest.json").write_text("{not json")


def _binary_params(ws):
    (ws / "bad.yaml").write_bytes(Path(sys.executable).read_bytes()[:4096])


def _plant_rng(ws):
    plant_pickle(ckpt(ws) / "rng-rank00000.pt", ws / "EXECUTED")
    reseal(ckpt(ws))


def _plant_rng_mid_run(ws):
    """The same config resumes (pipeline/resume.py), so make the run unfinished: drop the last
    checkpoint, point `latest` at the one before, and plant the RNG file there."""
    import shutil

    root = ws / "runs/train/checkpoints"
    steps = sorted(p for p in root.iterdir() if p.name.startswith("step_"))
    shutil.rmtree(steps[-1])
    (root / "latest").write_text(steps[-2].name + "\n")
    _plant_rng(ws)


def _plant_metadata(ws):
    plant_pickle(ckpt(ws) / ".metadata", ws / "EXECUTED")
    reseal(ckpt(ws))


def _no_exec(ws, result):
    return "executed" if (ws / "EXECUTED").exists() else None


def _flip_shard(ws):
    flip_byte(next(ckpt(ws).glob("*.distcp")))


def _drop_metadata(ws):
    (ckpt(ws) / ".metadata").unlink()


def _corrupt_meta_json(ws):
    (ckpt(ws) / "meta.json").write_text("{oops")


def _convert_into_user_dir(ws):
    user_dir(ws / "mine")


def _convert_onto_file(ws):
    (ws / "precious.txt").write_text("keep me\n")


def _tokenize_into_user_dir(ws):
    user_dir(ws / "mine")


def _convert_twice(ws):
    """A genuine earlier conversion (every file listed, unchanged) is ours to replace."""
    r = CliRunner().invoke(_app(), ["convert", "--no-mlflow"])
    assert r.exit_code == 0, r.output


def _converted_again(ws, result):
    return None if (ws / "runs/hf/config.json").is_file() and (ws / "runs/hf/moe_conversion.json").is_file() else "silent"


def _binary_corpus(ws):
    shutil.copy("/bin/ls", ws / "corpus/ls.txt")
    (ws / "corpus/latin1.txt").write_bytes("caf\xe9 cr\xe8me br\xfbl\xe9e ".encode("latin-1") * 50)


def _skipped_counted(ws, result):
    manifest = json.loads((ws / "data/tokens/manifest.json").read_text())
    skipped = sorted(Path(p).name for p in manifest.get("skipped_files", []))
    return None if skipped == ["latin1.txt", "ls.txt"] and "skipped 2" in result.output else "silent"


def _secret_params(ws, result):
    return "leaked" if SECRET in result.output else None


def _dry_run_ok(ws, result):
    return None if "#SBATCH" in result.output and "touch" not in result.output else "silent"


def _tokens_outside_vocab(ws):
    """A token file whose sidecar (checksum included) is consistent but whose ids exceed its vocabulary."""
    import hashlib

    import numpy as np

    from moe.data import TokenDataError
    from moe.data.tokens import open_token_file, write_token_file

    path = ws / "bad.npy"
    write_token_file(path, np.arange(100) % 300, vocab_size=300, eos_id=0, pad_id=None, tokenizer_hash="x", num_documents=1)
    arr = np.fromfile(path, dtype=np.uint16)
    arr[5] = 4000
    arr.tofile(path)
    side = json.loads((ws / "bad.npy.json").read_text())
    side["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    (ws / "bad.npy.json").write_text(json.dumps(side))
    with pytest.raises(TokenDataError, match="outside the vocabulary"):
        open_token_file(path)


def _truncated_rng(ws):
    from moe.train.checkpoint import CheckpointError, CheckpointManager

    f = ckpt(ws) / "rng-rank00000.pt"
    f.write_bytes(f.read_bytes()[:100])
    reseal(ckpt(ws))  # past the checksum: the loader itself must refuse it
    with pytest.raises(CheckpointError, match="rng-rank00000.pt: refused"):
        CheckpointManager.load(ckpt(ws), {})


def _hanging_server_sink(ws):
    """A tracking server that accepts and never answers: the sink gives up within the bound and spools."""
    from pipeline.tracking.job import MlflowSink

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    try:
        sink = MlflowSink(f"http://127.0.0.1:{srv.getsockname()[1]}", "run-x", ws / "fb.jsonl", flush_every=1)
        t0 = time.monotonic()
        sink.log(1, {"loss": 1.0, "lr": 0.1})
        sink.log(2, {"loss": 0.5, "lr": 0.1})  # after the first failure: straight to the file
        took = time.monotonic() - t0
    finally:
        srv.close()
    rows = [json.loads(line) for line in (ws / "fb.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2], rows
    assert took < 30, f"stalled {took:.0f}s on a hanging server"


def _tracker_offline_redacted(ws):
    """An unreachable server with a password in its URI: the stage goes on offline, and neither
    job.json nor the spool holds the password."""
    from pipeline.params import load_params
    from pipeline.stages.train import make_job
    from pipeline.tracking.stage_run import Tracker

    uri = f"http://user:{SECRET}@127.0.0.1:{free_port()}"
    cfg = load_params(ws / "params.yaml", [f"mlflow.tracking_uri={uri}"])
    tracker = Tracker(cfg.mlflow, "train", ws / "params.yaml", fallback=ws / "spool.jsonl")
    tracker.log_stage_start(cfg.flatten())
    assert tracker.run_id.startswith("offline-")
    job = make_job(cfg, tracker)
    spec = job.write()
    tracker.end(ok=True)
    for f in (spec, ws / "spool.jsonl"):
        assert SECRET not in f.read_text(), f"{f} holds the password"
    assert '"mlflow.tracking_uri": "http://user:***@' in (ws / "spool.jsonl").read_text()
    from pipeline.tracking.job import job_uri

    assert job_uri(job) == uri  # the job gets it back from the environment only


def _mlflow_server_banner(ws):
    """`moe mlflow-server`: the password comes from a file; the banner masks it and it is not on
    any command line (the backend URI reaches mlflow through the environment)."""
    (ws / "pw").write_text(SECRET + "\n")
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pipeline.cli",
            "mlflow-server",
            "--backend",
            f"sqlite:///{ws}/srv.db",
            "--port",
            str(port),
            "--password-file",
            str(ws / "pw"),
            "--workers",
            "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ws,
        start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        banner = proc.stdout.readline()
        assert "error" in banner and "--backend" in banner, banner  # sqlite:/// names no user to give it to
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
        proc.wait()
    # a backend that is not there: the command fails at once, before any server process starts,
    # naming the backend as given and never the password (issue 36: it used to retry for ever)
    backend = f"postgresql+psycopg2://mlflow@127.0.0.1:{free_port()}/mlflow"
    r = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "mlflow-server", "--backend", backend, "--port", str(port), "--workers", "1"],
        capture_output=True,
        text=True,
        cwd=ws,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO), "MOE_MLFLOW_BACKEND_PASSWORD": SECRET},
    )
    said = r.stdout + r.stderr
    assert r.returncode == 2 and SECRET not in said, said
    assert said.strip().splitlines()[-1].startswith(f"error: --backend: cannot connect to the backend store {backend}"), said


def _descendants(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d.name))
    return out


def _unreachable_train_check(ws, result):
    fallback = ws / "runs/train/mlflow-fallback.jsonl"
    if not fallback.is_file() or not (ws / "mlflow-fallback.jsonl").is_file():
        return "lost"
    # later: the spool goes to a reachable store with `moe mlflow-sync`
    env_uri = f"sqlite:///{ws / 'synced.db'}"
    r = CliRunner().invoke(_app(), ["mlflow-sync"], env={"MLFLOW_TRACKING_URI": env_uri})
    if r.exit_code != 0:
        return "traceback"
    from mlflow.tracking import MlflowClient

    client = MlflowClient(env_uri)
    runs = client.search_runs([client.get_experiment_by_name("moe").experiment_id])
    train = [r for r in runs if r.data.tags.get("moe.stage") == "train"]
    if not train or "loss" not in train[0].data.metrics or train[0].info.status != "FINISHED":
        return "lost"
    return None


def _spool_one_row(ws):
    (ws / "mlflow-fallback.jsonl").write_text(json.dumps({"run_id": "r1", "step": 1, "metrics": {"loss": 1.0}}) + "\n")


def _spool_kept(ws, result):
    if SECRET in result.output:
        return "leaked"
    return None if (ws / "mlflow-fallback.jsonl").is_file() else "lost"


def _nonfinite_final(ws, result):
    return None if result.exit_code == 3 else ("silent" if result.exit_code == 0 else "traceback")


CASES = [
    # 8: one-line errors instead of tracebacks; `moe params` checks what `moe train` checks
    Case("params-lr-inf", 5, params("optim.lr=inf")),
    Case("params-bias-rate-nan", 5, params("model.moe.bias_update_rate=nan")),
    Case("params-max-rel-diff-nan", 8, params("evaluate.max_rel_diff=nan")),
    Case("params-generate-tokens-negative", 8, params("evaluate.generate_tokens=-1")),
    Case("params-data-seed-negative", 8, params("data.seed=-1")),
    Case("params-vocab-size-huge", 8, params("tokenize.vocab_size=1000000000")),
    Case("params-layout-vs-processes", 8, params("executor.nprocs=3", "parallel.ep=2")),
    Case("params-tokenizer-vs-model-vocab", 8, params("model.vocab_size=260")),
    Case("params-checkpoint-dir-is-file", 8, params("checkpoint.dir=params.yaml/ckpt")),
    Case("params-run-dir-is-file", 8, params("executor.run_dir=params.yaml")),
    Case("params-binary-file", 8, ["params", "--params", "bad.yaml"], setup=_binary_params),
    Case("params-corrupt-manifest", 8, ["params"], setup=_corrupt_manifest),
    Case("params-secret-uri-masked", 7, params(f"mlflow.tracking_uri=postgresql://u:{SECRET}@db/x"), expect="ok", check=_secret_params),
    Case("error-line-secret-masked", 7, params(f"mlflow.tracking_uri=postgresql://u:{SECRET}@db/x", "optim.lr=nan"), check=_secret_params),
    # 6: sbatch injection through any value that reaches the script
    *[
        Case(f"sbatch-{k.split('.')[1]}-newline", 6, sbatch(k))
        for k in ("slurm.partition", "slurm.account", "slurm.qos", "slurm.constraint", "slurm.mem", "slurm.job_name", "slurm.folder")
    ],
    Case("sbatch-extra-newline", 6, sbatch("slurm.extra_sbatch", '["--comment=a\\ntouch injected #"]')),
    Case("sbatch-setup-newline", 6, sbatch("slurm.setup", '["module load x\\ntouch injected"]')),
    Case("sbatch-container-python-semicolon", 6, sbatch("container.python", "python3;touch injected")),
    Case(
        "sbatch-container-image-newline",
        6,
        ["submit", "--dry-run", "--set", "container.runtime=apptainer", "--set", "container.image=a.sif\ntouch injected"],
    ),
    Case("sbatch-partition-space", 6, sbatch("slurm.partition", "gpu --wrap=x")),
    Case("sbatch-valid-dry-run", 6, sbatch("slurm.partition", "gpu"), expect="ok", check=_dry_run_ok),
    # 2: outputs never delete what they did not create
    Case("convert-out-user-dir", 2, ["convert", "--out", "mine", "--no-mlflow"], setup=_convert_into_user_dir),
    Case("convert-out-is-file", 2, ["convert", "--out", "precious.txt", "--no-mlflow"], setup=_convert_onto_file),
    Case("convert-out-own-output", 2, ["convert", "--no-mlflow"], setup=_convert_twice, expect="ok", check=_converted_again),
    Case("convert-from-hf-out-is-file", 2, ["convert", "--from-hf", "runs", "--out", "precious.txt"], setup=_convert_onto_file),
    Case("tokenize-output-user-dir", 2, ["tokenize", "--no-mlflow", "--set", "tokenize.output=mine"], setup=_tokenize_into_user_dir),
    # 5: garbage
    Case("tokenize-binary-and-latin1-files", 5, ["tokenize", "--no-mlflow"], setup=_binary_corpus, expect="ok", check=_skipped_counted),
    Case("tokens-outside-vocab", 5, call=_tokens_outside_vocab),
    Case("checkpoint-flipped-byte", 5, ["convert", "--out", "hf2", "--no-mlflow"], setup=_flip_shard),
    Case("checkpoint-missing-metadata", 5, ["convert", "--out", "hf2", "--no-mlflow"], setup=_drop_metadata),
    Case("checkpoint-corrupt-meta-json", 8, ["convert", "--out", "hf2", "--no-mlflow"], setup=_corrupt_meta_json),
    Case("checkpoint-truncated-rng", 8, call=_truncated_rng),
    # 1: loading a checkpoint never executes code
    Case("checkpoint-planted-metadata-convert", 1, ["convert", "--out", "hf2", "--no-mlflow"], setup=_plant_metadata, check=_no_exec),
    Case("checkpoint-planted-rng-resume", 1, ["train", "--no-mlflow"], setup=_plant_rng_mid_run, check=_no_exec, slow=True),
    Case(
        "checkpoint-planted-rng-init-from",
        1,
        [
            "train",
            "--no-mlflow",
            "--set",
            "checkpoint.init_from=runs/train/checkpoints",
            "--set",
            "checkpoint.dir=runs/other",
            "--set",
            "executor.run_dir=runs/other",
        ],
        setup=_plant_rng,
        check=_no_exec,
        slow=True,
    ),
    # 3: tracking never fails or stalls a run
    Case("mlflow-hanging-server-sink", 3, call=_hanging_server_sink, expect="ok", env={"MLFLOW_HTTP_REQUEST_TIMEOUT": "2"}),
    Case("mlflow-offline-tracker-no-password", 7, call=_tracker_offline_redacted, expect="ok"),
    Case("mlflow-server-password-file", 7, call=_mlflow_server_banner, expect="ok"),
    Case(
        "mlflow-unreachable-train-then-sync",
        3,
        ["train", "--set", "train.max_steps=4", "--set", "checkpoint.dir=runs/train/c2"],
        env={"MLFLOW_TRACKING_URI": "unreachable"},
        expect="ok",
        check=_unreachable_train_check,
        slow=True,
    ),
    Case(
        "mlflow-sync-bad-store-secret-masked",
        7,
        ["mlflow-sync"],
        setup=_spool_one_row,
        check=_spool_kept,
        env={"MLFLOW_TRACKING_URI": f"bogus://u:{SECRET}@h/x"},
    ),
    # 5: a run ending on a non-finite loss does not exit 0, even under nonfinite=skip
    Case(
        "nonfinite-final-loss-under-skip",
        5,
        [
            "train",
            "--no-mlflow",
            "--set",
            "train.nonfinite=skip",
            "--set",
            "optim.lr=1e30",
            "--set",
            "train.grad_clip=null",
            "--set",
            "checkpoint.dir=runs/nan",
            "--set",
            "executor.run_dir=runs/nan",
        ],
        check=_nonfinite_final,
        slow=True,
    ),
]


@pytest.mark.parametrize("case", params_for(CASES))
def test_hostile(case: Case, ws, monkeypatch):
    run_case("issue 10", case, ws, monkeypatch)
