"""bench.parity end to end on CPU: two short runs (bf16, emulated FP8) on a tokenised corpus,
then the report (curve comparison, PNG, both curves in a real MLflow store)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.parity import compare

ROOT = Path(__file__).resolve().parents[2]


def test_compare_final_loss_and_gap():
    a = [(s, 2.0) for s in range(1, 11)]
    b = [(s, 2.0 + (0.03 if s == 3 else 0.01)) for s in range(1, 11)]
    r = compare(a, b, tail=5)
    assert r["final_rel_diff"] == pytest.approx(0.005)
    assert r["within_1pct"] and r["max_rel_gap"] == pytest.approx(0.015)


@pytest.mark.slow
def test_parity_runs_and_reports(tmp_path):
    def py(*args: str, cwd: Path = ROOT) -> str:
        out = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout

    tok = tmp_path / "tokens"
    py(
        "-m",
        "pipeline.cli",
        "paper",
        "tokenize",
        "--set",
        f"tokenize.output={tok}",
        "--set",
        "tokenize.max_bytes=200000",
        cwd=ROOT / "bench" / "paper",
    )
    small = ["--data", str(tok), "--preset", "tiny", "--layers", "0", "--seq", "32", "--micro", "2", "--steps", "12"]
    py("-m", "bench.parity", "run", "--recipe", "bf16", "--out", str(tmp_path / "a"), *small)
    py("-m", "bench.parity", "run", "--recipe", "fp8_rowwise", "--emulate", "--out", str(tmp_path / "b"), *small)
    db = tmp_path / "ml.db"
    out = py(
        "-m",
        "bench.parity",
        "report",
        str(tmp_path / "a"),
        str(tmp_path / "b"),
        "--results-dir",
        str(tmp_path / "res"),
        "--tail",
        "4",
        "--plot",
        str(tmp_path / "p.png"),
    )
    assert "relative difference" in out and (tmp_path / "p.png").stat().st_size > 0
    result = next((tmp_path / "res").glob("parity-*.json"))
    logged = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "bench", "log", str(result)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{db}", "PYTHONPATH": str(ROOT)},
    )
    assert logged.returncode == 0, logged.stderr[-3000:]
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{db}")
    exp = client.get_experiment_by_name("fp8-loss-parity")
    runs = client.search_runs([exp.experiment_id])
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") and "recipe" in r.data.tags]
    assert sorted(r.data.tags["recipe"] for r in children) == ["bf16", "fp8_rowwise"]
    assert all(len(client.get_metric_history(r.info.run_id, "loss")) == 12 for r in children)


def test_run_refuses_missing_corpus(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "bench.parity", "run", "--recipe", "bf16", "--data", str(tmp_path), "--out", str(tmp_path / "o")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "manifest.json: not found" in out.stderr
