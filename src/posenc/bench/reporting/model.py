"""The one data model of a set of runs that every report renders.

:class:`RunSet` is what the HTML report (:mod:`.html`), the Markdown leaderboard and results page
(:mod:`.markdown`, :mod:`.page`) and the README's block of verdicts (:mod:`.readme`) are drawn from:

- ``rows``: one per (task, label), mean ± std over seeds (:func:`.rows.leaderboard`);
- ``tables``: one :class:`TaskTable` per task: its columns, cells, chance level, summary column,
  verdict (:func:`.verdicts.verdict`), which rows each row is separably ahead of (:mod:`.separation`)
  and a warning where its runs come from different environments;
- ``styles``: one colour and marker per label for the plots (:mod:`.plots`) and the tables' swatches;
- ``problems``: failed runs, rows at chance (not the suite's controls: they are at chance by design), controls
  not at chance, lengths not reached; the tasks, settings and environments.

Its parts are computed when first asked for, so a renderer that needs only the tables pays for no more.
It imports the reporting package's lower modules (rows, verdicts, context, format, styles), never a renderer.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .context import mixed_environments, run_environments, settings_grid, tasks_info
from .format import cell, summary_name, summary_value, trained_text
from .rows import cell_at_chance, leaderboard, task_chance
from .separation import Separation, compare_all
from .styles import encoding_styles
from .verdicts import by_task, problems, verdict


@dataclass
class TaskTable:
    """One task's table: its ranked rows, the evaluation columns and what the table says about them."""

    task: str
    rows: list[dict[str, Any]]
    #: the warning where the task's runs were trained in different environments ("" where they were not)
    warning: str = ""

    @functools.cached_property
    def labels(self) -> list[str]:
        """The evaluation keys (columns): test lengths, then splits."""
        return list(self.rows[0]["values"])

    @property
    def metric(self) -> str:
        return self.rows[0]["metric"]

    @property
    def higher(self) -> bool:
        return self.rows[0]["higher_is_better"]

    @property
    def train_max(self) -> int:
        return self.rows[0]["train_max"]

    @functools.cached_property
    def summary(self) -> str:
        """The summary column's name (:func:`.format.summary_name`)."""
        return summary_name(self.rows)

    @functools.cached_property
    def trained(self) -> str:
        """ "trained on lengths ≤ 16", or "" where the task claims no training length."""
        return trained_text(self.rows)

    @functools.cached_property
    def separations(self) -> dict[tuple[str, str], Separation]:
        """Every pair of rows (``(a, b)``, ``a`` ranked above ``b``) at the level of the table's family of pairs."""
        return compare_all(self.rows)

    @functools.cached_property
    def verdict(self) -> str:
        return verdict(self.rows, self.separations)

    def ahead_of(self, row: dict[str, Any]) -> list[int]:
        """The ranks (1-based) of the rows that ``row`` is separably ahead of."""
        out = []
        for i, other in enumerate(self.rows, 1):
            sep = self.separations.get((row["label"], other["label"])) or self.separations.get(
                (other["label"], row["label"])
            )
            if other is not row and sep is not None and sep.winner == row["label"]:
                out.append(i)
        return out

    def ahead_text(self, row: dict[str, Any]) -> str:
        """The "ahead of" cell: ``all below``, ``#3–6, #8`` (ranks), or ``—``."""
        ranks = self.ahead_of(row)
        if not ranks:
            return "—"
        mine = next(i for i, r in enumerate(self.rows, 1) if r is row)
        if ranks == list(range(mine + 1, len(self.rows) + 1)) and len(ranks) > 1:
            return "all below"
        runs: list[list[int]] = []
        for k in ranks:
            if runs and k == runs[-1][-1] + 1:
                runs[-1].append(k)
            else:
                runs.append([k])
        return ", ".join(f"#{r[0]}" if len(r) == 1 else f"#{r[0]}–{r[-1]}" for r in runs)

    @functools.cached_property
    def chance(self) -> list[float | None]:
        """The task's chance level per column (None: unknown)."""
        return [task_chance(self.rows, n) for n in self.labels]

    @functools.cached_property
    def best(self) -> dict[str, float]:
        """The best mean of each column."""
        out = {}
        for n in self.labels:
            vals = [r["values"][n][0] for r in self.rows if r["values"].get(n) is not None]
            if vals:
                out[n] = max(vals) if self.higher else min(vals)
        return out

    def value(self, row: dict[str, Any]) -> float:
        """The row's value in the summary column."""
        return summary_value(row, self.summary)

    def cell(self, row: dict[str, Any], key: str) -> str:
        """The text of a row's cell (:func:`.format.cell`)."""
        return cell(row["values"].get(key), self.metric, row, key)

    def at_chance(self, row: dict[str, Any], key: str) -> bool:
        """Whether the row's cell is at chance (grey in HTML, italic in Markdown)."""
        return cell_at_chance(row, key)


