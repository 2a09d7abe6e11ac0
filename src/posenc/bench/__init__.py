"""``posenc bench``: train small models with each encoding and test how they extrapolate.

>>> from posenc.bench import quick_suite, run_suite, write_report
>>> results = run_suite(quick_suite(), "posenc-results/quick")      # doctest: +SKIP
>>> write_report(results, "posenc-results/quick")                   # doctest: +SKIP
"""

from __future__ import annotations

from .api import Task, available_tasks, get_task, register_task
from .report import leaderboard, markdown_table, write_report
from .runner import ResultStore, RunConfig, run_one, run_suite

QUICK_ENCODINGS = ("none", "sinusoidal", "learned", "rope", "binary", "normalized")


def quick_suite(
    encodings: tuple[str, ...] | list[str] = QUICK_ENCODINGS,
    tasks: tuple[str, ...] | list[str] = ("order", "adjacent"),
    seeds: tuple[int, ...] | list[int] = (0, 1),
    **overrides: object,
) -> list[RunConfig]:
    """The default suite: every (task, encoding, seed), trained on lengths 4..16, tested to 64."""
    return [RunConfig(task=t, encoding=e, seed=s, **overrides) for t in tasks for e in encodings for s in seeds]  # type: ignore[arg-type]


__all__ = [
    "QUICK_ENCODINGS",
    "ResultStore",
    "RunConfig",
    "Task",
    "available_tasks",
    "get_task",
    "register_task",
    "leaderboard",
    "markdown_table",
    "quick_suite",
    "run_one",
    "run_suite",
    "write_report",
]
