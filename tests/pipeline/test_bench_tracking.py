from pathlib import Path

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
