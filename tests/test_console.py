"""Progress where stderr is not a terminal (CI logs, pipes): plain lines at a bounded rate, with the
share done and the time left, and nothing for work that ends quickly."""

from __future__ import annotations

from trtmoe import console


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(units: str = "steps"):
    clock, lines = Clock(), []
    return console.LineProgress("calibrate", units=units, interval=30.0, write=lines.append, clock=clock), clock, lines


def test_quick_work_prints_nothing():
    prog, clock, lines = make()
    with prog:
        task = prog.add_task("sensitivity", total=None)
        for i in range(1, 11):
            clock.t += 2.0
            prog.update(task, completed=i, total=10)
    assert lines == []


def test_long_work_prints_a_line_per_interval_and_one_at_the_end():
    prog, clock, lines = make()
    with prog:
        task = prog.add_task("sensitivity")
        prog.update(task, completed=0, total=100)  # the start: the clock begins here
        for i in range(1, 101):
            clock.t += 1.0
            prog.update(task, completed=i, total=100)
    assert lines == [
        "calibrate: sensitivity 30/100 (30%), 0:30 elapsed, about 1:10 left",
        "calibrate: sensitivity 60/100 (60%), 1:00 elapsed, about 0:40 left",
        "calibrate: sensitivity 90/100 (90%), 1:30 elapsed, about 0:10 left",
        "calibrate: sensitivity 100/100 (100%), 1:40 elapsed",
    ]


def test_a_resumed_run_is_timed_from_where_it_resumed():
    prog, clock, lines = make()
    with prog:
        task = prog.add_task("sensitivity")
        prog.update(task, completed=50, total=100)  # half done by an earlier, interrupted run
        clock.t += 40.0
        prog.update(task, completed=60, total=100)  # 10 steps in 40 s: 40 steps left take 160 s
    assert lines[0] == "calibrate: sensitivity 60/100 (60%), 0:40 elapsed, about 2:40 left"


def test_bytes_and_no_final_line_after_an_error():
    prog, clock, lines = make("bytes")
    try:
        with prog:
            task = prog.add_task("converting")
            prog.update(task, completed=0, total=4 * 2**30)
            clock.t += 31.0
            prog.update(task, completed=2**30, total=4 * 2**30)
            clock.t += 5.0
            prog.update(task, completed=2 * 2**30, total=4 * 2**30)
            raise OSError("disk full")
    except OSError:
        pass
    assert lines == ["calibrate: converting 1.00 GiB/4.00 GiB (25%), 0:31 elapsed, about 1:33 left"]


def test_off_a_terminal_the_factory_gives_lines():
    assert not console.err_console.is_terminal  # pytest captures stderr
    assert isinstance(console.progress("convert", units="bytes"), console.LineProgress)
