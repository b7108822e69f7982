"""Which checkpoints a rerun of the train stage resumes (pipeline/resume.py)."""

import shutil
from pathlib import Path

import pytest

from moe.train.checkpoint import latest_checkpoint, read_meta
from pipeline.errors import PipelineError
from pipeline.resume import differing_keys, prepare_checkpoints


def _config(trained_dir, tmp_path):
    root = tmp_path / "ck"
    shutil.copytree(trained_dir / "runs/train/checkpoints", root)
    config = read_meta(latest_checkpoint(root))["config"]
    config["checkpoint"]["dir"] = str(root)
    return root, config


def _with(config, section, key, value):
    return {**config, section: {**config[section], key: value}}


def test_key_ignores_layout_and_cadence_but_not_what_is_computed(trained_dir, tmp_path):
    _, config = _config(trained_dir, tmp_path)
    for section, k, v in (("parallel", "ep", 2), ("checkpoint", "every", 1), ("train", "log_every", 1), ("checkpoint", "dir", "x")):
        assert not differing_keys(config, _with(config, section, k, v)), (section, k)
    for section, k, v in (("optim", "lr", 0.5), ("train", "max_steps", 99), ("data", "seed", 7), ("train", "global_batch_size", 8)):
        assert list(differing_keys(config, _with(config, section, k, v))) == [f"{section}.{k}"], (section, k)


def test_same_config_resumes(trained_dir, tmp_path):
    root, config = _config(trained_dir, tmp_path)
    assert prepare_checkpoints(config) == "resume"
    assert latest_checkpoint(root) is not None


def _tree(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_other_config_is_refused_naming_the_keys_and_deleting_nothing(trained_dir, tmp_path):
    root, config = _config(trained_dir, tmp_path)
    before = _tree(root)
    with pytest.raises(PipelineError, match=r"optim.lr=0.003 there, 0.5 here\). Nothing was deleted.*checkpoint.dir"):
        prepare_checkpoints(_with(config, "optim", "lr", 0.5))
    assert _tree(root) == before


def test_a_longer_max_steps_extends_from_the_checkpoint_with_a_stated_schedule(trained_dir, tmp_path, capsys):
    root, config = _config(trained_dir, tmp_path)
    step = read_meta(latest_checkpoint(root))["step"]
    assert prepare_checkpoints(_with(config, "train", "max_steps", step + 4)) == "extend"
    err = capsys.readouterr().err
    assert f"continuing from the checkpoint at step {step}" in err and f"runs over {step + 4} steps" in err
    with pytest.raises(PipelineError, match=f"its checkpoint is at step {step}, beyond train.max_steps=2"):
        prepare_checkpoints(_with(config, "train", "max_steps", 2))


def test_init_from_inside_the_checkpoint_dir_of_another_config_is_refused(trained_dir, tmp_path):
    root, config = _config(trained_dir, tmp_path)
    changed = _with(_with(config, "optim", "lr", 0.5), "checkpoint", "init_from", str(root))
    with pytest.raises(PipelineError, match="checkpoint.init_from: .* lies inside checkpoint.dir"):
        prepare_checkpoints(changed)
    assert latest_checkpoint(root) is not None


def test_checkpoints_stored_in_the_dvc_cache_make_way_for_another_config(trained_dir, tmp_path):
    """A real DVC project: `dvc add` stores the checkpoints in the cache, so their working copies may go."""
    import subprocess
    import sys

    project = tmp_path / "project"
    project.mkdir()
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t", "PATH": "/usr/bin:/bin"}
    subprocess.run(["git", "init", "-q"], cwd=project, check=True, env=env)
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=project, check=True)
    root = project / "ck"
    shutil.copytree(trained_dir / "runs/train/checkpoints", root)
    config = read_meta(latest_checkpoint(root))["config"]
    config["checkpoint"]["dir"] = str(root)
    (root / "latest").unlink()  # `latest` is rewritten by every save: not part of what the test stores
    subprocess.run([sys.executable, "-m", "dvc", "add", "-q", "ck"], cwd=project, check=True)
    assert prepare_checkpoints(_with(config, "optim", "lr", 0.5)) == "restart"
    assert latest_checkpoint(root) is None
    cache = project / ".dvc/cache/files/md5"
    assert any(cache.rglob("*"))  # what was removed is still in the cache


def test_nothing_there_is_fresh(tmp_path):
    assert prepare_checkpoints({"checkpoint": {"dir": str(tmp_path / "none")}}) == "fresh"
    assert not Path(tmp_path / "none").exists()


def test_latest_is_removed_only_when_it_reads_as_the_checkpointers_pointer(tmp_path):
    """Issue 50: ``latest`` is read through moe.reader (a regular file of at most 256 bytes): a
    FIFO there is left alone at once (never a read that blocks), as is anything not a pointer."""
    import os
    import threading

    from pipeline.resume import remove_own_checkpoints

    latest = tmp_path / "latest"
    os.mkfifo(latest)
    done = []
    t = threading.Thread(target=lambda: done.append(remove_own_checkpoints(tmp_path)), daemon=True)
    t.start()
    t.join(5)
    assert done == [0], "a FIFO at latest blocked"
    assert latest.exists()
    latest.unlink()
    for text in ("step_00000005" + " " * 300, "my notes\n"):  # too large; not a step's name
        latest.write_text(text)
        remove_own_checkpoints(tmp_path)
        assert latest.read_text() == text
    latest.write_text("step_00000005\n")
    remove_own_checkpoints(tmp_path)
    assert not latest.exists()
