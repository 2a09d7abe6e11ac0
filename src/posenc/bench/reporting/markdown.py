"""The Markdown renderer of the model: the tables of ``leaderboard.md`` and of the results page.

:func:`task_table` writes one :class:`~.model.TaskTable` (its verdict, warning, cells in italics where at
chance, the chance row and the note); :func:`published_table` the paper's numbers beside our ranks
(:func:`published`: the model of that table, which the HTML report renders too); :func:`problem_lines`
the failures; :func:`leaderboard_page` the whole ``leaderboard.md``. It imports the model and the lower
modules of the reporting package, never the HTML renderer or the plots.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..outcomes import is_pct
from .format import (
    AHEAD_NOTE,
    SUMMARY_NOTE,
    TABLE_NOTE,
    column_label,
    fmt,
    md_escape,
    md_table,
    summary_name,
    summary_value,
)
from .model import RunSet, TaskTable, label_text, task_tables
from .verdicts import PROBLEM_TEXT, no_problems_text


def task_table(t: TaskTable) -> list[str]:
    """The lines of one task's table: heading, verdict, warning, the rows, the chance row and the note."""
    metric = t.metric
    head = ["#", "encoding", *[column_label(n, t.train_max) for n in t.labels], t.summary, "ahead of", "s/run"]
    better = "higher" if t.higher else "lower"
    trained = f", {t.trained}" if t.trained else ""
    what = f"{metric} %" if is_pct(metric) else metric
    out = [f"**{t.task}** — {what} ({better} is better; mean ± std over seeds){trained}\n"]
    out.append(f"**Verdict:** {t.verdict}\n")
    if t.warning:
        out.append(f"> **Warning:** {t.warning}.\n")
    out.append("| " + " | ".join(head) + " |")
    out.append("|" + "---|" * len(head))
    for i, r in enumerate(t.rows, 1):
        cells = [str(i), label_text(r)]
        for n in t.labels:
            text = t.cell(r, n)
            cells.append(f"*{text}*" if t.at_chance(r, n) else text)
        cells += [fmt(t.value(r), metric), t.ahead_text(r), f"{r['seconds']:.1f}"]
        out.append("| " + " | ".join(cells) + " |")
    if any(c is not None for c in t.chance):
        out.append(
            "|  | _chance_ | " + " | ".join("?" if c is None else fmt(c, metric) for c in t.chance) + " |  |  |  |"
        )
    note = TABLE_NOTE + (" " + SUMMARY_NOTE if t.summary == "mean > train" else "") + " " + AHEAD_NOTE
    controls = [r for r in t.rows if r.get("control")]
    if controls:
        note += " " + " ".join(f"(control): {r['label']} is at chance by design ({r['control']})." for r in controls)
    return [*out, "", f"_{note}_", ""]


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """Every task's table (:func:`task_table`) of leaderboard rows, as Markdown (controls as the rows mark them:
    :func:`.rows.leaderboard`'s ``controls``)."""
    return "\n".join(line for t in task_tables(rows) for line in task_table(t))


# ---------------------------------------------------------------------------- published numbers
#: what the published table says under it where the suite says nothing
PUBLISHED_NOTE = (
    "Our models are tiny and trained briefly on CPU: compare the shape (the ranking, the trend), not the values."
)


@dataclass
class Published:
    """The paper's table beside our ranks: its source, a table (head, body; none without rows), text and a note."""

    #: the paper, and the metric where the suite names it: ``Kazemnejad et al. 2023 (accuracy %)``
    source: str
    head: list[str] = field(default_factory=list)
    body: list[list[str]] = field(default_factory=list)
    text: str = ""
    note: str = PUBLISHED_NOTE


