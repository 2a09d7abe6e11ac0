"""The live board's ETA weighs each run left by its measured cost (issue 27), and a run at chance says so.

Independent truth: the ETA is worked out by hand from a fake clock (adjacent runs 3× as slow as order runs).
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
    now = 1000.0

    def __call__(self) -> float:
        return self.now


def _record(job: Job, acc: float) -> dict:
    return {
        "config": job.config.as_dict(),
        "metric": "accuracy",
        "higher_is_better": True,
        "metrics": {"16": acc, "32": acc, "64": acc},
        "train_seconds": 1.0,
        "label": job.label,
    }


def _seconds(text: str) -> int:
    h, m, s = (int(x) for x in text.split(":"))
    return 3600 * h + 60 * m + s


def test_the_eta_weighs_the_runs_left_by_their_task_and_encoding():
    order = [Job(RunConfig(task="order", encoding="rope", seed=s, steps=10)) for s in range(6)]
    adjacent = [Job(RunConfig(task="adjacent", encoding="rope", seed=s, steps=10)) for s in range(2)]
    stream, clock = io.StringIO(), _Clock()
    board = LiveBoard(
        order + adjacent, _EmptyStore(), progress=True, live=True, per_step=False, stream=stream, clock=clock
    )
    clock.now += 10  # an order run: 10 s
    board.finished(order[0], _record(order[0], 0.9))
    clock.now += 30  # an adjacent run: 30 s
    board.finished(adjacent[0], _record(adjacent[0], 0.9))
    etas = re.findall(r"ETA (\d+:\d\d:\d\d)", stream.getvalue())
    # left: 5 order runs at 10 s and 1 adjacent run at 30 s (a plain mean would say 6 × 20 = 120 s)
    assert _seconds(etas[-1]) == 5 * 10 + 30


def test_an_encoding_or_task_not_seen_yet_is_predicted_by_its_steps_and_batch():
    jobs = [Job(RunConfig(task="order", encoding=e, seed=0, steps=10, batch_size=8)) for e in ("rope", "alibi")]
    # adjacent as the quick suite runs it: more steps and a larger batch than order
    jobs.append(Job(RunConfig(task="adjacent", encoding="rope", seed=0, steps=40, batch_size=16)))
    stream, clock = io.StringIO(), _Clock()
    board = LiveBoard(jobs, _EmptyStore(), progress=True, live=True, per_step=False, stream=stream, clock=clock)
    clock.now += 12
    board.finished(jobs[0], _record(jobs[0], 0.9))
    # 12 s for 10 steps × 8 examples: 0.15 s per example; alibi on order 80 examples, adjacent 640
    assert board.eta() == pytest.approx(0.15 * 80 + 0.15 * 640)


def test_a_run_at_chance_says_so_on_its_line():
    jobs = [Job(RunConfig(task="order", encoding="none", seed=s, steps=10)) for s in range(2)]
    stream = io.StringIO()
    board = LiveBoard(jobs, _EmptyStore(), progress=True, live=True, per_step=False, stream=stream)
    board.finished(jobs[0], _record(jobs[0], 0.5))  # order's chance is 50 %
    board.finished(jobs[1], _record(jobs[1], 0.99))
    first, second = stream.getvalue().splitlines()
    assert "did not learn (at chance in distribution)" in first
    assert "did not learn" not in second
