import re
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

REPO = Path(__file__).resolve().parents[2]


def test_bench_results_are_logged_to_mlflow(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    from pipeline.bench_tracking import log_result

    layer = REPO / "bench/results/layer-NVIDIA-H200-20261129T160033Z.json"  # a run with the TorchTitan peer
    run_id, created = log_result(layer)
    assert created
    assert log_result(layer) == (run_id, False)  # the same file again: no second run
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.get_run(run_id)
    assert run.data.tags["bench.device"] == "NVIDIA H200"
    assert run.data.tags["bench.git_commit"]
    keys = set(run.data.metrics)
    assert "d_2048/h_1024/E_64/k_8/ours/tflops" in keys
    assert "d_2048/h_1024/E_64/k_8/titan/tflops" in keys
    assert run.data.params["tokens"] == "16384"
    client_runs = client.search_runs([run.info.experiment_id], filter_string="tags.`moe.stage` != 'pipeline'")
    assert len(client_runs) == 1


def test_an_older_files_gib_figures_are_logged_by_their_names_now():
    """Issue 49: memory figures are GiB and named *_gib; a file from before names them *_gb."""
    from pipeline.bench_tracking import result_metrics

    old = result_metrics({"result": {"layers": 4, "peak_mem_gb": 88.25, "symmetric_gb": 1.5, "tokens_per_s": 9.0}})
    new = result_metrics({"result": {"layers": 4, "peak_mem_gib": 88.25, "symmetric_gib": 1.5, "tokens_per_s": 9.0}})
    assert old == new == {"4/layers": 4.0, "4/peak_mem_gib": 88.25, "4/symmetric_gib": 1.5, "4/tokens_per_s": 9.0}


# --------------------------------------------------------------- issue 50: `moe bench log` refusals


def _bench_log(tmp_path, monkeypatch, payloads: dict[str, str], env: dict[str, str] | None = None):
    """`moe bench log` of the named files (written from ``payloads``) in tmp_path, its own store."""
    from typer.testing import CliRunner

    from pipeline.cli import app

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    for name, text in payloads.items():
        (tmp_path / name).write_text(text)
    return CliRunner().invoke(app, ["bench", "log", *payloads])


def _bench_runs(tmp_path) -> int:
    if not (tmp_path / "mlflow.db").exists():
        return 0
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("bench")
    return len(client.search_runs([exp.experiment_id])) if exp else 0


@pytest.mark.parametrize(
    ("payload", "named"),
    [
        ('{"result": {"layers": 4, "bad key!": 1.0}}', "result.json: result.bad key! names the metric '4/bad key!', which holds a character"),
        ('{"result": {"layers": 4, "tflops": 1.0}, "config": {"a//b": 1}}', "result.json: config.a//b names a param that reads as another name"),
        ('{"result": {"layers": 4}, "environment": {"dev ice?": "x"}}', "result.json: environment.dev ice? names a tag that holds a character"),
        ("{}", "result.json: the file holds no number to log (no result or results rows"),
        (
            '{"result": {"note": "fast", "recipe": "bf16"}}',
            "result.json: the file holds no number to log (its rows hold no number: result.note, result.recipe",
        ),
        ('{"result": {"layers": 4, "tflops": "12.5"}}', "result.json: result.tflops is '12.5', a number written as text"),
        ('{"results": [{"shape": "a", "tflops": 1.0}, {"shape": "b", "tflops": "n/a"}]}', "result.json: results[1].tflops is 'n/a', not a number"),
        ('{"result": {"layers": 4, "tflops": NaN}}', "result.json: the file is not JSON (NaN is not a number JSON allows)"),
        ('{"result": {"layers": 4}, "matmul_peak_tflops": "990"}', "result.json: matmul_peak_tflops is '990', a number written as text"),
    ],
    ids=["metric-name", "param-name", "tag-name", "empty", "only-text", "number-as-text", "text-in-a-number-column", "nan", "peak-as-text"],
)
def test_a_result_mlflow_would_refuse_or_without_metrics_is_an_error_and_makes_no_run(tmp_path, monkeypatch, payload, named):
    r = _bench_log(tmp_path, monkeypatch, {"result.json": payload})
    lines = r.output.strip().splitlines()
    assert r.exit_code == 2 and lines[-1].startswith(f"error: {named}"), r.output
    assert "unreachable" not in r.output and "Traceback" not in r.output
    assert _bench_runs(tmp_path) == 0


def test_every_file_is_checked_before_the_first_is_logged(tmp_path, monkeypatch):
    good = '{"result": {"layers": 4, "tflops": 1.0}}'
    r = _bench_log(tmp_path, monkeypatch, {"a.json": good, "b.json": '{"result": {"layers": 4, "tflops": "12"}}'})
    assert r.exit_code == 2 and r.output.strip().splitlines()[-1].startswith("error: b.json: result.tflops is '12'"), r.output
    assert _bench_runs(tmp_path) == 0


def test_an_unreachable_server_spools_the_run_with_a_warning_and_no_traceback(tmp_path, monkeypatch):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{port}/?private_token=s3cret", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}
    r = _bench_log(tmp_path, monkeypatch, {"result.json": '{"result": {"layers": 4, "tflops": 1.0}}'}, env)
    assert r.exit_code == 0 and r.exception is None, r.output
    assert "result.json -> spooled to mlflow-fallback.jsonl (MLflow unreachable)" in r.output
    assert "Traceback" not in r.output and "s3cret" not in r.output
    spooled = (tmp_path / "mlflow-fallback.jsonl").read_text()
    assert '"4/tflops": 1.0' in spooled and "s3cret" not in spooled


# --------------------------------------------------------------- issue 50: read through moe.reader


@pytest.mark.parametrize(
    ("payload", "named"),
    [
        ('{"result": {"layers": 4, "tflops": 1.0}, "environment": ["cpu"]}', "environment: expected a mapping, got ['cpu']"),
        ('{"curves": {"bf16": [[1, 2.5], [2]]}}', "curves.bf16[1]: expected a list of 2 to 2 items, got '1 items'"),
        ('{"result": {"layers": 4, "tflops": 1.0}, "artifacts": [7]}', "artifacts[0]: expected a string, got 7"),
        ('{"result": {"layers": 4, "tflops": 1.0}, "mlflow": {"experiment": "  "}}', "mlflow.experiment: expected a name"),
    ],
    ids=["environment-a-list", "curve-point-of-one", "artifact-a-number", "experiment-blank"],
)
def test_a_result_file_not_as_the_benchmarks_write_it_is_one_error(tmp_path, payload, named):
    from pipeline.bench_tracking import load_result
    from pipeline.errors import PipelineError

    (tmp_path / "result.json").write_text(payload)
    with pytest.raises(PipelineError, match="^" + re.escape(f"{tmp_path / 'result.json'}: {named}")) as raised:
        load_result(tmp_path / "result.json")
    assert str(raised.value).endswith("(not a bench/results JSON file)")


def test_a_fifo_in_place_of_a_result_file_is_one_error_at_once(tmp_path):
    from pipeline.bench_tracking import load_result
    from pipeline.errors import PipelineError
    from tests.pipeline.fifo import fifo_at, within

    fifo = fifo_at(tmp_path / "result.json")
    with pytest.raises(PipelineError, match=r"result.json: not a regular file \(not a bench/results JSON file\)"):
        within(lambda: load_result(fifo), fifo)


def test_the_digest_is_of_the_bytes_read(tmp_path):
    import hashlib

    from pipeline.bench_tracking import load_result

    raw = '{"result": {"layers": 4, "tflops": 1.0, "note": "süß ✓"}}\n'.encode()
    (tmp_path / "result.json").write_bytes(raw)
    data, payload = load_result(tmp_path / "result.json")
    assert data == raw and hashlib.sha256(data).hexdigest() == hashlib.sha256(raw).hexdigest() and payload["result"]["note"] == "süß ✓"
