"""The trainer's callbacks: the profiled step first, the caller's, the monitors, and the checkpoint
cadence last; the cadence saves after every ``checkpoint.every`` steps and the last."""

from types import SimpleNamespace

from moe.train.callbacks import (
    Callback,
    CheckpointCallback,
    LoadAlarmCallback,
    RouterHealthCallback,
    StepProfileCallback,
    trainer_callbacks,
)
from tests.helpers import tiny_config


def test_the_order_their_hooks_run_in(tmp_path):
    mine = Callback()
    cfg = tiny_config(tmp_path, tmp_path / "ck", train={"profile_step": 3})
    kinds = [type(cb) for cb in trainer_callbacks(cfg, [mine])]
    assert kinds[0] is StepProfileCallback and kinds[1] is Callback and kinds[-1] is CheckpointCallback
    assert {LoadAlarmCallback, RouterHealthCallback} <= set(kinds)
    off = tiny_config(tmp_path, tmp_path / "ck", checkpoint={"save": False})
    assert not {StepProfileCallback, CheckpointCallback} & {type(cb) for cb in trainer_callbacks(off)}


def test_the_cadence_saves_every_n_steps_and_the_last():
    saved = []
    trainer = SimpleNamespace(checkpoint=lambda: saved.append(step))
    for every, end, expected in [(3, 8, [3, 6, 8]), (0, 5, [5]), (2, 4, [2, 4])]:
        saved.clear()
        cadence = CheckpointCallback(every)
        for step in range(1, end + 1):
            cadence.on_step_end(trainer, step, step == end)
        assert saved == expected, every


def test_only_the_profiled_step_is_untimed_and_due():
    cb = StepProfileCallback(4)
    assert [s for s in range(1, 8) if cb.untimed(s)] == [4]
    assert not cb.due(4)  # nothing started: nothing to stop
    assert cb.after_step(None, 4) is None
