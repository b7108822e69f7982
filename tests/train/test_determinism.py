"""The deterministic mode's plumbing on CPU: settings, checks, checkpoint record, resume check,
errors. (Bitwise equality on the GPU is bench/determinism.py's job.)"""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe.config import ConfigError
from moe.layers.dispatch import LocalDispatcher
from moe.layers.router import count_per_expert
from moe.train import determinism
from moe.train.determinism import DeterminismError
from moe.train.trainer import Trainer
from tests.helpers import tiny_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def restore_process_state():
    """The mode is process-wide: put torch's flags and the environment back after each test."""
    env = {k: os.environ.get(k) for k in determinism.ENVIRONMENT}
    flags = (
        torch.are_deterministic_algorithms_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        torch.backends.cuda.cudnn_sdp_enabled(),
    )
    yield
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    torch.use_deterministic_algorithms(flags[0])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = flags[1], flags[2]
    torch.backends.cuda.enable_cudnn_sdp(flags[3])


def det_config(corpus, ck, on=True, **sections):
    train = {"deterministic": on, **sections.pop("train", {})}
    return tiny_config(corpus, ck, train=train, **sections)


def test_default_is_off_and_the_key_is_typed(corpus, tmp_path):
    assert tiny_config(corpus, tmp_path).train.deterministic is False
    with pytest.raises(ConfigError, match="train.deterministic"):
        det_config(corpus, tmp_path, on="yes please")


def test_off_changes_nothing():
    before = torch.are_deterministic_algorithms_enabled()
    mode = determinism.configure(False)
    assert mode == determinism.Determinism(False)
    assert torch.are_deterministic_algorithms_enabled() == before
    assert mode.tags() == {"determinism.enabled": "false"}


def test_on_sets_and_records_every_setting(monkeypatch):
    for k in determinism.ENVIRONMENT:
        monkeypatch.delenv(k, raising=False)
    mode = determinism.configure(True)
    assert torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert os.environ["NCCL_ALGO"] == "Ring" and os.environ["NCCL_PROTO"] == "Simple"
    tags = mode.tags()
    assert tags["determinism.enabled"] == "true"
    for key in (
        "env.CUBLAS_WORKSPACE_CONFIG",
        "env.NCCL_ALGO",
        "env.NCCL_PROTO",
        "torch.use_deterministic_algorithms",
        "torch.backends.cudnn.deterministic",
        "torch.backends.cudnn.benchmark",
        "sdpa.cudnn",
        "router.counts",
    ):
        assert f"determinism.{key}" in tags, key


