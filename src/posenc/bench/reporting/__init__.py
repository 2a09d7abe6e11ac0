"""One reporting model of a set of benchmark runs, and its renderers.

The model (:mod:`.model`): a :class:`RunSet` of stored runs -> rows (mean ± std over seeds per task and
label: :mod:`.rows`) -> one :class:`TaskTable` per task (columns, cells, chance, summary column, verdict:
:mod:`.verdicts`), styles per encoding (:mod:`.styles`), problems, tasks, settings and environments
(:mod:`.context`). The renderers draw from it and only from it:

- :mod:`.markdown`: the tables of ``leaderboard.md`` and of the results page, the published numbers;
- :mod:`.html`: ``report.html``;
- :mod:`.plots`: the metric against length, and the training curves (matplotlib);
- :mod:`.page`, :mod:`.readme`: the results page (``docs/results.md``) of the suites' data
  (:mod:`.suite_data`) and the README's block of verdicts;
- :mod:`.write`: the files of ``posenc bench``'s report.

Layers inside the package, bottom to top: commands, format, styles -> rows -> verdicts -> context -> model ->
plots, markdown -> html -> write; model -> suite_data -> page, readme. The package sits above the runner in
posenc.bench (it may import anything of posenc.bench below it, and :mod:`posenc.extend`); only
:mod:`posenc.bench.report`, :mod:`posenc.bench.results_page` and the command line import it. The judgements
on single runs (chance, at chance) are :mod:`posenc.bench.outcomes`'s, shared with the live board.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..._lazy import lazy_names

# the names load on first use: ``posenc results --help`` reads reporting.commands without the model (nor torch)
_LAZY = {"RunSet": "model", "TaskTable": "model", "task_tables": "model", "leaderboard": "rows"}
_LAZY["write_report"] = "write"

if TYPE_CHECKING:
    from .model import RunSet, TaskTable, task_tables
    from .rows import leaderboard
    from .write import write_report

__all__ = ["RunSet", "TaskTable", "leaderboard", "task_tables", "write_report"]

__getattr__, __dir__ = lazy_names(__name__, _LAZY)
