"""Leaderboard, plots and report of a suite's results: the public face of :mod:`posenc.bench.reporting`.

Runs are grouped by task and *label* (the suite's display name of an encoding with its options,
e.g. ``shaw k=4``; by default the encoding name plus its options), and summarised as mean ± std over
seeds (each seed's value kept: ``per_seed``; seeds that split flagged: :func:`seeds_disagree`), beside
each task's chance level (``Task.chance``; one rule says what is *at chance*: :func:`at_chance`). Each
task gets a :func:`verdict`: who won, by how much, and whether the gap between the first two rows is
separable (:mod:`posenc.bench.reporting.separation`: an interval within the metric's range, on the test
examples pooled over seeds and lengths where the task counts them, every seed agreeing), and which rows
are separably ahead of the suite's controls (``[controls]``: at chance by design, never a failure while
at chance). Where a suite carries the paper's numbers (``published``), the report shows
them beside ours. Every plot gives an encoding the same colour and marker (:func:`encoding_styles`), and
``report.html`` is one self-contained page (:func:`write_report`).

The code lives in the reporting package, one data model and its renderers (see its docstring); this
module keeps the names that callers import from ``posenc.bench.report``. It imports only the reporting
package and :mod:`posenc.bench.outcomes`.
"""

from __future__ import annotations

from .outcomes import (
    LEARNED_SHARE,
    PCT_METRICS,
    PPL_METRICS,
    _chance_of,
    at_chance,
    chance_level,
    ranking_labels,
    run_learned,
    trained_lengths,
)
from .reporting.context import (
    ENV_COLUMNS,
    SETTING_NAMES,
    environment,
    mixed_environments,
    run_environments,
    settings,
    settings_grid,
    tasks_info,
)
from .reporting.format import TABLE_NOTE
from .reporting.format import trained_text as _trained_text
from .reporting.html import CSS
from .reporting.markdown import markdown_table, published_table
from .reporting.model import RunSet, TaskTable
from .reporting.plots import HEATMAP_ROWS, curves_figure, metric_figure, plot, plot_curves
from .reporting.rows import SPLIT_SHARE, leaderboard, seeds_disagree
from .reporting.styles import CHANCE_STYLE, DASHES, GLYPHS, MARKERS, PALETTE, encoding_styles
from .reporting.verdicts import PROBLEM_TEXT, T975, learning_warnings, paired_interval, problems, verdict
from .reporting.write import write_report

__all__ = [
    "CHANCE_STYLE",
    "CSS",
    "DASHES",
    "ENV_COLUMNS",
    "GLYPHS",
    "HEATMAP_ROWS",
    "LEARNED_SHARE",
    "MARKERS",
    "PALETTE",
    "PCT_METRICS",
    "PPL_METRICS",
    "PROBLEM_TEXT",
    "SETTING_NAMES",
    "SPLIT_SHARE",
    "T975",
    "TABLE_NOTE",
    "RunSet",
    "TaskTable",
    "_chance_of",
    "_trained_text",
    "at_chance",
    "chance_level",
    "curves_figure",
    "encoding_styles",
    "environment",
    "leaderboard",
    "learning_warnings",
    "markdown_table",
    "metric_figure",
    "mixed_environments",
    "paired_interval",
    "plot",
    "plot_curves",
    "problems",
    "published_table",
    "ranking_labels",
    "run_environments",
    "run_learned",
    "seeds_disagree",
    "settings",
    "settings_grid",
    "tasks_info",
    "trained_lengths",
    "verdict",
    "write_report",
]
