"""What the tracking reads back (issue 50): the image inventory, DVC's files, the stages' final
metrics, the spool and the artifacts it masks all come through moe.reader. A FIFO in place of any
of them is refused at once; a file that is not what its writer writes is one warning (the tags
and the parent run's figures are a courtesy) or one error naming the file and the field (a sync,
which sends nothing then)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from moe.reader import FileFormatError
from pipeline.errors import PipelineError
from tests.pipeline.fifo import fifo_at, within

INVENTORY = {  # as containers/inventory.py writes it
    "base_image": "nvcr.io/nvidia/pytorch:25.01-py3@sha256:" + "ab" * 32,
    "base_image_digest": "sha256:" + "ab" * 32,
    "lock": "requirements/gpu.lock",
    "lock_sha256": "cd" * 32,
    "python": "3.11.9",
    "torch": "2.9.0",
    "triton": "3.5.0",
    "nvshmem": None,
    "cuda": "12.8",
    "nccl": "2.27.3",
    "pip_freeze": ["torch==2.9.0", "numpy==2.1.0"],
}


def test_the_image_inventory_gives_its_tags(tmp_path, monkeypatch):
    from pipeline.tracking.provenance import environment_tags, inventory_tags

    (tmp_path / "inventory.json").write_text(json.dumps(INVENTORY))
    monkeypatch.setenv("MOE_IMAGE_INVENTORY", str(tmp_path / "inventory.json"))
    monkeypatch.delenv("MOE_IMAGE_DIGEST", raising=False)
    tags = inventory_tags()
    assert tags["image.torch"] == "2.9.0" and tags["image.lock_sha256"] == "cd" * 32 and "image.nvshmem" not in tags
    assert environment_tags()["image.nccl"] == "2.27.3"


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"torch": 2.9}, "torch: expected a string"),
        ({"lock_sha256": "not-a-digest"}, "lock_sha256: expected a string matching"),
        ({"pip_freeze": "torch==2.9.0"}, "pip_freeze: expected a list"),
        ({"installed_by": "me"}, "installed_by: unknown key"),
    ],
    ids=["number-for-a-version", "digest-not-hex", "freeze-not-a-list", "unknown-key"],
)
def test_an_inventory_that_is_not_the_images_gives_no_tags_and_one_warning(tmp_path, monkeypatch, caplog, change, field):
    from pipeline.tracking.provenance import environment_tags, inventory_tags

    (tmp_path / "inventory.json").write_text(json.dumps({**INVENTORY, **change}))
    monkeypatch.setenv("MOE_IMAGE_INVENTORY", str(tmp_path / "inventory.json"))
    with caplog.at_level(logging.WARNING, logger="pipeline.tracking"):
        assert inventory_tags() == {}
        assert not any(k.startswith("image.") for k in environment_tags())
    assert any(f"inventory.json: {field}" in r.getMessage() for r in caplog.records), caplog.text


def test_an_inventory_with_nan_is_not_json(tmp_path, monkeypatch, caplog):
    from pipeline.tracking.provenance import inventory_tags

    (tmp_path / "inventory.json").write_text('{"torch": NaN}')
    monkeypatch.setenv("MOE_IMAGE_INVENTORY", str(tmp_path / "inventory.json"))
    with caplog.at_level(logging.WARNING, logger="pipeline.tracking"):
        assert inventory_tags() == {}
    assert "NaN is not a number JSON allows" in caplog.text


def test_a_fifo_for_the_inventory_gives_no_tags_at_once(tmp_path, monkeypatch):
    from pipeline.tracking.provenance import environment_tags, inventory_tags

    fifo = fifo_at(tmp_path / "inventory.json")
    monkeypatch.setenv("MOE_IMAGE_INVENTORY", str(fifo))
    assert within(inventory_tags, fifo) == {}
    assert not any(k.startswith("image.") for k in within(environment_tags, fifo))


LOCK = {
    "schema": "2.0",
    "stages": {
        "tokenize": {
            "cmd": "moe tokenize",
            "params": {"params.yaml": {"tokenize.vocab_size": 512}},
            "outs": [{"path": "data/tokens", "hash": "md5", "md5": "0" * 32 + ".dir", "size": 10, "nfiles": 3}],
        },
        "train": {"cmd": "moe train", "outs": [{"path": "runs/train", "md5": "1" * 32}]},
    },
}


def test_dvc_hashes_and_deps_are_read_from_dvcs_files(tmp_path):
    import yaml

    from pipeline.tracking.provenance import dvc_dep_tags, dvc_out_hashes

    (tmp_path / "dvc.lock").write_text(yaml.safe_dump(LOCK))
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"train": {"cmd": "moe train", "deps": ["data/tokens", "pipeline"]}}}))
    assert dvc_out_hashes(tmp_path / "dvc.lock") == {"data/tokens": "0" * 32 + ".dir", "runs/train": "1" * 32}
    assert dvc_dep_tags("train", tmp_path / "dvc.yaml", tmp_path / "dvc.lock") == {"dvc.dep.data/tokens": "0" * 32 + ".dir"}


@pytest.mark.parametrize(
    "lock",
    [
        {"stages": {"train": {"outs": [{"path": "runs/train", "md5": "not-an-md5"}]}}},
        {"stages": {"train": {"outs": [{"md5": "1" * 32}]}}},  # an output without its path
        {"stages": ["train"]},
        "- just\n- a list\n",
    ],
    ids=["md5-not-hex", "out-without-path", "stages-a-list", "a-list"],
)
def test_a_dvc_lock_that_is_not_dvcs_gives_no_hashes(tmp_path, lock):
    import yaml

    from pipeline.tracking.provenance import dvc_out_hashes

    (tmp_path / "dvc.lock").write_text(lock if isinstance(lock, str) else yaml.safe_dump(lock))
    assert dvc_out_hashes(tmp_path / "dvc.lock") == {}


def test_a_fifo_for_dvcs_files_gives_no_tags_at_once(tmp_path):
    from pipeline.tracking.provenance import dvc_dep_tags, dvc_out_hashes

    lock, dvc_yaml = fifo_at(tmp_path / "dvc.lock"), fifo_at(tmp_path / "dvc.yaml")
    assert within(lambda: dvc_out_hashes(lock), lock) == {}
    assert within(lambda: dvc_dep_tags("train", dvc_yaml, lock), dvc_yaml) == {}


def test_the_final_metrics_are_the_stages_figures(tmp_path):
    from pipeline.tracking.stage_run import read_final_metrics

    train = {"steps": 8, "final_loss": 5.5, "mfu": None, "load_alarm": 0, "eval": {"step": 8, "val_loss": 5.6}}
    (tmp_path / "train.json").write_text(json.dumps(train))
    assert read_final_metrics(tmp_path / "train.json") == train
    assert read_final_metrics(tmp_path / "absent.json") == {}


@pytest.mark.parametrize(
    ("content", "field"),
    [
        ('{"final_loss": "low"}', "final_loss: expected a figure or a table of figures, got 'low'"),
        ('{"final_loss": NaN}', "not valid JSON (NaN is not a number JSON allows)"),
        ('{"suite": {"core": {"deep": 1}}}', "suite: expected a figure or a table of figures"),
        ('{"bad key!": 1}', "the file key: expected a string matching"),
        ("[1, 2]", "the file: expected a mapping"),
    ],
    ids=["text", "nan", "too-deep", "bad-name", "a-list"],
)
def test_final_metrics_that_are_not_a_stages_are_left_out_with_a_warning(tmp_path, caplog, content, field):
    from pipeline.tracking.stage_run import read_final_metrics

    (tmp_path / "eval.json").write_text(content)
    with caplog.at_level(logging.WARNING, logger="pipeline.tracking"):
        assert read_final_metrics(tmp_path / "eval.json") == {}
    assert f"eval.json: {field}" in caplog.text, caplog.text


def test_a_fifo_for_the_final_metrics_is_left_out_at_once(tmp_path, caplog):
    from pipeline.tracking.stage_run import read_final_metrics

    fifo = fifo_at(tmp_path / "train.json")
    with caplog.at_level(logging.WARNING, logger="pipeline.tracking"):
        assert within(lambda: read_final_metrics(fifo), fifo) == {}
    assert "train.json: not a regular file" in caplog.text


def test_a_fifo_in_the_spool_is_one_error_at_once(tmp_path):
    from pipeline.tracking.spool import read_spool

    fifo = fifo_at(tmp_path / "mlflow-fallback.jsonl")
    with pytest.raises(PipelineError, match=r"mlflow-fallback.jsonl: not a regular file \(not a spool\); nothing was uploaded"):
        within(lambda: read_spool([fifo]), fifo)


def test_a_spool_that_is_not_utf8_or_nested_too_deeply_is_one_error(tmp_path):
    from pipeline.tracking.spool import read_spool

    spool = tmp_path / "mlflow-fallback.jsonl"
    spool.write_bytes(b'{"run_id": "r", "status": "FINISHED"}\n\xff\n')
    with pytest.raises(PipelineError, match=r"mlflow-fallback.jsonl: not UTF-8 text \(byte 38\)"):
        read_spool([spool])
    spool.write_text('{"run_id": "r", "status": "FINISHED"}\n' + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(PipelineError, match=r"mlflow-fallback.jsonl:2: the line is nested too deeply"):
        read_spool([spool])


def test_a_masked_artifact_is_read_bounded_and_a_fifo_refused(tmp_path, monkeypatch):
    from pipeline.tracking import provenance

    text = tmp_path / "params.yaml"
    text.write_text("mlflow:\n  uri: http://user:s3cret@host/\n")
    masked = provenance.redacted_copy(text)
    assert masked != text and "s3cret" not in masked.read_text()
    fifo = fifo_at(tmp_path / "dvc.lock")
    with pytest.raises(FileFormatError, match="dvc.lock: not a regular file"):
        within(lambda: provenance.redacted_copy(fifo), fifo)
    monkeypatch.setattr(provenance, "MAX_ARTIFACT_BYTES", 8)
    with pytest.raises(FileFormatError, match="params.yaml: .* more than the 8"):
        provenance.redacted_copy(text)


def test_a_tracker_leaves_out_an_artifact_too_large_to_mask(tmp_path, monkeypatch, caplog):
    from pipeline.tracking import provenance
    from pipeline.tracking.stage_run import Tracker

    sent = []
    tracker = Tracker.__new__(Tracker)
    tracker._send = lambda fn, row: sent.append(fn)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    monkeypatch.setattr(provenance, "MAX_ARTIFACT_BYTES", 8)
    with caplog.at_level(logging.WARNING, logger="pipeline.tracking"):
        tracker.log_artifact(tmp_path / "metrics.jsonl")
    assert not sent and "metrics.jsonl" in caplog.text and "not logged as an artifact" in caplog.text


def test_finish_parent_logs_the_final_figures(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from pipeline.tracking import stage_run

    monkeypatch.chdir(tmp_path)
    Path("metrics").mkdir()
    Path("metrics/train.json").write_text(json.dumps({"steps": 8, "final_loss": 5.5, "mfu": None, "eval": {"step": 8}}))
    fifo_at(Path("metrics/eval.json"))
    logged, ended = [], []
    monkeypatch.setattr(stage_run, "log_batched", lambda client, run_id, metrics: logged.extend((m.key, m.value) for m in metrics))
    client = SimpleNamespace(set_terminated=lambda run_id, status: ended.append(status))
    within(lambda: stage_run.finish_parent(client, "p"), Path("metrics/eval.json"))
    assert sorted(logged) == [("train/final_loss", 5.5), ("train/steps", 8.0)] and ended == ["FINISHED"]
