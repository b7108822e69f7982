"""Loading a checkpoint never runs code from it; damage is an error naming the file (issue 10)."""

import json
import pickle

import pytest
import torch

from moe.train.checkpoint import CheckpointError, CheckpointManager, latest_checkpoint, resolve_checkpoint
from moe.train.rng import rng_state, set_rng_state
from moe.train.safe_dcp import UnsafeCheckpointError, read_metadata
from tests.helpers import Planted, reseal


def save(root, step=1):
    return CheckpointManager(root).save(step, {"w": torch.arange(6.0), "n": torch.tensor(3)}, {"note": "x"}, rng_state(torch.device("cpu")))


def target():
    return {"w": torch.zeros(6), "n": torch.tensor(0)}


def test_rng_state_round_trips_through_a_weights_only_file(tmp_path):
    path = save(tmp_path)
    into = target()
    meta, rng = CheckpointManager.load(path, into)
    assert into["w"].tolist() == list(range(6)) and meta["files"].keys() >= {".metadata", "rng-rank00000.pt"}
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
        CheckpointManager.load(path, target())
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
        CheckpointManager.load(path, target())


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
    _, rng = CheckpointManager.load(path, target())
    set_rng_state(rng, torch.device("cpu"))
    assert (random.random(), float(np.random.rand()), torch.rand(1).item()) == expected


# ---------------------------------------------------------------- issue 25: closing the classes


def _planted_metadata(path, marker, build):
    """Rewrite .metadata with ``build(metadata, planted)`` and reseal every checksum."""
    from torch.distributed.checkpoint.metadata import Metadata  # noqa: F401 - the class unpickled below

    md = pickle.loads((path / ".metadata").read_bytes())
    build(md, Planted(marker))
    (path / ".metadata").write_bytes(pickle.dumps(md))
    reseal(path)


def _bytes_entry(md, planted):
    """What the audit planted: an entry DCP would torch.load(weights_only=False) from a shard."""
    import io

    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    md.state_dict_metadata["n"] = BytesStorageMetadata()
    buf = io.BytesIO()
    torch.save(planted, buf)


def _in_tensor_properties(md, planted):
    md.state_dict_metadata["w"].properties.dtype = planted


def _in_chunk(md, planted):
    md.state_dict_metadata["w"].chunks[0].offsets = planted


def _in_index(md, planted):
    key = next(iter(md.storage_data))
    md.storage_data[key] = planted


def _in_storage_meta(md, planted):
    md.storage_meta = planted


def _in_planner_data(md, planted):
    md.planner_data = {"w": planted}


def _storage_outside(md, planted):
    key = next(iter(md.storage_data))
    md.storage_data[key].relative_path = "../../elsewhere.distcp"


@pytest.mark.parametrize("build", [_bytes_entry, _in_tensor_properties, _in_chunk, _in_index, _in_storage_meta, _in_planner_data, _storage_outside])
def test_payloads_through_every_metadata_class_are_refused(tmp_path, build):
    path = save(tmp_path / "ck")
    marker = tmp_path / "EXECUTED"
    _planted_metadata(path, marker, build)
    with pytest.raises(CheckpointError, match=r"\.metadata: refused"):
        CheckpointManager.load(path, target())
    assert not marker.exists()


def test_bytes_entry_with_payload_in_the_shard_is_refused_before_any_unpickling(tmp_path):
    """The audit's case end to end: the bytes the entry points at hold a planted torch.save."""
    import io

    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    path = save(tmp_path / "ck")
    marker = tmp_path / "EXECUTED"
    buf = io.BytesIO()
    torch.save(Planted(marker), buf)
    shard = next(path.glob("*.distcp"))
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(buf.getvalue())
    md = pickle.loads((path / ".metadata").read_bytes())
    md.state_dict_metadata["n"] = BytesStorageMetadata()
    info = next(iter(md.storage_data.values()))
    info = type(info)(relative_path=info.relative_path, offset=offset, length=len(buf.getvalue()))
    md.storage_data = {k: v for k, v in md.storage_data.items() if k.fqn != "n"}
    md.storage_data[MetadataIndex("n")] = info
    (path / ".metadata").write_bytes(pickle.dumps(md))
    reseal(path)
    with pytest.raises(CheckpointError, match="refused"):
        CheckpointManager.load(path, {"w": torch.zeros(6), "n": torch.tensor(0)})
    with pytest.raises(CheckpointError, match="refused"):
        CheckpointManager.load(path, {"w": torch.zeros(6), "n": 0})  # a non-tensor target asks for bytes
    assert not marker.exists()


def test_the_bytes_planner_refuses_even_when_reached():
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    from moe.train.safe_dcp import TensorsOnlyLoadPlanner

    item = ReadItem(LoadItemType.BYTE_IO, MetadataIndex("n"), torch.Size([]), MetadataIndex("n"), torch.Size([]), torch.Size([]))
    with pytest.raises(UnsafeCheckpointError, match="pickled bytes"):
        TensorsOnlyLoadPlanner().load_bytes(item, None)


def test_saving_anything_but_tensors_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="'n' is a int; checkpoints hold tensors only"):
        CheckpointManager(tmp_path).save(1, {"w": torch.zeros(2), "n": 3}, {}, {})
    assert not any(tmp_path.iterdir())


def _edit_meta(path, **changes):
    meta = json.loads((path / "meta.json").read_text())
    for k, v in changes.items():
        if v is None:
            meta.pop(k, None)
        else:
            meta[k] = v
    (path / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"files": None}, "does not match its meta_sha256"),
        ({"step": 18}, "does not match its meta_sha256"),
        ({"note": "edited"}, "does not match its meta_sha256"),
        ({"meta_sha256": None}, "has no meta_sha256"),
    ],
)
def test_meta_json_is_covered_by_its_checksum(tmp_path, changes, message):
    path = save(tmp_path)
    _edit_meta(path, **changes)
    with pytest.raises(CheckpointError, match=message):
        CheckpointManager.load(path, target())


def test_resealed_but_inconsistent_meta_is_refused(tmp_path):
    path = save(tmp_path)
    _edit_meta(path, files=None)
    reseal(path)  # the checksum list removed, meta.json's own checksum recomputed
    with pytest.raises(CheckpointError, match=r"meta.json: files: missing"):
        CheckpointManager.load(path, target())
    path = save(tmp_path / "b", step=10)
    _edit_meta(path, step=18)
    reseal(path)
    with pytest.raises(CheckpointError, match="says step 18, but the directory is step_00000010"):
        CheckpointManager.load(path, target())


def test_non_finite_weights_are_refused_by_name(tmp_path):
    path = CheckpointManager(tmp_path).save(1, {"w": torch.tensor([1.0, float("nan")]), "n": torch.tensor(1)}, {}, {})
    with pytest.raises(CheckpointError, match="tensor w holds non-finite values"):
        CheckpointManager.load(path, {"w": torch.zeros(2), "n": torch.tensor(0)})


def test_a_full_disk_is_one_error_and_leaves_nothing_partial(small_disk):
    big = {"w": torch.zeros(4 * 2**20 // 4)}  # 4 MiB into a 1 MiB file system
    with pytest.raises(CheckpointError, match=r"cannot write checkpoint step 1 .*GiB free on its file system"):
        CheckpointManager(small_disk / "ck").save(1, big, {}, rng_state(torch.device("cpu")))
    assert latest_checkpoint(small_disk / "ck") is None
    assert [p.name for p in (small_disk / "ck").iterdir()] == []