def test_accepted_preset_values_are_kept_and_others_refused(monkeypatch):
    env = {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}
    assert determinism.set_environment(env)["env.CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    with pytest.raises(DeterminismError, match=r"NCCL_ALGO='Tree'") as info:
        determinism.set_environment({"NCCL_ALGO": "Tree"})
    assert "\n" not in str(info.value)


def test_fixed_order_counts_equal_scatter_counts():
    flat = torch.randint(0, 16, (1000,))
    fixed = count_per_expert(flat, 16, fixed_order=True)
    assert fixed.dtype == torch.int64 and torch.equal(fixed, count_per_expert(flat, 16))
    assert torch.equal(count_per_expert(flat[:0], 16, fixed_order=True), torch.zeros(16, dtype=torch.int64))


class AtomicDispatcher(LocalDispatcher):
    """A dispatcher variant that does not promise fixed-order arithmetic."""

    deterministic = False


def test_a_seam_without_a_deterministic_variant_fails_naming_it(corpus, tmp_path):
    trainer = Trainer(det_config(corpus, tmp_path / "ck", on=False))
    layer = next(m for _, m in trainer.model.moe_layers())
    layer.dispatcher = AtomicDispatcher()
    with pytest.raises(DeterminismError, match=r"layers\.\d+\.mlp\.dispatcher \(AtomicDispatcher\) has no deterministic variant"):
        determinism.prepare_model(trainer.model, trainer.recipe, determinism.configure(True))


def test_two_runs_are_identical_and_the_checkpoint_records_the_mode(corpus, tmp_path):
    a = Trainer(det_config(corpus, tmp_path / "a")).fit()
    b = Trainer(det_config(corpus, tmp_path / "b")).fit()
    assert a.losses == b.losses
    meta = json.loads((Path(a.checkpoint) / "meta.json").read_text())
    assert meta["determinism"]["enabled"] is True
    assert meta["determinism"]["settings"]["env.NCCL_ALGO"] == "Ring"
    trainer = Trainer(det_config(corpus, tmp_path / "c"))
    assert all(m.router.deterministic for _, m in trainer.model.moe_layers())


def test_resume_under_the_same_mode_is_exact_and_silent(corpus, tmp_path, caplog):
    full = Trainer(det_config(corpus, tmp_path / "a", train={"max_steps": 6})).fit()
    Trainer(det_config(corpus, tmp_path / "b", train={"max_steps": 6})).fit(stop_at=3)
    with caplog.at_level(logging.WARNING, logger="moe.train"):
        resumed = Trainer(det_config(corpus, tmp_path / "b", train={"max_steps": 6})).fit()
    assert resumed.start_step == 3
    assert [resumed.losses[s] for s in (4, 5, 6)] == [full.losses[s] for s in (4, 5, 6)]
    assert "deterministic" not in caplog.text


@pytest.mark.slow  # MLflow's sqlite store set-up
def test_mode_settings_and_a_mode_change_on_resume_reach_mlflow(corpus, tmp_path, caplog):
    from mlflow.tracking import MlflowClient

    from pipeline.tracking.job import MlflowSink

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment("det", artifact_location=(tmp_path / "art").as_uri())
    first, second = (client.create_run(exp).info.run_id for _ in range(2))

    Trainer(det_config(corpus, tmp_path / "ck", on=True, train={"max_steps": 6}), sinks=[MlflowSink(uri, first, tmp_path / "f1.jsonl")]).fit(
        stop_at=3
    )
    tags = client.get_run(first).data.tags
    assert tags["determinism.enabled"] == "true"
    assert tags["determinism.env.CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert tags["determinism.torch.use_deterministic_algorithms"] == "true"
    assert tags["determinism.sdpa.cudnn"] == "false"

    with caplog.at_level(logging.WARNING, logger="moe.train"):
        resumed = Trainer(
            det_config(corpus, tmp_path / "ck", on=False, train={"max_steps": 6}), sinks=[MlflowSink(uri, second, tmp_path / "f2.jsonl")]
        ).fit()
    assert resumed.start_step == 3
    assert "written with train.deterministic=true, resumed with false" in caplog.text
    tags = client.get_run(second).data.tags
    assert tags["determinism.enabled"] == "false"
    assert "resumed with false" in tags["determinism.resume_mismatch"]


def test_resume_mismatch_names_a_changed_setting_and_reads_old_checkpoints():
    on = determinism.Determinism(True, {"env.NCCL_ALGO": "Ring"})
    assert determinism.resume_mismatch(on.to_meta(), on, "ck") is None
    assert "written with train.deterministic=false" in determinism.resume_mismatch(None, on, "ck")
    other = determinism.Determinism(True, {"env.NCCL_ALGO": "Ring", "env.CUBLAS_WORKSPACE_CONFIG": ":16:8"})
    assert "env.CUBLAS_WORKSPACE_CONFIG=None there, ':16:8' here" in determinism.resume_mismatch(on.to_meta(), other, "ck")


def test_entry_point_refuses_a_conflicting_environment_in_one_line(corpus, tmp_path):
    cfg = det_config(corpus, tmp_path / "ck")
    run = tmp_path / "run.json"
    run.write_text(json.dumps(cfg.to_dict()))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NCCL_ALGO": "Tree"}
    proc = subprocess.run([sys.executable, "-m", "moe.train", str(run)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: train.deterministic: the environment sets NCCL_ALGO='Tree'; the deterministic mode "
        "needs 'Ring' (unset it or set train.deterministic=false)"
    ]
    assert not (tmp_path / "ck").exists()


def _ep_twice(rank, world, corpus, root):
    from moe.parallel.expert_parallel import AllToAllDispatcher

    losses = []
    for run in ("a", "b"):
        trainer = Trainer(det_config(Path(corpus), Path(root) / run, train={"max_steps": 3}, parallel={"ep": 2}))
        assert all(isinstance(m.dispatcher, AllToAllDispatcher) for _, m in trainer.model.moe_layers())
        losses.append(trainer.fit().losses)
    return {"losses": losses, "tags": trainer.determinism.tags()}


def test_expert_parallel_on_two_gloo_ranks_runs_in_the_mode(corpus, tmp_path):
    from tests.parallel.dist_utils import run_ranks

    results = run_ranks(_ep_twice, 2, str(corpus), str(tmp_path))
    for r in results:
        assert r["losses"][0] == r["losses"][1]
        assert r["tags"]["determinism.env.NCCL_ALGO"] == "Ring"
    assert results[0]["losses"][0] == results[1]["losses"][0]
