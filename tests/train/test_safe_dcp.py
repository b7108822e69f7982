"""Loading a checkpoint never runs code from it; damage is an error naming the file (issue 10)."""

import json
import os
import pickle

import pytest
import torch

from moe.train.checkpoint import CheckpointError, CheckpointManager, latest_checkpoint, resolve_checkpoint
from moe.train.rng import rng_state, set_rng_state
from moe.train.safe_dcp import UnsafeCheckpointError, read_metadata


class Planted:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def save(root, step=1):
    return CheckpointManager(root).save(step, {"w": torch.arange(6.0), "n": 3}, {"note": "x"}, rng_state(torch.device("cpu")))


def reseal(step_dir):
    from moe.train.checkpoint import _sha256

    meta = json.loads((step_dir / "meta.json").read_text())
    meta["files"] = {n: _sha256(step_dir / n) for n in meta["files"]}
    (step_dir / "meta.json").write_text(json.dumps(meta))


def test_rng_state_round_trips_through_a_weights_only_file(tmp_path):
    path = save(tmp_path)
    target = {"w": torch.zeros(6), "n": 0}
    meta, rng = CheckpointManager.load(path, target)
    assert target["w"].tolist() == list(range(6)) and meta["files"].keys() >= {".metadata", "rng-rank00000.pt"}
    expected = torch.rand(3)
    set_rng_state(rng, torch.device("cpu"))
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("name", ["rng-rank00000.pt", ".metadata"])
def test_planted_pickle_is_refused_and_not_run(tmp_path, name):
    path = save(tmp_path / "ck")
    marker = tmp_path / "EXECUTED"
    if name.endswith(".pt"):
        torch.save(Planted(marker), path / name)
    else:
        (path / name).write_bytes(pickle.dumps(Planted(marker)))
    reseal(path)  # an attacker fixes the checksums too
    with pytest.raises(CheckpointError, match=f"{name}: refused"):
        CheckpointManager.load(path, {"w": torch.zeros(6), "n": 0})
    assert not marker.exists()


def test_metadata_reader_accepts_only_dcp_metadata(tmp_path):
    path = save(tmp_path)
    assert read_metadata(path / ".metadata").state_dict_metadata.keys() == {"w", "n"}
    (tmp_path / "x").write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(UnsafeCheckpointError, match="not DCP Metadata"):
        read_metadata(tmp_path / "x")


def test_flipped_byte_is_caught_by_the_checksum(tmp_path):
    path = save(tmp_path)
    shard = next(path.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"__0_0.distcp: sha256 does not match"):
        CheckpointManager.load(path, {"w": torch.zeros(6), "n": 0})


def test_damaged_newest_step_does_not_fall_back_to_an_older_one(tmp_path):
    save(tmp_path, 1)
    newest = save(tmp_path, 2)
    (newest / ".metadata").unlink()
    with pytest.raises(CheckpointError, match="step_00000002: damaged checkpoint .missing .metadata"):
        latest_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="damaged"):
        resolve_checkpoint(newest)


def test_a_checkpoint_dir_that_is_a_file_is_an_error(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(CheckpointError, match="not a directory"):
        latest_checkpoint(tmp_path / "f")


def test_rng_files_of_earlier_versions_still_load(tmp_path):
    """Earlier checkpoints stored tuples and a numpy array: plain numbers, loaded without unpickling code."""
    import random

    import numpy as np

    path = save(tmp_path)
    legacy = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    torch.save(legacy, path / "rng-rank00000.pt")
    reseal(path)
    expected = (random.random(), float(np.random.rand()), torch.rand(1).item())
    _, rng = CheckpointManager.load(path, {"w": torch.zeros(6), "n": 0})
    set_rng_state(rng, torch.device("cpu"))
    assert (random.random(), float(np.random.rand()), torch.rand(1).item()) == expected
