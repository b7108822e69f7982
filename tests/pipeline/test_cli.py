"""The installed `moe` console script: help everywhere, one clear line per bad input."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

COMMANDS = [
    [],
    ["tokenize"],
    ["train"],
    ["convert"],
    ["evaluate"],
    ["params"],
    ["repro"],
    ["ui"],
    ["bench"],
    ["submit"],
    ["status"],
    ["logs"],
    ["cancel"],
    ["job"],
    ["mlflow-server"],
    ["mlflow-sync"],
    ["image-digest"],
    ["bench", "log"],
]


def moe(*args, cwd=None, env=None):
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli", *args], cwd=cwd, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=600
    )


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: " ".join(c) or "moe")
def test_help_everywhere(cmd):
    r = moe(*cmd, "--help")
    assert r.returncode == 0, r.stderr
    assert "Usage" in r.stdout
    assert "<bool>" not in r.stdout  # a flag takes no value: none is shown


@pytest.mark.parametrize("cmd, flag", [("layer", "--tokens"), ("experts", "--tokens"), ("model", "--layers")])
def test_bench_commands_forward_their_own_help(cmd, flag):
    r = moe("bench", cmd, "--help")
    assert r.returncode == 0 and flag in r.stdout


def assert_one_error_line(r, code, text):
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, r.stderr
    assert text in errors[0], errors[0]
    assert "Traceback" not in r.stderr


def test_params_errors(workspace):
    assert_one_error_line(moe("params", "--set", "model.moe.top_k=99"), 2, "model.moe.top_k: top_k=99 is larger than num_experts=4")
    assert_one_error_line(moe("params", "--set", "train.max_step=3"), 2, "did you mean 'train.max_steps'?")
    assert_one_error_line(moe("params", "--params", "nope.yaml"), 2, "nope.yaml: params file not found")


def test_stage_errors(workspace):
    assert_one_error_line(moe("train", "--no-mlflow"), 2, "run the tokenize stage first")
    assert_one_error_line(moe("tokenize", "--no-mlflow", "--set", "tokenize.inputs=[missing_dir]"), 2, "tokenize.inputs: missing_dir not found")
    assert not Path("data/tokens").exists()
    r = moe("tokenize", "--no-mlflow")
    assert r.returncode == 0, r.stderr
    assert_one_error_line(moe("train", "--no-mlflow", "--set", "data.tokenizer_hash=0123"), 2, "the tokenizer does not match the data")
    assert not Path("metrics/train.json").exists()
    assert_one_error_line(
        moe("train", "--no-mlflow", "--set", "model.vocab_size=100"), 2, "model.vocab_size: 100 is smaller than the tokenizer's vocabulary"
    )
    assert_one_error_line(moe("evaluate", "--no-mlflow"), 4, "no complete checkpoint")
    Path("llama").mkdir()
    Path("llama/config.json").write_text(json.dumps({"model_type": "llama"}))
    assert_one_error_line(moe("convert", "--from-hf", "llama", "--out", "x"), 2, "model_type is 'llama', not 'olmoe'")


def test_params_prints_resolved_values(workspace):
    r = moe("params", "--set", "model.moe.num_experts=8")
    assert r.returncode == 0
    assert "model.moe.num_experts = 8" in r.stdout
    assert "model.d_model = 32" in r.stdout


def test_console_script_is_installed():
    from shutil import which

    exe = which("moe") or str(Path(sys.executable).parent / "moe")
    assert Path(exe).exists()
    assert subprocess.run([exe, "--help"], capture_output=True).returncode == 0


# ------------------------------------------------------------------ moe plan and submit's plan


def test_plan_prints_the_table_and_json(workspace):
    r = moe("plan", "--gpu", "h100", "--set", "train.recompute=selective")
    assert r.returncode == 0, r.stderr
    for text in ("parameters:", "fp32 masters", "AdamW moments", "activations", "FLOPs/token", "verdict: fits"):
        assert text in r.stdout, text
    r = moe("plan", "--gpu", "b200", "--gpus", "2", "--set", "parallel.ep=2", "--json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["fits"] and plan["gpus"] == 2 and plan["layout"]["ep"] == 2 and plan["params_total"] > plan["params_active"]


def test_plan_errors(workspace):
    assert moe("plan", "--help").returncode == 0
    assert_one_error_line(moe("plan", "--gpu", "a100"), 2, "--gpu: unknown GPU 'a100'; known: h100, h200, b200, b300")
    assert_one_error_line(
        moe("plan", "--gpus", "3", "--set", "parallel.pp=2", "--set", "train.eval_every=0"), 2, "parallel.pp: world size 3 is not divisible by pp=2"
    )
    assert_one_error_line(moe("plan", "--set", "train.recompute=most"), 2, "train.recompute")
    assert_one_error_line(moe("plan", "--params", "nope.yaml"), 2, "nope.yaml: params file not found")


def test_plan_checks_an_fp8_recipe_against_the_planned_gpu_not_this_machine(workspace):
    """Issue 26: on a CPU machine the planner checked the recipe against a fake CUDA device (a traceback)."""
    r = moe("plan", "--gpu", "h100", "--set", "precision.recipe=fp8_rowwise")
    assert r.returncode == 0 and "verdict: fits" in r.stdout, r.stderr
    r = moe(
        "submit",
        "--dry-run",
        "--nodes",
        "1",
        "--gpus-per-node",
        "1",
        "--tasks-per-node",
        "1",
        "--partition",
        "gpu",
        "--set",
        "precision.recipe=fp8_rowwise",
    )
    assert r.returncode == 0 and r.stdout.startswith("#!/bin/bash"), r.stderr
    assert_one_error_line(
        moe("plan", "--gpu", "h200", "--set", "precision.recipe=mxfp8"), 2, "mxfp8 needs compute capability >= 10.0, but H200 141GB is sm90"
    )
    assert moe("plan", "--gpu", "b200", "--set", "precision.recipe=mxfp8").returncode == 0


BIG = [
    "--set",
    "model.preset=olmoe-1b-7b",
    "--set",
    "model.n_layers=18",
    "--set",
    "model.vocab_size=50304",
    "--set",
    "model.d_model=2048",
    "--set",
    "model.n_heads=16",
    "--set",
    "model.moe.num_experts=64",
    "--set",
    "model.moe.top_k=8",
    "--set",
    "model.moe.expert_hidden=1024",
    "--set",
    "data.seq_len=4096",
    "--set",
    "train.global_batch_size=4",
    "--set",
    "train.micro_batch_size=4",
    "--gpus-per-node",
    "1",
]


def test_submit_dry_run_shows_the_plan_and_refuses_what_does_not_fit(workspace):
    r = moe("submit", "--dry-run", "--gpu", "h200", *BIG)
    assert r.returncode == 0, r.stderr
    assert "verdict: does not fit" in r.stderr and "train.recompute=selective" in r.stderr
    assert r.stdout.startswith("#!/bin/bash")
    assert_one_error_line(moe("submit", "--no-mlflow", "--gpu", "h200", *BIG), 2, "moe plan: does not fit")
    assert not Path("runs").exists()


def test_version_and_rich_help_with_completion():
    r = moe("--version")
    assert r.returncode == 0 and r.stdout.startswith("moe-pipeline ")
    r = moe("--help")
    assert "--install-completion" in r.stdout and "╭" in r.stdout  # typer's rich panels


def test_help_does_not_import_torch_or_mlflow():
    code = (
        "import sys; sys.argv = ['moe', '--help']\nfrom pipeline.cli import main\ntry:\n    main()\nexcept SystemExit:\n    pass\n"
        "bad = [m for m in ('torch', 'mlflow', 'numpy') if m in sys.modules]\nassert not bad, bad"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr


def test_stage_help_imports_no_stage():
    """`moe <stage> --help` reads the stage's command module only: no stage module, no torch."""
    code = """
import sys
from pipeline.cli import app
from pipeline.stage_commands import STAGE_COMMANDS
for m in STAGE_COMMANDS:
    try:
        app([m.__name__.rpartition('.')[2], '--help'], prog_name='moe')
    except SystemExit:
        pass
bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'mlflow', 'numpy') or m.startswith('pipeline.stages.')]
assert not bad, bad
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "moe release" in r.stdout and "--from-hf" in r.stdout  # every stage's help was shown


def test_without_the_pipeline_extra_the_error_names_it(tmp_path):
    """A Python where typer is missing (`pip install .` without the extra): one line, the extra named."""
    (tmp_path / "typer.py").write_text("raise ImportError('No module named typer')\n")
    r = subprocess.run(
        [sys.executable, "-c", "from pipeline.cli import main"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"},
        timeout=300,
    )
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "moe-pipeline[pipeline]" in r.stderr


def test_numeric_slurm_account_is_accepted(workspace):
    Path("params.yaml").write_text(Path("params.yaml").read_text() + "slurm:\n  account: 12345\n")
    r = moe("params")
    assert r.returncode == 0, r.stderr
    assert 'slurm.account = "12345"' in r.stdout


def test_job_spec_is_written_outside_the_dvc_output(workspace):
    assert moe("tokenize", "--no-mlflow").returncode == 0
    r = moe("job", "--set", "executor.kind=slurm")
    assert r.returncode == 0, r.stderr
    spec = Path(r.stdout.strip())
    assert spec == Path("runs/slurm/job.json") and json.loads(spec.read_text())["run_dir"] == "runs/train"
    assert not Path("runs/train").exists()


def test_ui_leaves_no_server_processes_after_sigterm(tmp_path):
    import signal
    import socket
    import time

    psutil = pytest.importorskip("psutil")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "ui", "--port", str(port)], cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.time() + 120
    children = []
    while time.time() < deadline:
        children = psutil.Process(proc.pid).children(recursive=True)
        with socket.socket() as s:
            if len(children) >= 2 and s.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(1)
    assert children, "the MLflow UI did not start"
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    time.sleep(1)
    alive = [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert not alive, alive


def test_convert_from_hf_refuses_gelu_by_name(tmp_path):
    from moe.config import ModelConfig
    from moe.interop import hf_config

    hf = hf_config(ModelConfig.from_dict({"preset": "tiny"}).validate(), eos_id=0, pad_id=None)
    (tmp_path / "config.json").write_text(json.dumps({**hf, "hidden_act": "gelu"}))
    assert_one_error_line(moe("convert", "--from-hf", str(tmp_path), "--out", str(tmp_path / "ckpt")), 2, "hidden_act='gelu' is not supported")
    assert not (tmp_path / "ckpt").exists()


def test_mlflow_server_without_its_database_is_one_error_in_bounded_time(tmp_path):
    """A backend that refuses connections: one `error:` naming the URI (no password) within
    seconds, and no artifact directory created (issue 36: the server retried for ever)."""
    import socket
    import time

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    uri = f"postgresql+psycopg2://mlflow@127.0.0.1:{port}/mlflow"
    start = time.monotonic()
    r = moe("mlflow-server", "--backend", uri, "--artifacts", str(tmp_path / "art"), env={"MOE_MLFLOW_BACKEND_PASSWORD": "s3 cr/et@x"})
    assert time.monotonic() - start < 60
    assert r.returncode == 2
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"127.0.0.1:{port}/mlflow" in errors[0], r.stderr
    assert "s3 cr/et@x" not in r.stderr + r.stdout and "cr/et" not in r.stderr + r.stdout
    assert not (tmp_path / "art").exists()


# ------------------------------------------------------------------ issue 50: values reaching Slurm


def test_params_job_and_submit_refuse_a_slurm_value_naming_the_key(workspace):
    """Item 3: the config's own check refuses it, so every command that reads params.yaml does,
    before any script is rendered or spec written."""
    for cmd in (["params"], ["job"], ["submit", "--dry-run"]):
        assert_one_error_line(moe(*cmd, "--set", "slurm.mem=-5G"), 2, "--set slurm.mem: '-5G' must be a positive whole number")
    assert_one_error_line(moe("submit", "--dry-run", "--set", "slurm.job_name=ab\u202ecd"), 2, "slurm.job_name: 'ab\\u202ecd' contains U+202E")
    assert not Path("runs").exists()


def test_a_job_id_that_is_no_job_id_is_refused_before_slurm(workspace):
    """Item 4: `moe cancel -- --me` handed --me to scancel (every job of the user). One hostile
    id per command through the CLI; the other shapes are check_job_id's unit tests
    (tests/pipeline/test_slurm_checks.py)."""
    for cmd, job_id in (("cancel", "--me"), ("status", "../../etc/passwd"), ("logs", "123;id")):
        assert_one_error_line(moe(cmd, "--", job_id), 2, f"job id: {job_id!r} is not a Slurm job id")


def test_params_refuses_an_init_from_the_worker_would_refuse(workspace):
    """Item 5: `moe params` checked init_from only in the worker of a started run."""
    assert_one_error_line(
        moe("params", "--set", "checkpoint.init_from=/nonexistent"), 2, "checkpoint.init_from: /nonexistent: no complete checkpoint found"
    )


# ------------------------------------------ issue 50: what the commands read back, through moe.reader


def test_the_converted_config_is_read_quietly_through_the_reader(tmp_path):
    from pipeline.stage_commands.convert import read_json_file_quiet
    from tests.pipeline.fifo import fifo_at, within

    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "olmoe", "hidden_size": 64, "num_experts": 8, "architectures": ["OlmoeForCausalLM"]}))
    assert read_json_file_quiet(path)["hidden_size"] == 64
    for bad in ('{"hidden_size": "64"}', '{"hidden_size": -1}', '{"rope_theta": NaN}', "[1, 2]"):
        path.write_text(bad)
        assert read_json_file_quiet(path) == {}, bad
    fifo = fifo_at(path)
    assert within(lambda: read_json_file_quiet(fifo), fifo) == {}


def test_a_fifo_for_the_token_manifest_is_one_error_at_once(tmp_path):
    from pipeline.errors import PipelineError
    from pipeline.stage_commands.tokenize import log_tokens
    from tests.pipeline.fifo import fifo_at, within

    fifo = fifo_at(tmp_path / "tokens/manifest.json")
    with pytest.raises(PipelineError, match="manifest.json"):
        within(lambda: log_tokens(None, str(tmp_path / "tokens"), "train", "training"), fifo)
    logged = []
    log_tokens(logged, str(tmp_path / "nothing-here"), "train", "training")  # not tokenised yet: nothing to log
    assert logged == []
