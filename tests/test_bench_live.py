"""The live progress of ``posenc bench`` in a log file (issue 14): plain lines and a sensible ETA.

Independent truth: the lines are counted and searched for carriage returns; the ETA is
worked out by hand from the fake clock's durations (mean duration × runs left / workers).
"""

from __future__ import annotations

import io
import re

import pytest

from posenc.bench.live import LiveBoard
from posenc.bench.runner import Job, RunConfig


class _EmptyStore:
    def keys(self) -> set[str]:
        return set()

    def load(self) -> dict:
        return {}


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _jobs(n: int) -> list[Job]:
    return [Job(RunConfig(task="order", encoding="rope", seed=s, steps=10)) for s in range(n)]


def _record(job: Job, acc: float) -> dict:
    return {
        "config": job.config.as_dict(),
        "metric": "accuracy",
        "higher_is_better": True,
        "metrics": {"16": acc, "32": acc / 2},
        "train_seconds": 1.0,
        "label": job.label,
    }


def _clock_seconds(text: str) -> int:
    h, m, s = (int(x) for x in text.split(":"))
    return 3600 * h + 60 * m + s


@pytest.mark.parametrize("per_step", [False, True])
def test_a_log_file_gets_one_plain_line_per_run(per_step):
    jobs, stream, clock = _jobs(4), io.StringIO(), _Clock()
    board = LiveBoard(jobs, _EmptyStore(), progress=True, live=True, per_step=per_step, stream=stream, clock=clock)
    for i, job in enumerate(jobs):
        for step in range(1, 11):
            board.on_step(job, step, 0.5)
        clock.now += 30
        if i == 2:
            board.failed(job, "ConfigError: a run that failed")
        else:
            board.finished(job, _record(job, 0.9))
    board.close()
    text = stream.getvalue()
    assert "\r" not in text and "\x1b" not in text
    lines = text.splitlines()
    assert len(lines) == len(jobs)
    assert [line[:5] for line in lines] == ["[1/4]", "[2/4]", "[3/4]", "[4/4]"]
    assert "FAILED: ConfigError: a run that failed" in lines[2]


def test_log_lines_go_to_the_default_streams_without_a_bar(capsys):
    # no stream given: stdout and stderr, which are not terminals under pytest
    jobs = _jobs(3)
    board = LiveBoard(jobs, _EmptyStore(), progress=True, live=True, per_step=False)
    for job in jobs:
        board.finished(job, _record(job, 0.8))
    board.close()
    got = capsys.readouterr()
    assert "\r" not in got.out + got.err and got.err == ""
    assert len(got.out.splitlines()) == 3


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_the_first_eta_is_the_measured_duration_times_the_runs_left(workers):
    jobs, stream, clock = _jobs(10), io.StringIO(), _Clock()
    board = LiveBoard(
        jobs, _EmptyStore(), progress=True, live=True, per_step=True, workers=workers, stream=stream, clock=clock
    )
    clock.now += 5  # setup: what made tqdm's first step-rate estimate read 34:15:07
    board.on_step(jobs[0], 1, 1.0)
    clock.now += 37  # the first run took 42 s
    board.finished(jobs[0], _record(jobs[0], 0.9))
    first = re.search(r"ETA (\d+:\d\d:\d\d)", stream.getvalue())
    assert first is not None
    assert _clock_seconds(first.group(1)) == round(42 * 9 / workers)
    clock.now += 18  # with one worker the second run took 18 s; with more it started at the start: 60 s
    board.finished(jobs[1], _record(jobs[1], 0.9))
    second = re.findall(r"ETA (\d+:\d\d:\d\d)", stream.getvalue())[1]
    # one worker: the first run also paid for the start, the second is the rate (issue 48); more: both started
    # with the suite, the newer weighing 2 ** (1 / 6) as much as the older (a half-life of 6 runs)
    w = 0.5 ** (1 / 6)
    mean = 18 if workers == 1 else (w * 42 + 60) / (w + 1)
    assert _clock_seconds(second) == round(mean * 8 / workers)


def test_the_last_line_has_no_eta_and_a_terminal_still_gets_the_bar():
    jobs, stream, clock = _jobs(2), io.StringIO(), _Clock()
    board = LiveBoard(jobs, _EmptyStore(), progress=True, live=True, per_step=False, stream=stream, clock=clock)
    for job in jobs:
        clock.now += 10
        board.finished(job, _record(job, 0.9))
    lines = stream.getvalue().splitlines()
    assert "ETA 0:00:10" in lines[0] and "ETA" not in lines[1]
    term = _Terminal()
    board = LiveBoard(jobs, _EmptyStore(), progress=True, live=True, per_step=False, stream=term)
    for job in jobs:
        board.finished(job, _record(job, 0.9))
    board.close()
    assert "\r" in term.getvalue() and "2/2" in term.getvalue()  # tqdm, redrawn in place


def test_a_terminal_bar_starts_its_clock_at_the_first_step():
    import time

    jobs, term = _jobs(2), _Terminal()
    board = LiveBoard(jobs, _EmptyStore(), progress=True, live=True, per_step=True, stream=term)
    created = board.bar.start_t
    time.sleep(0.05)  # the setup before the first step (seconds to minutes in a real suite)
    before_first_step = time.time()
    board.on_step(jobs[0], 1, 1.0)
    assert board.bar.start_t >= before_first_step > created and board.bar.n == 1
    board.on_step(jobs[0], 2, 1.0)
    assert board.bar.n == 2
    board.close()