def label_text(row: dict[str, Any]) -> str:
    """A row's label as the tables show it: ``none (control)`` for a control."""
    return f"{row['label']} (control)" if row.get("control") else row["label"]


def task_tables(rows: list[dict[str, Any]]) -> list[TaskTable]:
    """One :class:`TaskTable` per task of ``rows`` (as :func:`.rows.leaderboard` ranks them), by task name."""
    mixed = mixed_environments(rows)
    return [TaskTable(task, sub, mixed.get(task, "")) for task, sub in by_task(rows).items()]


@dataclass
class RunSet:
    """A set of finished runs (stored records) and failures, and everything the reports say about them."""

    results: list[dict[str, Any]]
    failures: list[dict[str, Any]] | None = None
    #: the suite's controls: label or encoding name -> why it is at chance by design (``[controls]``)
    controls: Mapping[str, str] | None = None

    @functools.cached_property
    def rows(self) -> list[dict[str, Any]]:
        """One row per (task, label), ranked within each task (:func:`.rows.leaderboard`)."""
        return leaderboard(self.results, self.controls)

    @functools.cached_property
    def tables(self) -> list[TaskTable]:
        return task_tables(self.rows)

    @functools.cached_property
    def styles(self) -> dict[str, dict[str, Any]]:
        return encoding_styles(r["label"] for r in self.rows)

    @functools.cached_property
    def problems(self) -> dict[str, list[dict[str, str]]]:
        return problems(self.rows, self.failures)

    @functools.cached_property
    def tasks(self) -> list[dict[str, str]]:
        return tasks_info(self.rows)

    @functools.cached_property
    def settings(self) -> tuple[list[str], list[list[str]]]:
        return settings_grid(self.results)

    @functools.cached_property
    def environments(self) -> tuple[list[str], list[list[str]]]:
        return run_environments(self.results)

    @property
    def mixed(self) -> dict[str, str]:
        """Per task whose runs come from different environments: what differs."""
        return {t.task: t.warning for t in self.tables if t.warning}

    def summary(self) -> str:
        """``12 finished runs of suite quick: 3 encodings × 2 tasks × 2 seeds; 1 run failed``."""
        results, rows = self.results, self.rows
        suites = sorted({str(r.get("suite")) for r in results if r.get("suite")})
        seeds = sorted({r["config"]["seed"] for r in results})
        n_fail = len(self.failures or [])
        return (
            f"{len(results)} finished run{'s' if len(results) != 1 else ''}"
            + (f" of suite {', '.join(suites)}" if suites else "")
            + f": {len({r['label'] for r in rows})} encodings × {len({r['task'] for r in rows})} tasks × "
            f"{len(seeds)} seed{'s' if len(seeds) != 1 else ''}"
            + (f"; {n_fail} run{'s' if n_fail != 1 else ''} failed" if n_fail else "")
        )
