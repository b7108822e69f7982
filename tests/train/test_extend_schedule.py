"""Extending a finished run (train.max_steps raised): the first step after the checkpoint uses
the lr the extension note announces, from the new schedule (issue 37: the note said one lr and
the step used the old schedule's); a plain resume keeps its lr bitwise."""

import pytest

from moe.optim import lr_lambda
from moe.train.trainer import Trainer
from tests.helpers import tiny_config


@pytest.mark.parametrize("decay", ["cosine", "linear"])
def test_the_extended_runs_next_lr_is_the_one_the_note_announces(tmp_path, corpus, decay):
    from pipeline.resume import extension_note

    first = tiny_config(corpus, tmp_path / "ck", train={"max_steps": 4}, schedule={"warmup_steps": 2, "decay": decay})
    a = Trainer(first)
    a.fit()
    saved_lr = a.opt.inner.param_groups[0]["lr"]

    longer = tiny_config(corpus, tmp_path / "ck", train={"max_steps": 10}, schedule={"warmup_steps": 2, "decay": decay})
    b = Trainer(longer)
    b.load_checkpoint(a.last_checkpoint)
    expected = longer.optim.lr * lr_lambda(longer.schedule, 10)(4)
    assert b.opt.inner.param_groups[0]["lr"] == pytest.approx(expected, rel=1e-12)
    note = extension_note(first.to_dict(), longer.to_dict(), 4)
    assert f"lr {expected:.3g} at step 5" in note
    assert expected != pytest.approx(saved_lr)  # (the case is one where the two schedules differ)
    b.fit()
    assert b.last_metrics and b.step == 10

    same = Trainer(first)  # a plain resume: the lr it saved, bitwise
    same.load_checkpoint(a.last_checkpoint)
    assert same.opt.inner.param_groups[0]["lr"] == saved_lr
