"""Progress of long work: a log line every LOG_EVERY_S seconds where stderr is a file, a tqdm bar on a terminal,
nothing for work that ends sooner, and nothing on ranks other than 0."""

import contextlib
import io
import os
import select
import time

from titan.progress import Progress


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_log_file_gets_a_line_every_interval_and_one_when_done():
    stream, clock = io.StringIO(), Clock()
    with Progress("exporting", total=100, unit="B", stream=stream, clock=clock, log_every_s=30) as progress:
        clock.now += 10
        progress.update(20)
        assert stream.getvalue() == ""  # not yet 30 s
        clock.now += 30  # 40 s in: 50 of 100 bytes, 1.25 B/s, 40 s to go
        progress.update(30)
        clock.now += 20
        progress.update(10)  # 20 s after the last line: none
        clock.now += 20
    lines = [line.split(" ", 1)[1] for line in stream.getvalue().splitlines()]
    assert lines == ["exporting: 50.0B of 100B (50%), 1.25B/s, about 00:40 left", "exporting: done in 01:20"]


def test_work_done_before_the_first_line_prints_nothing():
    stream, clock = io.StringIO(), Clock()
    with Progress("loading", total=5, stream=stream, clock=clock, log_every_s=30) as progress:
        for _ in range(5):
            clock.now += 5
            progress.update()
    assert stream.getvalue() == ""


def test_a_count_without_a_total():
    stream, clock = io.StringIO(), Clock()
    progress = Progress("reading", unit=" records", stream=stream, clock=clock, log_every_s=1)
    clock.now += 2
    progress.update(12_000)
    assert stream.getvalue().split(" ", 1)[1] == "reading: 12.0k records, 6.00k records/s\n"


def test_other_ranks_show_nothing(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    stream, clock = io.StringIO(), Clock()
    with Progress("saving", total=10, stream=stream, clock=clock, log_every_s=0) as progress:
        clock.now += 60
        progress.update(5)
    assert stream.getvalue() == "" and not progress.enabled


def test_a_terminal_gets_a_tqdm_bar_after_a_second():
    main, replica = os.openpty()
    with open(replica, "w") as terminal:
        with Progress("downloading", total=4 * 2**20, unit="B", stream=terminal) as progress:
            time.sleep(1.1)  # the bar's delay: work that ends sooner draws none
            progress.update(2**20)
        terminal.flush()
    drawn = b""
    with contextlib.suppress(OSError):  # Linux answers EIO once the terminal's other end is closed and read
        while select.select([main], [], [], 0.2)[0]:
            drawn += os.read(main, 4096)
    os.close(main)
    drawn = drawn.decode()
    assert "\r" in drawn and "downloading:  25%" in drawn and "1.00M/4.00M" in drawn, drawn
