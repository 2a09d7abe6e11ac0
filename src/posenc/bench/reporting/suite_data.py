"""The results page's data: one :class:`SuiteData` per suite, its runs read from the committed JSONL files.

``posenc results`` exports each suite's store to ``<data>/<suite>.jsonl`` (:func:`export_suite`) and builds
the page from those files alone (:func:`collect`, :func:`read_jsonl`, through a temporary store), so that the
page depends on committed text only. A :class:`SuiteData` carries the model of its runs (:attr:`SuiteData.runs`,
a :class:`~.model.RunSet`) and what the page says of the suite's findings. It imports the suites and the store
(layers below the reporting package) and the model.
"""

from __future__ import annotations

import datetime
import functools
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import PosencError
from .model import RunSet

if TYPE_CHECKING:
    from ..suites import Suite


def builtin_order() -> list[str]:
    """The built-in suites in the page's order: ``quick``, then the paper suites as ``posenc bench --list-suites``
    lists them."""
    from ..suites import available_suites

    names = available_suites()
    return (["quick"] if "quick" in names else []) + [n for n in names if n != "quick"]


def utc(t: float) -> datetime.datetime:
    """A Unix time as an aware UTC datetime."""
    return datetime.datetime.fromtimestamp(t, datetime.UTC)


@dataclass
class SuiteData:
    """One section of the page: the suite (None where its file cannot be loaded here) and its stored runs."""

    name: str
    #: how ``posenc bench --suite`` names it: the built-in name, or the file as given
    given: str
    suite: Suite | None
    error: str = ""
    #: finished runs, each with ``finished_at`` (Unix time)
    records: list[dict[str, Any]] = field(default_factory=list)
    failures: list[dict[str, Any]] = field(default_factory=list)
    #: the runs of the suite as its file stands (None: unknown)
    planned: int | None = None

    @property
    def bench_command(self) -> str:
        return f"posenc bench --suite {self.given} --workers 2"

    @property
    def ran(self) -> bool:
        return bool(self.records or self.failures)

    @functools.cached_property
    def runs(self) -> RunSet:
        """The model of the suite's runs and failures (read once the records are in)."""
        return RunSet(self.records, self.failures, self.suite.controls if self.suite is not None else None)

    @property
    def seeds(self) -> list[int]:
        return sorted({int(r["config"]["seed"]) for r in self.records})

    @property
    def last_finished(self) -> datetime.datetime | None:
        return utc(max(r["finished_at"] for r in self.records)) if self.records else None

    def stale_findings(self) -> list[Any]:
        """The findings of the suite written before its last run finished."""
        last = self.last_finished
        if self.suite is None or last is None:
            return []
        return [f for f in self.suite.findings if f.written_before(last)]


def load(given: str | Path) -> SuiteData:
    """The suite named (built-in) or given as a file, with no runs yet; one that does not load keeps its error."""
    from ..suites import _builtin_dir, load_suite

    text = str(given)
    try:
        suite = load_suite(given)
    except PosencError as exc:
        return SuiteData(
            name=Path(text).stem if text.endswith(".toml") else text, given=text, suite=None, error=str(exc)
        )
    builtin = suite.path is not None and suite.path.parent.resolve() == _builtin_dir().resolve()
    return SuiteData(
        name=suite.name,
        given=suite.name if builtin else text,
        suite=suite,
        planned=len(suite.jobs(check=False)),
    )


def export_suite(data: SuiteData, store_path: Path, data_dir: Path) -> int:
    """Write the runs and failures of ``data``'s suite in the store ``store_path`` to ``<data_dir>/<suite>.jsonl``
    (labels as the suite file gives them now); return how many lines (0: nothing of the suite, no file written)."""
    from ..store import SQLiteStore, write_jsonl

    if data.suite is None:
        return 0
    jobs = {j.key: j for j in data.suite.jobs(check=False)}
    with SQLiteStore(store_path) as store:
        lines = store.export_records(jobs)
    for line in lines:
        line["label"] = jobs[line["key"]].label
    if not lines:
        return 0
    return write_jsonl(data_dir / f"{data.name}.jsonl", lines)


def read_jsonl(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(runs, failures) of a file :meth:`SQLiteStore.export_jsonl` wrote, read through a temporary store: the
    runs with ``finished_at``, each list sorted by key."""
    from ..store import FAILED, SQLiteStore

    with tempfile.TemporaryDirectory(prefix="posenc-results-") as tmp:
        with SQLiteStore(Path(tmp) / "results.sqlite", migrate=False) as store:
            store.import_jsonl(path)
            lines = store.export_records()
    runs = [r for r in lines if not r.get(FAILED)]
    failures = [{k: v for k, v in r.items() if k != FAILED} for r in lines if r.get(FAILED)]
    return runs, failures


def collect(
    suites: list[str | Path] | None, data_dir: Path, *, loaded: list[SuiteData] | None = None
) -> list[SuiteData]:
    """Every suite of the page (default: :func:`builtin_order`; ``loaded``: suites loaded already) with its runs
    from ``<data_dir>/<suite>.jsonl``."""
    out = []
    if loaded is None:
        loaded = [load(given) for given in (suites if suites is not None else builtin_order())]
    for data in loaded:
        path = data_dir / f"{data.name}.jsonl"
        if path.is_file():
            data.records, data.failures = read_jsonl(path)
        out.append(data)
    return out


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-") or "x"


def images(data: SuiteData) -> dict[str, dict[str, str]]:
    """Per task of the suite's runs, the file names of its plots: ``{"metric": ..., "curves": ...}`` (curves
    only where a run logged its training loss)."""
    out: dict[str, dict[str, str]] = {}
    for task in sorted({r["config"]["task"] for r in data.records}):
        base = f"{data.name}-{_slug(task)}"
        out[task] = {"metric": f"{base}.png"}
        if any(r.get("curve") for r in data.records if r["config"]["task"] == task):
            out[task]["curves"] = f"{base}-curves.png"
        for sec in task_sections(data, task):
            if sec.draw is not None:
                out[task][f"section:{sec.slug}"] = f"{base}-{sec.slug}.png"
    return out


def task_sections(data: SuiteData, task: str) -> list[Any]:
    """The task's own sections of the page for the suite's runs of it (:meth:`~posenc.bench.types.Task.report_sections`;
    none for a task that cannot be loaded here)."""
    from ..types import get_task

    try:
        t = get_task(task)
    except PosencError:
        return []
    return list(t.report_sections([r for r in data.records if r["config"]["task"] == task]))
