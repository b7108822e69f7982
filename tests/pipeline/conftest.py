import json
import os
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]

TINY_PARAMS = {
    "tokenize": {"inputs": ["corpus"], "vocab_size": 300, "max_bytes": None, "workers": 1, "val_fraction": 0.2},
    "model": {"preset": "tiny", "vocab_size": 320, "d_model": 32, "n_heads": 2, "moe": {"num_experts": 4, "top_k": 2, "expert_hidden": 16}},
    "optim": {"lr": 0.003},
    "schedule": {"warmup_steps": 2},
    "data": {"seq_len": 32},
    "train": {"global_batch_size": 4, "micro_batch_size": 2, "max_steps": 8, "log_every": 4},
    "checkpoint": {"dir": "runs/train/checkpoints", "every": 4},
    "executor": {"run_dir": "runs/train"},
    "evaluate": {"batch_size": 2, "max_batches": 2, "generate_tokens": 6},
}


def write_corpus(directory: Path, docs: int = 60) -> None:
    """A small jsonl corpus of pseudo-English."""
    import random

    rnd = random.Random(0)
    words = ["the", "expert", "router", "sends", "each", "token", "to", "a", "few", "experts", "and", "the", "layer", "adds", "their",
             "outputs", "weighted", "by", "the", "scores"]
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "docs.jsonl", "w") as f:
        for _ in range(docs):
            text = " ".join(rnd.choice(words) for _ in range(rnd.randint(40, 120)))
            f.write(json.dumps({"text": text.capitalize() + "."}) + "\n")


@pytest.fixture
def workspace(tmp_path, monkeypatch):
    """A pipeline working directory with a tiny corpus and params.yaml; cwd is set to it."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MOE_PIPELINE_KEY", raising=False)
    monkeypatch.setenv("PYTHONPATH", str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    write_corpus(tmp_path / "corpus")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(TINY_PARAMS, sort_keys=False))
    return tmp_path


def load(overrides=()):
    from pipeline.params import load_params

    return load_params(Path("params.yaml"), list(overrides))


@pytest.fixture(scope="session")
def trained_dir(tmp_path_factory):
    """A workspace where tokenize and train (8 steps, MLflow on) have run once."""
    from pipeline.stages.tokenize import run_tokenize
    from pipeline.stages.train import run_train
    from pipeline.tracking import Tracker

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
