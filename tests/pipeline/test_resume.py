"""Which checkpoints a rerun of the train stage resumes (pipeline/resume.py)."""

import shutil
from pathlib import Path

from moe.train.checkpoint import latest_checkpoint, read_meta
from pipeline.resume import config_key, prepare_checkpoints


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
    key = config_key(config)
    for section, k, v in (("parallel", "ep", 2), ("checkpoint", "every", 1), ("train", "log_every", 1), ("checkpoint", "dir", "x")):
        assert config_key(_with(config, section, k, v)) == key, (section, k)
    for section, k, v in (("optim", "lr", 0.5), ("train", "max_steps", 99), ("data", "seed", 7), ("train", "global_batch_size", 8)):
        assert config_key(_with(config, section, k, v)) != key, (section, k)


def test_same_config_resumes(trained_dir, tmp_path):
    root, config = _config(trained_dir, tmp_path)
    assert prepare_checkpoints(config) == "resume"
    assert latest_checkpoint(root) is not None


def test_other_config_starts_afresh_removing_only_its_checkpoints(trained_dir, tmp_path):
    root, config = _config(trained_dir, tmp_path)
    (root / "notes.txt").write_text("mine")
    assert prepare_checkpoints(_with(config, "optim", "lr", 0.5)) == "restart"
    assert latest_checkpoint(root) is None
    assert sorted(p.name for p in root.iterdir()) == ["notes.txt"]


def test_nothing_there_is_fresh(tmp_path):
    assert prepare_checkpoints({"checkpoint": {"dir": str(tmp_path / "none")}}) == "fresh"
    assert not Path(tmp_path / "none").exists()
