"""The HTML renderer of the model: ``report.html``, one self-contained page (CSS inline, plots embedded).

:func:`report_page` writes the sections a newcomer needs (tasks, results, plots, the published numbers,
failures, settings, environment) from a :class:`~.model.RunSet`; each task's table (:func:`task_table`)
marks the best value of each column in bold and cells at chance in grey, with a swatch of the encoding's
plot style. It imports the model, the lower modules of the reporting package and the published table's
model (:func:`.markdown.published`); of the plots only what its note says of them (it embeds the files they
wrote, never draws).
"""

from __future__ import annotations

import base64
import html
from pathlib import Path
from typing import Any

from ..outcomes import LEARNED_SHARE, is_pct
from .format import AHEAD_NOTE, SUMMARY_NOTE, column_label, fmt
from .markdown import published
from .model import RunSet, TaskTable, label_text
from .plots import HEATMAP_ROWS
from .styles import GLYPHS
from .verdicts import PROBLEM_TEXT, no_problems_text

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;max-width:1200px;margin:1.5em auto;
padding:0 1em;color:#222;line-height:1.4}
h1{margin-bottom:.2em} h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:1.6em} h3{margin-bottom:.3em}
.meta{color:#555} nav a{margin-right:1em}
table{border-collapse:collapse;margin:.5em 0 1em;font-size:90%}
td,th{border:1px solid #ccc;padding:3px 8px;text-align:right;vertical-align:top}
th{background:#f3f3f3} td:nth-child(2),th:nth-child(2){text-align:left}
table.left td,table.left th{text-align:left}
tr.chance td{color:#777;font-style:italic;background:#fafafa}
td.best{font-weight:bold} td.low{color:#999}
.verdict{background:#eef5ee;padding:.3em .5em;border-left:3px solid #5a5}
.sw{font-size:110%} img{max-width:100%}
pre{white-space:pre-wrap;font-size:85%;background:#f7f7f7;padding:.4em;margin:.2em 0}
.note{color:#555;font-size:90%} .warn{color:#8a4b00;background:#fff4e0;padding:.3em .5em}
"""

#: the note under each task's table: what its marks mean (the Markdown's note says the same with italics)
TABLE_NOTE = (
    "best value of each column in bold; in grey: at chance (less than {share} of the way "
    "from chance to a perfect score; the Failures list uses the same rule); one seed: its value, no ±; "
    "seeds split: seeds on both sides of half-way between chance and a perfect score, each shown; "
    "s/run: mean training seconds of a run (wall time of the training loop, which depends on the machine "
    "and its load)."
).format(share=f"{LEARNED_SHARE:.0%}")


def html_table(
    head: list[str], body: list[list[Any]], cls: str = "", *, row_classes: dict[int, str] | None = None
) -> str:
    """A table of already escaped cells (no head row where every head cell is empty). A cell is its text, or
    (class, text) for a cell with a class; ``row_classes``: the class of a row of ``body`` by its index."""

    def td(c: Any) -> str:
        return f"<td class={c[0]}>{c[1]}</td>" if isinstance(c, tuple) else f"<td>{c}</td>"

    row_classes = row_classes or {}
    out = [f"<table{f' class={cls}' if cls else ''}>"]
    if any(head):
        out.append("<tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>")
    for i, row in enumerate(body):
        tr = f"<tr class={row_classes[i]}>" if i in row_classes else "<tr>"
        out.append(tr + "".join(td(c) for c in row) + "</tr>")
    return "\n".join(out) + "\n</table>"


def _escaped(head: list[str], body: list[list[str]], cls: str = "left") -> str:
    return html_table([html.escape(h) for h in head], [[html.escape(c) for c in row] for row in body], cls)


def _swatch(style: dict[str, Any] | None) -> str:
    if not style:
        return ""
    return f'<span class=sw style="color:{style["color"]}">{GLYPHS.get(style["marker"], "●")}</span> '


def task_table(t: TaskTable, styles: dict[str, dict[str, Any]]) -> list[str]:
    """The HTML of one task's table: heading, verdict, note, warning and the table with its chance row."""
    metric = t.metric
    unit = f"{metric} %" if is_pct(metric) else metric
    body = [f"<h3>{html.escape(t.task)}</h3>"]
    body.append(f"<p class=verdict><strong>Verdict:</strong> {html.escape(t.verdict)}</p>")
    body.append(
        f"<p class=note>{html.escape(unit)} ({'higher' if t.higher else 'lower'} is better), mean ± std over seeds"
        + (f"; {t.trained}" if t.trained else "")
        + f"; {TABLE_NOTE}</p>"
    )
    if t.warning:
        body.append(f"<p class=warn><strong>Warning:</strong> {html.escape(t.warning)}.</p>")
    head = [
        "#",
        "encoding",
        *[html.escape(column_label(n, t.train_max)) for n in t.labels],
        t.summary,
        "ahead of",
        "seeds",
        "s/run",
    ]
    table: list[list[Any]] = []
    for i, r in enumerate(t.rows, 1):
        cells = [str(i), _swatch(styles.get(r["label"])) + html.escape(label_text(r))]
        for n in t.labels:
            v = r["values"].get(n)
            text = html.escape(t.cell(r, n))
            if t.at_chance(r, n):
                cells.append(("low", f"<span>{text}</span>"))
            elif v is not None and n in t.best and v[0] == t.best[n]:
                cells.append(("best", f"<span>{text}</span>"))
            else:
                cells.append(text)
        cells += [fmt(t.value(r), metric), html.escape(t.ahead_text(r)), str(r["seeds"]), f"{r['seconds']:.1f}"]
        table.append(cells)
    chance = ["?" if c is None else fmt(c, metric) for c in t.chance]
    table.append(["", "chance", *chance, "", "", "", ""])
    body.append(html_table(head, table, row_classes={len(table) - 1: "chance"}))
    summary = SUMMARY_NOTE + " " if t.summary == "mean > train" else ""
    body.append(f"<p class=note>{html.escape(summary + AHEAD_NOTE)}</p>")
    for r in t.rows:
        if r.get("control"):
            body.append(
                f"<p class=note>(control): {html.escape(r['label'])} is at chance by design "
                f"({html.escape(r['control'])}).</p>"
            )
    return body


def _published_html(runs: RunSet, spec: dict[str, Any]) -> str:
    p = published(spec, runs.rows)
    if p is None:
        return ""
    parts = [f"<p>{html.escape(f'Published — {p.source}')}</p>"]
    if p.body:
        parts.append(_escaped(p.head, p.body))
    if p.text:
        parts.append(f"<p>{html.escape(p.text)}</p>")
    parts.append(f"<p><em>{html.escape(p.note)}</em></p>")
    return "\n".join(parts)


def _image(path: Path, alt: str) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<h3>{alt.capitalize()}</h3><p><img src="data:image/png;base64,{data}" alt="{alt}"></p>'


def report_page(
    runs: RunSet,
    *,
    title: str,
    description: str,
    env: dict[str, str],
    published_spec: dict[str, Any] | None,
    pictures: dict[str, Path],
    beside: list[str],
) -> str:
    """The text of ``report.html``. ``pictures``: the plots drawn (``{"plot": ..., "curves": ...}``); ``beside``:
    the names of the files written beside the page."""
    sections = [("tasks", "Tasks"), ("results", "Results"), ("plots", "Plots")]
    if published_spec:
        sections.append(("published", "Published"))
    sections += [("failures", "Failures"), ("settings", "Settings"), ("environment", "Environment")]
    body = [f"<h1>{html.escape(title)}</h1>"]
    body.append(
        f"<p class=meta>{html.escape(runs.summary())}. Written {html.escape(env['date'])} "
        f"by posenc {html.escape(env['posenc'])}.</p>"
    )
    if description:
        body.append(f"<p>{html.escape(description)}</p>")
    body.append("<nav>" + "".join(f'<a href="#{a}">{t}</a>' for a, t in sections) + "</nav>")

    body.append('<h2 id="tasks">Tasks</h2>')
    keys = ("task", "description", "metric", "chance")
    body.append(_escaped(["task", "what it is", "metric", "chance"], [[d[k] for k in keys] for d in runs.tasks]))
    body.append(
        "<p class=note>Chance: what a model that learned nothing scores (the best answer that ignores the "
        "input: the majority class, or for perplexity a uniform guess over the vocabulary), "
        "as the task declares it (<code>Task.chance</code>); drawn as a grey band in the plots.</p>"
    )

    body.append('<h2 id="results">Results</h2>')
    for t in runs.tables:
        body += task_table(t, runs.styles)

    body.append('<h2 id="plots">Plots</h2>')
    if pictures:
        for key, alt in (("plot", "metric against test length"), ("curves", "training curves")):
            if key in pictures:
                body.append(_image(pictures[key], alt))
        body.append(
            "<p class=note>One colour and marker per encoding in every panel; grey band: chance; shaded: "
            "lengths longer than training; error bars: ± std over seeds, cut at the metric's range; small hollow "
            "marks: each seed; a task with more than "
            f"{HEATMAP_ROWS} rows is a heatmap (mean over seeds, each seed below it, seeds that disagree framed); "
            "a chance level far off the data (perplexity) is written in the panel, not drawn.</p>"
        )
    else:
        body.append("<p>No plots: matplotlib is not installed (<code>pip install 'posenc[plots]'</code>).</p>")

    if published_spec:
        body.append('<h2 id="published">Beside the published numbers</h2>')
        body.append(_published_html(runs, published_spec))

    body.append('<h2 id="failures">Failures</h2>')
    if not any(runs.problems.values()):
        body.append(f"<p>{html.escape(no_problems_text(runs.rows))}</p>")
    for kind, items in runs.problems.items():
        if not items:
            continue
        body.append(f"<h3>{html.escape(PROBLEM_TEXT[kind])}</h3><ul>")
        for p in items:
            err = html.escape(p["error"])
            body.append(
                f"<li>{html.escape(p['run'])}: <pre>{err}</pre></li>"
                if kind == "failed"
                else f"<li>{html.escape(p['run'])}: {err}</li>"
            )
        body.append("</ul>")

    body.append('<h2 id="settings">Settings</h2>')
    head, grid = runs.settings
    body.append(_escaped(head, grid) if grid else "<p>No finished runs.</p>")

    body.append('<h2 id="environment">Environment</h2>')
    body.append("<h3>Where the runs were trained</h3>")
    body.append("<p class=note>Each run records the environment of the process that trained it, per suite:</p>")
    env_head, env_body = runs.environments
    body.append(html_table(env_head, [[html.escape(c) for c in row] for row in env_body], "left"))
    for task, text in runs.mixed.items():
        body.append(f"<p class=warn><strong>Warning</strong>, {html.escape(task)}: {html.escape(text)}.</p>")
    body.append("<h3>This report</h3>")
    body.append(
        "<p class=note>Of the process that wrote this report "
        "(the runs may have run in other processes or on other machines).</p>"
    )
    body.append(_escaped(["", ""], [[k, v] for k, v in env.items()]))
    body.append("<p class=note>Files beside this page: " + ", ".join(map(html.escape, beside)) + ", report.html.</p>")
    return (
        f"<!doctype html>\n<html lang=en><head><meta charset=utf-8><title>{html.escape(title)}</title>\n"
        f"<style>{CSS}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    )
