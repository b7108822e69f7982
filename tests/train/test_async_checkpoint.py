"""Asynchronous checkpoints: training goes on while a save is written, a kill during the write
loses only the steps since the last complete checkpoint and the resumed run is bitwise the
uninterrupted one, and the time a save holds the loop is kept out of the throughput."""

import threading
import time

import pytest
import torch

import moe.train.checkpoint as ck
from moe.train.checkpoint import CheckpointError, CheckpointManager, latest_checkpoint
from moe.train.trainer import Trainer
from tests.helpers import tiny_config
from tests.train.test_checkpoint import run_script


def test_a_background_save_holds_the_state_of_its_step_while_the_caller_changes_it(tmp_path):
    mgr = CheckpointManager(tmp_path, asynchronous=True)
    live = {"w": torch.full((4,), 1.0), "nested": {"v": torch.arange(3.0)}}
    path = mgr.save_async(1, live, {"note": 1}, {"rng": torch.tensor([7])})
    live["w"].fill_(99.0)  # the next step's update, made before the write has finished
    live["nested"]["v"].zero_()
    mgr.wait()
    assert latest_checkpoint(tmp_path) == path
    target = {"w": torch.zeros(4), "nested": {"v": torch.zeros(3)}}
    meta, rng = CheckpointManager.load(path, target)
    assert target["w"].tolist() == [1.0] * 4 and target["nested"]["v"].tolist() == [0.0, 1.0, 2.0]
    assert meta["note"] == 1 and rng["rng"].tolist() == [7]


def test_a_background_save_that_fails_says_so_at_the_next_wait_and_leaves_the_previous_latest(tmp_path, monkeypatch):
    mgr = CheckpointManager(tmp_path, asynchronous=True)
    mgr.save_async(1, {"w": torch.ones(2)}, {}, {})
    mgr.wait()
    real = ck.dcp.save

    def broken(state, **kw):
        real(state, **kw)
        raise OSError("disk full")

    monkeypatch.setattr(ck.dcp, "save", broken)
    mgr.save_async(2, {"w": torch.ones(2)}, {}, {})
    with pytest.raises(CheckpointError, match="cannot write checkpoint step 2 .disk full"):
        mgr.wait()
    assert latest_checkpoint(tmp_path).name == "step_00000001"
    assert not (tmp_path / ".tmp-step_00000002").exists()
    mgr.wait()  # reported once


# The save of step 6 is written in the background; the loop trains on to step 8 while it is, and
# the process is killed inside the write: step 3 is the latest complete checkpoint.
KILLED_DURING_WRITE = """
import json, os, sys, threading
import moe.train.checkpoint as ck
from moe.config import ExperimentConfig
from moe.train.callbacks import Callback
from moe.train.trainer import Trainer
reached_8 = threading.Event()
calls = {"n": 0}
real = ck.dcp.save
def slow_then_killed(state, **kw):
    calls["n"] += 1
    real(state, **kw)
    if calls["n"] == 2:
        if not reached_8.wait(60):
            os._exit(7)  # the loop did not go on while the save was written
        os._exit(9)
ck.dcp.save = slow_then_killed
class Watch(Callback):
    def on_step_end(self, trainer, step, last):
        if step == 8:
            reached_8.set()
cfg = ExperimentConfig.load(json.load(open(sys.argv[1])))
Trainer(cfg, callbacks=[Watch()]).fit()
"""


def test_a_kill_during_a_background_write_resumes_bitwise_from_the_last_complete_checkpoint(tmp_path, corpus):
    reference = Trainer(tiny_config(corpus, tmp_path / "ref", train={"max_steps": 9}, checkpoint={"save": False})).fit()
    cfg = tiny_config(corpus, tmp_path / "run", train={"max_steps": 9}, checkpoint={"every": 3})
    assert cfg.checkpoint.asynchronous
    proc = run_script(KILLED_DURING_WRITE, cfg, tmp_path, {})
    assert proc.returncode == 9, proc.stderr  # 7: training waited for the write
    assert latest_checkpoint(tmp_path / "run").name == "step_00000003"

    trainer = Trainer(cfg)
    resumed = trainer.fit()
    assert resumed.start_step == 3
    assert latest_checkpoint(tmp_path / "run").name == "step_00000009"
    assert {s: resumed.losses[s] for s in range(4, 10)} == {s: reference.losses[s] for s in range(4, 10)}


def _record_logs(trainer: Trainer) -> dict[int, dict[str, float]]:
    """Every log point's metrics, by step (the trainer's sinks replaced by a recorder)."""
    logged: dict[int, dict[str, float]] = {}

    class Recorder:
        def log(self, step, metrics):
            logged[step] = dict(metrics)

        def close(self, summary):
            pass

    trainer.sinks = [Recorder()]
    return logged


def test_the_time_a_save_holds_the_loop_is_its_own_metric_and_not_training_time(tmp_path, corpus, monkeypatch):
    real = ck.dcp.save

    def slow(state, **kw):
        time.sleep(1.5)
        real(state, **kw)

    monkeypatch.setattr(ck.dcp, "save", slow)
    cfg = tiny_config(corpus, tmp_path / "run", train={"max_steps": 4, "log_every": 2}, checkpoint={"every": 2, "asynchronous": False})
    trainer = Trainer(cfg)
    logged = _record_logs(trainer)
    trainer.fit()
    after_save = logged[4]
    assert after_save["checkpoint/blocked_s"] >= 1.5
    assert after_save["step_time_s"] < after_save["checkpoint/blocked_s"] / 2


def test_background_saves_overlap_the_steps_that_follow(tmp_path, corpus, monkeypatch):
    """The loop's wait for an asynchronous save is the staging copy, not the write."""
    real = ck.dcp.save
    writing = threading.Event()

    def slow(state, **kw):
        writing.set()
        time.sleep(1.5)
        real(state, **kw)

    monkeypatch.setattr(ck.dcp, "save", slow)
    cfg = tiny_config(corpus, tmp_path / "run", train={"max_steps": 4, "log_every": 2}, checkpoint={"every": 2})
    trainer = Trainer(cfg)
    logged = _record_logs(trainer)
    summary = trainer.fit()
    assert writing.is_set()
    assert logged[4]["checkpoint/blocked_s"] < 1.0  # staged at step 2, written while steps 3-4 ran
    assert latest_checkpoint(tmp_path / "run").name == "step_00000004" == summary.checkpoint.rsplit("/", 1)[-1]


def test_the_buffers_allocated_ahead_are_the_ones_a_save_fills(tmp_path):
    """prepare() allocates (on a GPU machine, pinned and in the background) exactly the host
    buffers the first save copies into, under the same keys, shapes and dtypes."""
    live = {"model": {"w": torch.ones(4, 2), "b": torch.zeros(3, dtype=torch.bfloat16)}, "optim": {"w": {"step": torch.tensor(1.0)}}}
    specs = ck._buffer_specs(live)
    mgr = CheckpointManager(tmp_path, asynchronous=True)
    mgr.save_async(1, live, {}, {})
    mgr.wait()
    assert {k: (tuple(b.shape), b.dtype) for k, b in mgr._staging.items()} == {k: (tuple(s), d) for k, (s, d, _) in specs.items()}
