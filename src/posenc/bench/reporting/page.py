"""The results page's text (``docs/results.md``): the Markdown renderer of each suite's model, and the page.

:func:`render` writes the page of a list of :class:`~.suite_data.SuiteData`: the summary of every suite
(:func:`summary_table`), then one :func:`section` per suite: what it is and the command that made it, when its
runs finished and how long they took, the machine, each task's table (:func:`.markdown.task_table`, the same
as ``leaderboard.md``'s) with its plots, the published numbers, the paired comparisons, the verdicts of the
suite file's ``[[findings]]`` and the problems; then the real model's section (``posenc extend``:
:func:`posenc.extend.report.page_section`). The text depends on the data alone, never on the date or the
machine that renders it. It imports the model, the Markdown renderer and :mod:`posenc.extend.report`.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from ..outcomes import is_pct
from .commands import CHECK, WRITE_FROM_DATA, WRITE_FROM_STORES
from .context import environments_warning, run_environments
from .format import anchor, md_escape, md_table
from .markdown import problem_lines, published_table, task_table
from .rows import mean_std
from .suite_data import SuiteData, images, task_sections, utc

INTRO = (
    "What posenc's benchmark suites measured: the quick suite, then one reduced reproduction per paper. "
    "Each section says what was run and with which command, when, for how long, on which machine and "
    "with which seeds; then per task the metric at each test length (mean ± std over seeds) with its plot, "
    "the paper's numbers beside ours, a verdict per finding of the paper, and the runs that failed. "
    "Our models are tiny and trained for minutes on CPU: compare the shape (the ranking, the trend over "
    "length), not the values. This page is generated; do not edit it by hand."
)


# ---------------------------------------------------------------------------- text
def _when(t: float) -> str:
    return f"{utc(t):%Y-%m-%d %H:%M} UTC"


def duration(seconds: float) -> str:
    """``42 s``, ``12 min 5 s``, ``3 h 05 min``."""
    s = round(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def measured_time(records: list[dict[str, Any]]) -> tuple[str, str]:
    """(long, short) texts of the time the runs took, from the records, saying what it is.

    The wall time from the first run's start to the last run's finish where every record has a
    ``started_at``; else the sum of the runs' training seconds (``train_seconds``), which is not a wall
    time (parallel workers overlap; evaluation and waiting are not in it).
    """
    if not records:
        return "", ""
    if all(isinstance(r.get("started_at"), int | float) for r in records):
        wall = max(r["finished_at"] for r in records) - min(r["started_at"] for r in records)
        text = duration(wall)
        return f"{text} wall time, from the first run's start to the last run's finish", f"{text} wall"
    total = sum(float(r.get("train_seconds") or 0.0) for r in records)
    text = duration(total)
    return (
        f"{text} of training, summed over the {len(records)} runs (the records carry no start times, so this is "
        "not a wall time: parallel workers overlap, and evaluation is not in it)",
        f"{text} summed over runs",
    )


def verdict_counts(data: SuiteData) -> str:
    """``2 reproduced, 1 partly`` (in :data:`~posenc.bench.suites.VERDICTS` order), or ``none yet``."""
    from ..suites import VERDICTS

    if data.suite is None or not data.suite.findings:
        return "none yet"
    n = Counter(f.verdict for f in data.suite.findings)
    text = ", ".join(f"{n[v]} {v}" for v in VERDICTS if n[v])
    own = sum(not f.as_published for f in data.suite.findings)
    if own:
        text += f" ({own} of them on posenc's question, not the paper's claim as published)"
    return text + (" (written before the latest runs)" if data.stale_findings() else "")


def tests_cell(tests: str) -> str:
    """The results page's cell for what a finding tests: the paper's claim as published, or posenc's question
    (in bold: a verdict on it says nothing for or against the paper)."""
    return "as published" if tests == "as published" else f"**{tests}**"


def summary_table(datas: list[SuiteData]) -> list[str]:
    """The page's summary: suite | seeds | runs | measured time | verdicts."""
    body = []
    for d in datas:
        if not d.ran:
            body.append([f"[{d.name}](#{anchor(d.name)})", "—", "not run yet", "—", verdict_counts(d)])
            continue
        runs = f"{len(d.records)}" + (f" of {d.planned}" if d.planned is not None else "")
        if d.failures:
            runs += f", {len(d.failures)} failed"
        measured = d.suite.measured if d.suite is not None and d.suite.measured else measured_time(d.records)[1]
        seeds = ", ".join(map(str, d.seeds)) or "—"
        body.append([f"[{d.name}](#{anchor(d.name)})", seeds, runs, measured, verdict_counts(d)])
    return md_table(["suite", "seeds", "runs", "measured time", "verdicts"], body)


def _machine(records: list[dict[str, Any]]) -> list[str]:
    head, body = run_environments(records)
    out = ["Where the runs were trained (each run records its own environment):", ""]
    out += md_table(head[1:], [row[1:] for row in body])  # one suite: its column says nothing
    warning = environments_warning([r.get("env") for r in records], "suite")
    if warning:
        out += ["", f"> **Warning:** {warning}."]
    return out