def published(spec: dict[str, Any], rows: list[dict[str, Any]] | None = None) -> Published | None:
    """The model of a suite's ``published`` section beside leaderboard ``rows`` (None: no section)."""
    if not spec:
        return None
    source = str(spec.get("source", "")) + (f" ({spec['metric']})" if spec.get("metric") else "")
    out = Published(source, text=str(spec.get("text") or ""), note=spec.get("note", PUBLISHED_NOTE))
    prow = spec.get("rows", {})
    ours = {}
    sub: list[dict[str, Any]] = []  # no runs yet (a report of an empty store): the paper's table alone
    if rows:
        task = spec.get("task")
        sub = [r for r in rows if task is None or r["task"] == task]
        ours = {r["label"]: (i, r) for i, r in enumerate(sub, 1)}
    if prow:
        summary = summary_name(sub) if sub else "mean > train"
        out.head = ["encoding", *(spec.get("columns") or ["value"]), "our rank", f"ours ({summary})"]
        for lab, vals in prow.items():
            vals = vals if isinstance(vals, list) else [vals]
            rank, ourv = "—", "—"
            if lab in ours:
                i, r = ours[lab]
                rank = str(i) + (
                    " (control: at chance)"
                    if r.get("control") and r.get("learned") is False
                    else " (did not learn: at chance)"
                    if r.get("learned") is False
                    else ""
                )
                ourv = fmt(summary_value(r, summary), r["metric"])
            out.body.append([lab, *map(str, vals), rank, ourv])
    return out


def published_table(published_spec: dict[str, Any], rows: list[dict[str, Any]] | None = None) -> str:
    """The paper's table (Markdown) with our rank beside each row, where our labels match."""
    p = published(published_spec, rows)
    if p is None:
        return ""
    out = [f"**Published** — {p.source}"]
    if p.body:
        out += ["", *md_table(p.head, p.body)]
    if p.text:
        out += ["", p.text]
    return "\n".join([*out, "", f"_{p.note}_", ""])


# ---------------------------------------------------------------------------- failures
def problem_lines(probs: dict[str, list[dict[str, str]]], *, escape: bool = False) -> list[str]:
    """Per kind of problem (:func:`.verdicts.problems`) with items: its heading and one item per line (the last
    line of an error), each block followed by an empty line. ``escape``: make each item one line of Markdown."""
    out: list[str] = []
    for kind, items in probs.items():
        if items:
            out += [f"**{PROBLEM_TEXT[kind]}**", ""]
            for p in items:
                last = p["error"].splitlines()[-1] if p["error"] else ""
                out.append(f"- {p['run']}: {md_escape(last) if escape else last}")
            out += [""]
    return out


# ---------------------------------------------------------------------------- leaderboard.md
def leaderboard_page(
    runs: RunSet,
    *,
    title: str,
    description: str,
    env: dict[str, str],
    published_spec: dict[str, Any] | None,
    pictures: list[str],
) -> str:
    """``leaderboard.md``: the sections of ``report.html`` without the plots (their files named instead)."""
    out = [f"# {title}", "", f"_{runs.summary()}. Written {env['date']} by posenc {env['posenc']}._", ""]
    if description:
        out += [description, ""]
    out += ["## Tasks", ""]
    out += md_table(
        ["task", "what it is", "metric", "chance"],
        [[d["task"], d["description"], d["metric"], d["chance"]] for d in runs.tasks],
    )
    out += ["", "## Results", "", "\n".join(line for t in runs.tables for line in task_table(t))]
    if pictures:
        out += ["Plots: " + ", ".join(f"`{f}`" for f in pictures) + " (embedded in `report.html`).", ""]
    pub = published_table(published_spec or {}, runs.rows)
    if pub:
        out += ["## Beside the published numbers", "", pub]
    out += ["## Failures", ""]
    if not any(runs.problems.values()):
        out += [no_problems_text(runs.rows), ""]
    out += problem_lines(runs.problems)
    head, grid = runs.settings
    if grid:
        out += ["## Settings", ""]
        out += md_table(head, grid)
        out += [""]
    out += ["## Environment", "", "Where the runs were trained (each run records its own), per suite:", ""]
    out += md_table(*runs.environments)
    if runs.mixed:
        out += ["", *(f"- **Warning**, {task}: {text}." for task, text in runs.mixed.items())]
    out += ["", "Of the process that wrote this report:", ""]
    out += md_table(["", ""], [[k, v] for k, v in env.items()])
    return "\n".join(out) + "\n"
