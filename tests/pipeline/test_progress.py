"""Progress lines (pipeline/progress.py): the first unit at once, then one per interval, each
with its rate and the time left; none for the last unit."""

from pipeline.progress import Every, ProgressLines, seconds


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_every_is_true_at_once_then_once_per_interval():
    clock = Clock()
    due = Every(10.0, clock)
    said = []
    for t in (0, 1, 9.9, 10, 15, 21):
        clock.now = t
        said.append(due())
    assert said == [True, False, False, True, False, True]


def test_lines_carry_the_rate_from_the_first_unit_and_the_time_left():
    clock, lines = Clock(), []
    update = ProgressLines("tokenize", "sources encoded", lines.append, clock=clock)
    clock.now = 30.0  # a tokenizer trained first: no unit's time
    update(1, 100)
    for done in range(2, 101):
        clock.now += 0.5
        update(done, 100)
    assert lines[0] == "tokenize: 1 of 100 sources encoded"
    assert lines[1] == "tokenize: 21 of 100 sources encoded (2/s, about 40 s left)"
    assert len(lines) == 5 and not any(line.startswith("tokenize: 100 ") for line in lines)  # every 10 s; the result line ends it


def test_seconds_read_as_a_person_would():
    assert [seconds(s) for s in (0.4, 42, 185, 7800)] == ["0 s", "42 s", "3 min 5 s", "2 h 10 min"]
