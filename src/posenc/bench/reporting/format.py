"""How the reports write numbers and headings: one place for every renderer (HTML, Markdown, plots).

A metric in :data:`~posenc.bench.outcomes.PCT_METRICS` is shown in percent with one decimal, any other
with two; a cell is ``mean ± std``, ``value (1 seed)`` or the seeds' values where they split; a length
column is ``L=64 (train)``. It imports only :mod:`posenc.bench.outcomes`.
"""

from __future__ import annotations

import re
from typing import Any

from ..outcomes import LEARNED_SHARE, is_pct

#: the note under every table (Markdown); the HTML report says the same with grey for italics
TABLE_NOTE = (
    f"Italics: at chance (less than {LEARNED_SHARE:.0%} of the way from chance to a perfect score). "
    "One seed: its value and (1 seed), no ±. Seeds split: the seeds disagree (some on each side of half-way "
    "between chance and a perfect score), each seed's value shown. s/run: mean training seconds of a run "
    "(wall time of the training loop; it depends on the machine and its load)."
)


#: what a summary column "mean > train" is, under a table that has one
SUMMARY_NOTE = (
    "mean > train: the mean over the test lengths longer than the longest training length, i.e. how well the "
    "encoding extrapolates; the rows are ranked by it (a row can win it without being the best in distribution)."
)


#: what the tables' "ahead of" column means (the verdict's rule: :mod:`.separation`)
AHEAD_NOTE = (
    "Ahead of: the rows (by rank) this row is separably ahead of on the summary column: the interval of the "
    "difference (95% for all the table's pairs together; on the test examples pooled over seeds and lengths where "
    "the task counts them) excludes 0 and every seed agrees."
)


def fmt(x: float, metric: str) -> str:
    """A value of ``metric``: ``87.5`` (percent), ``3.14``, ``n/a`` (NaN) or ``inf``."""
    if x != x:
        return "n/a"
    if x == float("inf"):
        return "inf"
    return f"{100 * x:.1f}" if is_pct(metric) else f"{x:.2f}"


def unit(metric: str) -> str:
    """``" %"`` after a percentage, else nothing."""
    return " %" if is_pct(metric) else ""


def amount(x: float, metric: str) -> str:
    """A difference: ``12.5 points`` (percent) or ``0.25 in perplexity``."""
    return f"{100 * x:.1f} points" if is_pct(metric) else f"{x:.2f} in {metric}"


def cell(
    v: tuple[float, float] | None, metric: str = "accuracy", row: dict[str, Any] | None = None, key: str = ""
) -> str:
    """``mean ± std``; one seed: ``value (1 seed)`` (never ``± 0.0``); seeds that disagree (``row["split"]``):
    the seeds' values after it, e.g. ``74.5 ± 36.0 (seeds split: 49.0 / 100.0)``."""
    if v is None:
        return "n/a"
    m, s = v
    if row is not None and row.get("seeds") == 1:
        return f"{fmt(m, metric)} (1 seed)"
    text = f"{fmt(m, metric)} ± {fmt(s, metric)}"
    if row is not None and row.get("split", {}).get(key):
        text += " (seeds split: " + " / ".join(fmt(x, metric) for x in sorted(row["per_seed"][key])) + ")"
    return text


def column_label(n: str, train_max: int) -> str:
    """The heading of an evaluation column: ``L=16 (train)``, ``L=64``, or a split's name."""
    if not n.isdigit():
        return n
    return f"L={n}{' (train)' if int(n) <= train_max else ''}"


def summary_name(rows: list[dict[str, Any]]) -> str:
    """What a task's summary column is: ``mean > train``, ``mean`` or ``ranked by test``."""
    if rows[0].get("ranked_by"):
        return "ranked by " + ", ".join(rows[0]["ranked_by"])
    tm = rows[0]["train_max"]
    has_ood = any(k.isdigit() and int(k) > tm for r in rows for k in r["values"])
    return "mean > train" if has_ood else "mean"


def summary_value(row: dict[str, Any], summary: str) -> float:
    """The row's value in the summary column :func:`summary_name` names."""
    return row["extrapolation"] if summary == "mean > train" else row["in_distribution"]


def trained_text(rows: dict[str, Any] | list[dict[str, Any]]) -> str:
    """The text "trained on lengths ≤ 16" / "trained on length 64" of a row, or of a task's rows ("trained on length
    64; some rows up to 256" where they differ, e.g. fine-tuned rows), or "" where the task claims none."""
    trs = sorted({tuple(r["trained"]) for r in ([rows] if isinstance(rows, dict) else rows) if r.get("trained")})
    if not trs:
        return ""
    lo, hi = trs[0], trs[-1]
    text = f"trained on length {lo[1]}" if lo[0] == lo[1] else f"trained on lengths ≤ {lo[1]}"
    return text if hi[1] == lo[1] else f"{text}; some rows up to {hi[1]}"


def md_table(head: list[str], body: list[list[str]]) -> list[str]:
    """The lines of a Markdown table (``|`` in a cell escaped, line breaks as spaces)."""
    esc = [[c.replace("|", "\\|").replace("\n", " ") for c in row] for row in [head, *body]]
    return ["| " + " | ".join(esc[0]) + " |", "|" + "---|" * len(head), *("| " + " | ".join(r) + " |" for r in esc[1:])]


def md_escape(text: str) -> str:
    """``text`` fit for one cell or line of Markdown."""
    return text.replace("|", "\\|").replace("\n", " ")


def anchor(name: str) -> str:
    """GitHub's anchor of a heading ``## name``."""
    return re.sub(r"[^\w\- ]", "", name.lower()).replace(" ", "-")
