"""``posenc bench``: train small models with each encoding and test how they extrapolate.

>>> from posenc import bench
>>> res = bench.run_suite("quick", out="posenc-results/quick", workers=2)    # doctest: +SKIP
>>> bench.leaderboard(bench.results("posenc-results/quick"))                 # doctest: +SKIP
>>> bench.write_report(res, "posenc-results/quick")                          # doctest: +SKIP

Suites are TOML files (:func:`load_suite`, :func:`available_suites`); results go
to an SQLite store (:mod:`posenc.bench.store`); runs execute in this process, a
process pool, on Ray, or across torchrun ranks (:mod:`posenc.bench.executors`).
See ``docs/bench.md``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._lazy import lazy_names

# public name -> the submodule that defines it, imported on first use (PEP 562) so that
# `posenc bench --help` does not import torch
_LAZY: dict[str, str] = {
    "Task": "api",
    "available_tasks": "api",
    "get_task": "api",
    "load_tasks": "api",
    "register_task": "api",
    "task_version": "api",
    "leaderboard": "report",
    "markdown_table": "report",
    "write_report": "report",
    "Job": "types",
    "ResultStore": "runner",
    "RunConfig": "types",
    "RunFailedError": "runner",
    "run_one": "api",
    "run_suite": "runner",
    "SQLiteStore": "store",
    "StoreCorruptError": "store",
    "StoreError": "store",
    "StoreLockedError": "store",
    "open_store": "store",
    "Suite": "suites",
    "available_suites": "suites",
    "load_suite": "suites",
}

if TYPE_CHECKING:
    from .api import Task, available_tasks, get_task, load_tasks, register_task, run_one, task_version
    from .report import leaderboard, markdown_table, write_report
    from .runner import ResultStore, RunFailedError, run_suite
    from .store import SQLiteStore, StoreCorruptError, StoreError, StoreLockedError, open_store
    from .suites import Suite, available_suites, load_suite
    from .types import Job, RunConfig

QUICK_ENCODINGS = ("none", "sinusoidal", "learned", "rope", "binary", "normalized")


__getattr__, __dir__ = lazy_names(__name__, _LAZY)


def quick_suite(
    encodings: tuple[str, ...] | list[str] = QUICK_ENCODINGS,
    tasks: tuple[str, ...] | list[str] = ("order", "adjacent"),
    seeds: tuple[int, ...] | list[int] = (0, 1),
    **overrides: object,
) -> list[RunConfig]:
    """The default suite as configs: every (task, encoding, seed), trained on lengths 4..16, tested to 64.

    Each task has the settings of its grid in the quick suite's file (``adjacent`` has its own, see
    ``suites/quick.toml``); a task the suite does not name gets those of its first grid; ``overrides`` on top.
    """
    from .suites import load_suite
    from .types import RunConfig

    grids = load_suite("quick").grids
    per_task = {t: g.settings for g in reversed(grids) for t in g.tasks}
    return [
        RunConfig(task=t, encoding=e, seed=s, **{**per_task.get(t, grids[0].settings), **overrides})  # type: ignore[arg-type]
        for t in tasks
        for e in encodings
        for s in seeds
    ]


def results(store: str | Path | SQLiteStore, **filters: Any) -> list[dict[str, Any]]:
    """Every finished run in a store (a results.sqlite file or the folder holding one).

    ``task=`` / ``encoding=`` keep only those runs.
    """
    from .store import open_store

    return open_store(store).results(**filters)


__all__ = [
    "QUICK_ENCODINGS",
    "Job",
    "ResultStore",
    "RunConfig",
    "RunFailedError",
    "SQLiteStore",
    "StoreCorruptError",
    "StoreError",
    "StoreLockedError",
    "Suite",
    "Task",
    "available_suites",
    "available_tasks",
    "get_task",
    "leaderboard",
    "load_suite",
    "load_tasks",
    "markdown_table",
    "open_store",
    "quick_suite",
    "register_task",
    "results",
    "run_one",
    "run_suite",
    "task_version",
    "write_report",
]
