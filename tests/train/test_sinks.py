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
