"""A tokenised-requests export (`moe tasks --export`) is read through moe.reader: bounded before
and after decompression, every field of every request checked, one error line naming it."""

import gzip
import json
import os
import threading

import pytest

from moe.errors import ConfigError
from moe.eval import requests
from moe.eval.requests import Request, TaskRequests, dump_task_requests, load_task_requests

REQS = (Request(0, 0, (5, 6), (7,), 0, 2, 2, 1, 1), Request(0, 1, (5, 6), (8, 9), 0, 3, 3, 2, 2))


def _body() -> dict:
    return json.loads(gzip.decompress(dump_task_requests([TaskRequests("piqa", "acc", REQS, 1)], {"limit": None, "max_len": 64})))


def _write(path, body) -> None:
    path.write_bytes(gzip.compress(json.dumps(body).encode(), mtime=0))


def test_an_export_round_trips(tmp_path):
    _write(tmp_path / "r.json.gz", _body())
    (task,), meta = load_task_requests(tmp_path / "r.json.gz")
    assert task.requests == REQS and task.sample is None and meta == {"format": requests.FORMAT, "limit": None, "max_len": 64}


def test_what_a_run_reads_round_trips_whole(tmp_path):
    """The in-loop tasks reach every rank through this file: a sample, the documents left out and
    a task's subjects (its mean over subjects) come back as they went, so the metrics are the same."""
    task = TaskRequests("mmlu_x", "acc", REQS, 9, sample=(0, 4), dropped=(4,), subjects=((0, "anatomy"),))
    (tmp_path / "r.json.gz").write_bytes(dump_task_requests([task], {"task_names": ["mmlu_x"], "truncation": "drop"}))
    (back,), meta = load_task_requests(tmp_path / "r.json.gz")
    assert back == task and meta["task_names"] == ["mmlu_x"] and meta["truncation"] == "drop"


@pytest.mark.parametrize(
    ("edit", "said"),
    [
        (lambda b: b["tasks"][0]["requests"][1][2].append("x"), r"tasks\[0\].requests\[1\].ctx\[2\]: expected an integer, got 'x'"),
        (lambda b: b["tasks"][0]["requests"][0][3].__setitem__(0, -1), r"tasks\[0\].requests\[0\].cont\[0\]: expected an integer in \[0, "),
        (lambda b: b["tasks"][0]["requests"][0].__setitem__(3, []), r"tasks\[0\].requests\[0\].cont: expected a list of 1 to"),
        (lambda b: b["tasks"][0]["requests"][0].pop(), r"tasks\[0\].requests\[0\]: expected a list of the 9 fields"),
        (lambda b: b["tasks"][0].update(shots=5), r"tasks\[0\].shots: unknown key"),
        (lambda b: b.update(vocab_size=0), r"vocab_size: expected an integer in \[1, "),
        (lambda b: b["tasks"][0].update(name="a b"), r"tasks\[0\].name: expected a string matching"),
    ],
    ids=["text-token", "negative-token", "empty-continuation", "short-row", "unknown-key", "vocab-out-of-range", "odd-name"],
)
def test_a_damaged_export_is_one_error_naming_the_field(tmp_path, edit, said):
    body = _body()
    edit(body)
    _write(tmp_path / "r.json.gz", body)
    with pytest.raises(ConfigError, match="r.json.gz: " + said):
        load_task_requests(tmp_path / "r.json.gz")


def test_nan_truncation_trailing_bytes_and_a_gzip_bomb_are_refused(tmp_path, monkeypatch):
    path = tmp_path / "r.json.gz"
    text = json.dumps(_body()).replace('"max_len": 64', '"max_len": NaN')
    path.write_bytes(gzip.compress(text.encode(), mtime=0))
    with pytest.raises(ConfigError, match="r.json.gz: not a tokenised-requests file .*NaN is not a number JSON allows"):
        load_task_requests(path)
    whole = gzip.compress(json.dumps(_body()).encode(), mtime=0)
    for raw, said in ((whole[:-9], "truncated gzip data"), (whole + b"x", "truncated gzip data")):
        path.write_bytes(raw)
        with pytest.raises(ConfigError, match=f"r.json.gz: not a tokenised-requests file .*: {said}"):
            load_task_requests(path)
    path.write_bytes(gzip.compress(b" " * 100_000, mtime=0))
    monkeypatch.setattr(requests, "MAX_JSON_BYTES", 50_000)
    with pytest.raises(ConfigError, match="r.json.gz: not a tokenised-requests file .*: more than 50,000 bytes once decompressed"):
        load_task_requests(path)


def test_a_fifo_in_place_of_the_export_is_refused_at_once(tmp_path):
    os.mkfifo(tmp_path / "r.json.gz")
    raised = []
    t = threading.Thread(target=lambda: raised.append(pytest.raises(ConfigError, load_task_requests, tmp_path / "r.json.gz")), daemon=True)
    t.start()
    t.join(5)
    assert raised, "reading a FIFO export blocked"
    assert "r.json.gz: not a tokenised-requests file (`moe tasks --export` writes one): not a regular file" in str(raised[0].value)