def _findings(data: SuiteData) -> list[str]:
    suite = data.suite
    if suite is None or not suite.findings:
        return ["No verdict written yet (give the suite file `[[findings]]`: see docs/bench.md)."]
    out = md_table(
        ["finding", "the paper's claim", "source", "tests", "verdict", "evidence", "written"],
        [
            [f.finding, f.claim, f.source, tests_cell(f.tests), f"**{f.verdict}**", f.evidence or "—", f.written]
            for f in suite.findings
        ],
    )
    stale = data.stale_findings()
    if stale:
        last = data.last_finished
        assert last is not None
        dates = ", ".join(sorted({f.written for f in stale}))
        out += [
            "",
            f"> **Warning:** {len(stale)} of these verdicts (written {dates}) were written before the latest runs "
            f"(the last finished {last:%Y-%m-%d %H:%M} UTC): re-read them against the tables above before "
            "trusting them, and update them in the suite file.",
        ]
    return out


def _lengths_mean(record: dict[str, Any], column: str, lengths: str) -> float | None:
    """The mean of a record's ``column`` over its test lengths of kind ``lengths`` (see :class:`Comparison`); a
    record without that column gives its main metric."""
    train = record["config"].get("train_lengths")
    top = train[1] if train else None
    suffix = f"_{column}" if column else ""
    values = []
    for n in record["config"].get("test_lengths") or []:
        if lengths == "beyond" and (top is None or n <= top):
            continue
        if lengths == "train" and (top is None or n > top):
            continue
        # a task without that column (a one-token answer has no separate token accuracy): its main metric
        v = record["metrics"].get(f"{n}{suffix}", record["metrics"].get(str(n)))
        if isinstance(v, int | float):
            values.append(float(v))
    return sum(values) / len(values) if values else None


def comparison_table(records: list[dict[str, Any]], comparison: Any) -> tuple[list[str], list[list[str]], str]:
    """The head and rows of a ``[[comparisons]]`` table (one row per task, one column per pair: the mean ± std
    over seeds of the per-seed difference), and a sentence with the mean over every task and pair."""
    by = {(r["config"]["task"], r.get("label", r["config"]["encoding"]), r["config"]["seed"]): r for r in records}
    tasks = sorted({r["config"]["task"] for r in records})
    pct = any(is_pct(r["metric"]) for r in records)
    scale, unit = (100.0, " points") if pct else (1.0, "")
    head = ["task", *[f"{a} − {b}" for a, b in comparison.pairs]]
    body, every = [], []
    for task in tasks:
        row = [task]
        for a, b in comparison.pairs:
            diffs = []
            for (t, label, seed), ra in by.items():
                if t != task or label != a or (task, b, seed) not in by:
                    continue
                va = _lengths_mean(ra, comparison.column, comparison.lengths)
                vb = _lengths_mean(by[(task, b, seed)], comparison.column, comparison.lengths)
                if va is not None and vb is not None:
                    diffs.append(scale * (va - vb))
            if diffs:
                m, sd = mean_std(diffs)
                every.extend(diffs)
                row.append(f"{m:+.1f} ± {sd:.1f} ({len(diffs)})")
            else:
                row.append("—")
        body.append(row)
    what = {"beyond": "beyond the training lengths", "train": "at the training lengths", "all": "at every length"}
    col = (
        f"`{comparison.column}` column (the main metric where a task has none)" if comparison.column else "main metric"
    )
    if every:
        m, sd = mean_std(every)
        total = (
            f"Mean over every task, pair and seed ({len(every)} differences): **{m:+.1f}{unit}** (std {sd:.1f}); "
            f"the {col} averaged {what[comparison.lengths]}, a − b per seed (cells: mean ± std over seeds, (seeds))."
        )
    else:
        total = f"No pair of runs to compare yet (the {col} {what[comparison.lengths]})."
    return head, body, total


def _comparisons(data: SuiteData) -> list[str]:
    out: list[str] = []
    for c in data.suite.comparisons if data.suite is not None else []:
        head, body, total = comparison_table(data.records, c)
        out += [f"**{c.name}**", "", *md_table(head, body), "", total, ""]
    return out


def _problems(data: SuiteData) -> list[str]:
    """The runs that failed (or "No run failed."), then the model's other problems: rows that did not learn
    their task in distribution, lengths an encoding could not evaluate."""
    probs = data.runs.problems
    out = [] if probs["failed"] else ["No run failed.", ""]
    return [*out, *problem_lines(probs, escape=True)][:-1]


