"""metrics.jsonl keeps the history of earlier attempts of a run (resumes, reruns)."""

import json

import pytest

from moe.train.sinks import JsonlSink


def rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_resumed_sink_keeps_rows_before_its_first_step_and_drops_rerun_ones(tmp_path):
    path = tmp_path / "metrics.jsonl"
    first = JsonlSink(path)
    for step in range(1, 8):
        first.log(step, {"loss": float(step)})
    first.close({})
    with open(path, "a") as f:
        f.write('{"step": 8, "lo')  # a line cut short by kill -9
    resumed = JsonlSink(path)  # resumed from the checkpoint at step 5: steps 6.. are re-run
    resumed.log(6, {"loss": 60.0})
    resumed.close({})
    assert [(r["step"], r["loss"]) for r in rows(path)] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 5.0), (6, 60.0)]


def test_sink_that_never_logs_leaves_the_file_alone(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 1.0}\n')
    JsonlSink(path).close({})  # a rerun of a finished run, or a rank that does not log
    assert path.read_text() == '{"step": 1, "loss": 1.0}\n'
    JsonlSink(tmp_path / "new" / "m.jsonl").close({})
    assert not (tmp_path / "new").exists()


def test_rerun_from_scratch_replaces_the_history(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 9.0}) + "\n" for s in range(1, 4)))
    sink = JsonlSink(path)
    sink.log(1, {"loss": 1.0})
    sink.close({})
    assert rows(path) == [{"step": 1, "loss": 1.0}]


def test_a_symlink_at_the_metrics_path_is_refused_not_written_through(tmp_path):
    """Issue 50: the sink refuses (one MoeError naming the file) instead of following a link
    planted at metrics.jsonl or failing with a traceback."""
    import pytest

    from moe.errors import MoeError

    victim = tmp_path / "precious.txt"
    victim.write_text('{"step": 1, "loss": 1.0}\n')
    (tmp_path / "metrics.jsonl").symlink_to(victim)
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    with pytest.raises(MoeError, match="metrics.jsonl is a symlink; refusing to write through it"):
        sink.log(1, {"loss": 2.0})
    assert victim.read_text() == '{"step": 1, "loss": 1.0}\n'


def test_a_rewrite_goes_through_a_fresh_temporary_and_leaves_none(tmp_path):
    """The resumed sink's rewrite: a temporary of its own (never a user's `metrics.jsonl.tmp`,
    which it once truncated), renamed over the file."""
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 4)))
    (tmp_path / "metrics.jsonl.tmp").write_text("a user's file\n")
    sink = JsonlSink(path)
    sink.log(3, {"loss": 3.0})
    sink.close({})
    assert [r["step"] for r in rows(path)] == [1, 2, 3]
    assert (tmp_path / "metrics.jsonl.tmp").read_text() == "a user's file\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "metrics.jsonl.tmp"]


def test_write_file_atomic_refuses_a_link_or_a_folder_where_the_file_belongs(tmp_path):
    import pytest

    from moe.errors import MoeError
    from moe.train.sinks import write_file_atomic

    (tmp_path / "d").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "d")
    (tmp_path / "f").write_text("x")
    for name, said in (("d", "is not a regular file"), ("link", "is a symlink"), ("f/x.json", "is not a directory")):
        with pytest.raises(MoeError, match=said):
            write_file_atomic(tmp_path / name, "{}")
    write_file_atomic(tmp_path / "new/s.json", "{}")
    assert (tmp_path / "new/s.json").read_text() == "{}"


def test_read_metric_rows_skips_what_is_not_a_metrics_row_naming_the_first(tmp_path, capsys):
    """Issue 50: rows are checked against METRIC_ROW (the sink's own, "nan" text included); a
    row of the wrong type, range, key or a NaN literal is skipped with one warning naming it."""
    from moe.train.sinks import read_metric_rows

    path = tmp_path / "metrics.jsonl"
    path.write_text(
        '{"step": 1, "loss": 2.0}\n'
        '{"step": 2, "loss": "x"}\n'  # wrong type
        '{"step": -3, "loss": 1.0}\n'  # out of range
        '{"step": 4, "loss lr!": 1.0}\n'  # not a metric's name
        '{"step": 5, "loss": NaN}\n'  # not JSON
        '{"step": 6, "loss": "nan", "lr": null}\n'  # the sink's text for a non-finite loss
    )
    assert read_metric_rows(path) == [{"step": 1, "loss": 2.0}, {"step": 6, "loss": "nan", "lr": None}]
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and "metrics.jsonl:2: skipped 4 damaged line(s)" in err
    assert "the first: loss: expected a finite number, or nan, inf, -inf, got 'x'" in err


def test_metrics_files_are_bounded_and_a_fifo_is_refused_at_once(tmp_path, monkeypatch):
    import os
    import threading

    import pytest

    from moe.errors import MoeError
    from moe.reader import FileFormatError
    from moe.train import sinks
    from moe.train.sinks import read_metric_rows

    fifo = tmp_path / "metrics.jsonl"
    os.mkfifo(fifo)
    raised = []

    def both():
        raised.append(pytest.raises(FileFormatError, read_metric_rows, fifo))
        raised.append(pytest.raises(MoeError, JsonlSink(fifo).log, 1, {"loss": 1.0}))

    t = threading.Thread(target=both, daemon=True)
    t.start()
    t.join(5)
    assert len(raised) == 2, "reading a FIFO metrics file blocked"
    assert "metrics.jsonl: not a regular file" in str(raised[0].value)
    assert "metrics.jsonl exists and is not a regular file" in str(raised[1].value)
    big = tmp_path / "big.jsonl"
    big.write_text('{"step": 1, "loss": 1.0}\n' * 100)
    monkeypatch.setattr(sinks, "METRICS_MAX_BYTES", 1000)
    with pytest.raises(FileFormatError, match=r"big.jsonl: \d+ bytes, more than the 1000"):
        read_metric_rows(big)


def test_a_full_disk_is_one_error_naming_the_metrics_file(small_disk):
    """A run directory on a full file system: one error line naming metrics.jsonl and the free
    space, exit code 2 (bad input: the machine's disk), never a traceback."""
    import errno

    from moe.errors import OutputError, exit_code_of
    from moe.train.sinks import JsonlSink

    sink = JsonlSink(small_disk / "run" / "metrics.jsonl")
    with pytest.raises(OutputError, match=r"metrics.jsonl: cannot write the metrics of step \d+ \(No space left on device; 0.00 GiB free"):
        for step in range(1, 100_000):
            sink.log(step, {"loss": 1.0, "padding": float(step) * 1e-3, **{f"k{i}": 1.0 for i in range(50)}})
    assert exit_code_of(OutputError("x")) == 2
    assert exit_code_of(OSError(errno.ENOSPC, "No space left on device")) == 2
    assert exit_code_of(OSError(errno.EIO, "I/O error")) is None  # anything else stays a bug's traceback
