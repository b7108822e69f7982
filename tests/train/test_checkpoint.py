import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from moe.train.checkpoint import CheckpointError, CheckpointManager, latest_checkpoint, list_checkpoints
from moe.train.trainer import Trainer
from tests.helpers import tiny_config

REPO = Path(__file__).resolve().parents[2]


def save(mgr, step, value):
    t = {"w": torch.full((3,), float(value))}
    return mgr.save(step, t, {"note": value}, {"rng": step})


def test_save_load_latest_and_prune(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2)
    for step in (1, 2, 3):
        save(mgr, step, step)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000002", "step_00000003"]
    assert latest_checkpoint(tmp_path).name == "step_00000003"
    target = {"w": torch.zeros(3)}
    meta, rng = CheckpointManager.load(tmp_path, target)
    assert meta["step"] == 3 and meta["note"] == 3 and rng == {"rng": 3}
    assert target["w"].tolist() == [3.0, 3.0, 3.0]


def test_failed_save_leaves_previous_latest(tmp_path, monkeypatch):
    mgr = CheckpointManager(tmp_path)
    save(mgr, 1, 1)
    import moe.train.checkpoint as ck

    real = ck.dcp.save

    def broken(state, **kw):
        real(state, **kw)
        raise OSError("disk full")

    monkeypatch.setattr(ck.dcp, "save", broken)
    with pytest.raises(CheckpointError, match="cannot write checkpoint step 2 .disk full"):
        save(mgr, 2, 2)
    assert latest_checkpoint(tmp_path).name == "step_00000001"
    assert not (tmp_path / ".tmp-step_00000002").exists()  # a failed save removes its temporary directory
    (tmp_path / ".tmp-step_00000003").mkdir()  # what a killed save leaves
    mgr.clean_stale()
    assert not (tmp_path / ".tmp-step_00000003").exists()


def test_wrong_shapes_give_a_clear_error(tmp_path):
    save(CheckpointManager(tmp_path), 1, 1)
    with pytest.raises(CheckpointError, match="cannot load into this model"):
        CheckpointManager.load(tmp_path, {"w": torch.zeros(5)})
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        CheckpointManager.load(tmp_path / "nothing", {"w": torch.zeros(3)})


CRASH_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import moe.train.checkpoint as ck
    from moe.config import ExperimentConfig
    from moe.train.trainer import Trainer
    calls = {"n": 0}
    real = ck.dcp.save
    def dying_save(state, **kw):
        calls["n"] += 1
        real(state, **kw)
        if calls["n"] == int(os.environ["DIE_AT_SAVE"]):
            os._exit(9)  # the process dies after writing shards, before the rename
    ck.dcp.save = dying_save
    cfg = ExperimentConfig.load(json.load(open(sys.argv[1])))
    Trainer(cfg).fit()
    """
)


def run_script(script, cfg, tmp_path, env_extra):
    (tmp_path / "cfg.json").write_text(json.dumps(cfg.to_dict()))
    (tmp_path / "script.py").write_text(script)
    env = {**os.environ, "PYTHONPATH": str(REPO), **env_extra}
    return subprocess.run(
        [sys.executable, str(tmp_path / "script.py"), str(tmp_path / "cfg.json")], env=env, capture_output=True, text=True, timeout=300
    )


def test_process_dying_mid_save_keeps_previous_checkpoint_and_resumes_exactly(tmp_path, corpus):
    reference = Trainer(tiny_config(corpus, tmp_path / "ref", train={"max_steps": 6})).fit()

    cfg = tiny_config(corpus, tmp_path / "run", train={"max_steps": 6}, checkpoint={"every": 2})
    proc = run_script(CRASH_SCRIPT, cfg, tmp_path, {"DIE_AT_SAVE": "2"})
    assert proc.returncode == 9, proc.stderr
    assert latest_checkpoint(tmp_path / "run").name == "step_00000002"
    assert (tmp_path / "run" / ".tmp-step_00000004").exists()

    resumed = Trainer(cfg).fit()
    assert resumed.start_step == 2
    assert not (tmp_path / "run" / ".tmp-step_00000004").exists()
    for step in range(3, 7):
        assert resumed.losses[step] == reference.losses[step], step


def test_sigkill_loses_at_most_the_steps_since_the_last_checkpoint(tmp_path, corpus):
    reference = Trainer(tiny_config(corpus, tmp_path / "ref", train={"max_steps": 40})).fit()
    cfg = tiny_config(corpus, tmp_path / "run", train={"max_steps": 40}, checkpoint={"every": 1, "keep_last": 2})
    (tmp_path / "cfg.json").write_text(json.dumps(cfg.to_dict()))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "moe.train", str(tmp_path / "cfg.json")], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.time() + 120
    while time.time() < deadline and len(list_checkpoints(tmp_path / "run")) < 2 and proc.poll() is None:
        time.sleep(0.05)
    time.sleep(0.3)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    latest = latest_checkpoint(tmp_path / "run")
    assert latest is not None
    resumed = Trainer(cfg).fit()
    assert resumed.start_step >= 2
    assert resumed.losses[40] == reference.losses[40]
