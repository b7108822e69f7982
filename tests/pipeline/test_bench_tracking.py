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