def section(data: SuiteData, *, img_rel: str, data_rel: str) -> list[str]:
    """The Markdown lines of one suite's section (``img_rel``, ``data_rel``: the plots' and data's folders,
    relative to the page)."""
    suite = data.suite
    out = [f"## {data.name}", ""]
    if suite is None:
        out += [f"The suite file cannot be loaded here: {md_escape(data.error)}", ""]
    else:
        if suite.paper:
            out += [f"**Paper:** {suite.paper}", ""]
        if suite.description:
            out += [suite.description, ""]
        if suite.notes:
            out += [suite.notes, ""]
    if not data.ran:
        out += [
            f"**Not run yet.** Run it with `{data.bench_command}`, then regenerate this page with "
            f"`{WRITE_FROM_STORES}`.",
            "",
        ]
        if suite is not None and suite.findings:
            out += ["### Verdicts", "", *_findings(data), ""]
        return out

    records = data.records
    out += [
        f"- **Produced by:** `{data.bench_command}`",
        f"- **This section regenerated by:** `{WRITE_FROM_STORES}` (from the store), or `{WRITE_FROM_DATA}` "
        f"(from the committed data, [`{data_rel}/{data.name}.jsonl`]({data_rel}/{data.name}.jsonl))",
    ]
    n = f"{len(records)} finished" + (f" of the suite's {data.planned}" if data.planned is not None else "")
    if data.failures:
        n += f"; {len(data.failures)} failed (listed below)"
    out.append(f"- **Runs:** {n}")
    if records:
        first = min(r["finished_at"] for r in records)
        last = max(r["finished_at"] for r in records)
        out.append(f"- **Finished:** first run {_when(first)}, last run {_when(last)} ({duration(last - first)} apart)")
        out.append(f"- **Time, from the records:** {measured_time(records)[0]}")
    if suite is not None and suite.measured:
        out.append(f"- **Time, as measured (suite file):** {suite.measured}")
    if records:
        seeds = data.seeds
        out.append(f"- **Seeds:** {', '.join(map(str, seeds))} ({len(seeds)} seed{'s' if len(seeds) != 1 else ''})")
    out.append("")

    if records:
        out += ["### Machine", "", *_machine(records), ""]
        out += ["### Results", ""]
        pictures = images(data)
        for table in data.runs.tables:
            task = table.task
            out.append("\n".join(task_table(table)).rstrip("\n"))
            out.append("")
            pics = pictures.get(task, {})
            if "metric" in pics:
                out.append(f"![{task}: the metric against test length]({img_rel}/{pics['metric']})")
            if "curves" in pics:
                out.append(f"![{task}: training loss]({img_rel}/{pics['curves']})")
            out.append("")
            for sec in task_sections(data, task):
                out += [f"#### {sec.title}", "", *sec.lines, ""]
                if f"section:{sec.slug}" in pics:
                    out += [f"![{sec.caption or sec.title}]({img_rel}/{pics[f'section:{sec.slug}']})", ""]
        if suite is not None and suite.published:
            pub = published_table(suite.published, data.runs.rows).rstrip("\n")
            out += ["### Beside the published numbers", "", pub, ""]
        if suite is not None and suite.comparisons:
            out += ["### Paired comparisons", "", *_comparisons(data)]
    out += ["### Verdicts", "", *_findings(data), ""]
    out += ["### Failures and problems", "", *_problems(data), ""]
    return out


def render(
    datas: list[SuiteData],
    *,
    img_rel: str = "results/img",
    data_rel: str = "results/data",
    data_dir: Path | None = None,
) -> str:
    """The whole page (Markdown) of ``datas``; it depends only on them and the suite files, never on the date or
    the machine that renders it."""
    out = ["# Results", "", INTRO, "", "Regenerate it:", ""]
    out += [
        f"- from the benchmark stores (after `posenc bench --suite NAME --workers 2`): `{WRITE_FROM_STORES}`",
        f"- from the committed data in `{data_rel}/` alone: `{WRITE_FROM_DATA}`",
        f"- check that this page is what the data gives: `{CHECK}` (exit 1 if not)",
        "",
        "## Summary",
        "",
    ]
    out += summary_table(datas)
    out += [
        "",
        "Measured time: the suite file's own measurement where it gives one, else the time computed from the "
        "records (see each section). Verdicts: of the paper's findings, as written in the suite file "
        "(`[[findings]]`), each with the paper's claim as published (a quote in quotes, else a close paraphrase) "
        "and where it stands. *tests*: whether posenc tests that claim **as published** or a variant of its own "
        "(**posenc's question**: its verdict says nothing for or against the paper). *not tested*: the task "
        "cannot test the claim (the evidence says why), which is not *not reproduced*.",
        "",
    ]
    for d in datas:
        out += section(d, img_rel=img_rel, data_rel=data_rel)
    out += extra_sections(img_rel=img_rel, data_rel=data_rel, data_dir=data_dir)
    return "\n".join(out).rstrip("\n") + "\n"


def extra_sections(*, img_rel: str, data_rel: str, data_dir: Path | None = None) -> list[str]:
    """The Markdown lines of the sections after the suites': the real model's (a pretrained model's context
    extended, ``posenc extend``: :func:`posenc.extend.report.page_section`), from ``<data_dir>/extend.jsonl``
    alone, like the suites' sections, so that ``posenc results --check`` holds. Nothing without ``data_dir`` (a
    page of chosen suites only)."""
    if data_dir is None:
        return []
    from ...extend.report import page_section

    return page_section(data_dir, img_rel=img_rel)
