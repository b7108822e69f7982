"""metrics.jsonl keeps the history of earlier attempts of a run (resumes, reruns)."""

import json

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
