"""``posenc results``: the results page (``docs/results.md``), one section per suite, from the benchmark stores.

Two steps, one command:

* **export** (``--stores DIR``): the runs and failures of every suite whose store
  ``DIR/<suite>/results.sqlite`` exists (only those of the suite as its file stands) go to
  ``<data>/<suite>.jsonl`` (:meth:`~posenc.bench.store.SQLiteStore.export_jsonl`'s format: one
  JSON object a line, sorted by key, with the time each run finished), text to commit;
* **page**: the page is built from those JSONL files alone (through a temporary store,
  :meth:`~posenc.bench.store.SQLiteStore.import_jsonl`), so that ``posenc results --write``
  without ``--stores`` and ``posenc results --check`` give the same text from the committed data.
  The plots go to ``<img>/<suite>-<task>.png`` (the metric against test length, ± std over
  seeds) and ``<img>/<suite>-<task>-curves.png`` (training loss); ``--check`` compares the
  Markdown only, never the PNG bytes.

Each section says what the suite is and the command that produced it, when its runs finished
and how long they took, the machine (from the environment each run records), the seeds, the
leaderboard of every task with its plot, the published numbers beside ours, the verdicts of the
suite file's ``[[findings]]`` (with a warning when runs finished after a verdict was written)
and the runs that failed. The tables and plots are :mod:`posenc.bench.report`'s.
"""

from __future__ import annotations

import argparse
import datetime
import difflib
import os
import re
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, PosencError

if TYPE_CHECKING:
    from .suites import Suite

#: the page's canonical place and the commands that make it (printed on the page)
PAGE = "docs/results.md"
STORES = "posenc-results"
WRITE_FROM_STORES = f"posenc results --stores {STORES} --write {PAGE} --readme README.md"
WRITE_FROM_DATA = f"posenc results --write {PAGE} --readme README.md"
CHECK = f"posenc results --check {PAGE} --readme README.md"

INTRO = (
    "What posenc's benchmark suites measured: the quick suite, then one reduced reproduction per paper. "
    "Each section says what was run and with which command, when, for how long, on which machine and "
    "with which seeds; then per task the metric at each test length (mean ± std over seeds) with its plot, "
    "the paper's numbers beside ours, a verdict per finding of the paper, and the runs that failed. "
    "Our models are tiny and trained for minutes on CPU: compare the shape (the ranking, the trend over "
    "length), not the values. This page is generated; do not edit it by hand."
)


# ---------------------------------------------------------------------------- which suites
def builtin_order() -> list[str]:
    """The built-in suites in the page's order: ``quick``, then the paper suites as ``posenc bench --list-suites``
    lists them."""
    from .suites import available_suites

    names = available_suites()
    return (["quick"] if "quick" in names else []) + [n for n in names if n != "quick"]


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


def _load(given: str | Path) -> SuiteData:
    from .suites import _builtin_dir, load_suite

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


# ---------------------------------------------------------------------------- data
def export_suite(data: SuiteData, store_path: Path, data_dir: Path) -> int:
    """Write the runs and failures of ``data``'s suite in the store ``store_path`` to ``<data_dir>/<suite>.jsonl``
    (labels as the suite file gives them now); return how many lines (0: nothing of the suite, no file written)."""
    from .store import SQLiteStore, write_jsonl

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
    from .store import FAILED, SQLiteStore

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
        loaded = [_load(given) for given in (suites if suites is not None else builtin_order())]
    for data in loaded:
        path = data_dir / f"{data.name}.jsonl"
        if path.is_file():
            data.records, data.failures = read_jsonl(path)
        out.append(data)
    return out


# ---------------------------------------------------------------------------- plots
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
    return out


def draw(datas: list[SuiteData], img_dir: Path) -> list[Path]:
    """Draw every plot the page links into ``img_dir`` (report.py's figures, one colour per encoding across a
    suite); remove the suites' older plots that the page no longer links. Returns the files drawn."""
    from .report import encoding_styles, plot, plot_curves
    from .runner import label_of

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError("the results page's plots need matplotlib: pip install 'posenc[plots]'") from None
    img_dir.mkdir(parents=True, exist_ok=True)
    drawn: list[Path] = []
    for data in datas:
        styles = encoding_styles(label_of(r) for r in data.records)
        for task, files in images(data).items():
            runs = [r for r in data.records if r["config"]["task"] == task]
            for kind, name in files.items():
                fn = plot if kind == "metric" else plot_curves
                if fn(runs, img_dir / name, styles=styles) is not None:
                    drawn.append(img_dir / name)
    linked = {name for d in datas for files in images(d).values() for name in files.values()}
    for data in datas:
        for old in img_dir.glob(f"{data.name}-*.png"):
            if old.name not in linked:
                old.unlink()
    return drawn


# ---------------------------------------------------------------------------- text
def _utc(t: float) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(t, datetime.UTC)


def _when(t: float) -> str:
    return f"{_utc(t):%Y-%m-%d %H:%M} UTC"


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


def _seeds(records: list[dict[str, Any]]) -> list[int]:
    return sorted({int(r["config"]["seed"]) for r in records})


def _last_finished(data: SuiteData) -> datetime.datetime | None:
    return _utc(max(r["finished_at"] for r in data.records)) if data.records else None


def stale_findings(data: SuiteData) -> list[Any]:
    """The findings of the suite written before its last run finished."""
    last = _last_finished(data)
    if data.suite is None or last is None:
        return []
    return [f for f in data.suite.findings if f.written_before(last)]


def verdict_counts(data: SuiteData) -> str:
    """``2 reproduced, 1 partly`` (in :data:`~posenc.bench.suites.VERDICTS` order), or ``none yet``."""
    from .suites import VERDICTS

    if data.suite is None or not data.suite.findings:
        return "none yet"
    n = Counter(f.verdict for f in data.suite.findings)
    text = ", ".join(f"{n[v]} {v}" for v in VERDICTS if n[v])
    return text + (" (written before the latest runs)" if stale_findings(data) else "")


def _anchor(name: str) -> str:
    """GitHub's anchor of a heading ``## name``."""
    return re.sub(r"[^\w\- ]", "", name.lower()).replace(" ", "-")


def _esc(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def summary_table(datas: list[SuiteData]) -> list[str]:
    """The page's summary: suite | seeds | runs | measured time | verdicts."""
    from .report import _md_table

    body = []
    for d in datas:
        if not d.ran:
            body.append([f"[{d.name}](#{_anchor(d.name)})", "—", "not run yet", "—", verdict_counts(d)])
            continue
        runs = f"{len(d.records)}" + (f" of {d.planned}" if d.planned is not None else "")
        if d.failures:
            runs += f", {len(d.failures)} failed"
        measured = d.suite.measured if d.suite is not None and d.suite.measured else measured_time(d.records)[1]
        seeds = ", ".join(map(str, _seeds(d.records))) or "—"
        body.append([f"[{d.name}](#{_anchor(d.name)})", seeds, runs, measured, verdict_counts(d)])
    return _md_table(["suite", "seeds", "runs", "measured time", "verdicts"], body)


#: the README's block of verdicts lies between these two lines (``--readme README.md``)
README_START = "<!-- results:start (written by posenc results --readme README.md; do not edit by hand) -->"
README_END = "<!-- results:end -->"


def readme_block(datas: list[SuiteData], page_link: str = "docs/results.md") -> str:
    """The README's summary of the paper suites: one row per finding (suite, finding, verdict, seeds), then the
    suites without a verdict yet. Built from the same data as the page, so that it cannot disagree with it."""
    from .report import _md_table

    body = []
    waiting = []
    for d in datas:
        if d.suite is None or d.name == "quick":
            continue
        seeds = len(_seeds(d.records)) if d.ran else 0
        planned = len({s for g in d.suite.grids for s in g.seeds})
        ran = "not run yet" if not seeds else f"{seeds} of {planned}" if seeds < planned else str(seeds)
        link = f"[{d.name}]({page_link}#{_anchor(d.name)})"
        if not d.suite.findings:
            waiting.append(f"{link} ({ran if not d.ran else f'{ran} seeds, no verdict written yet'})")
            continue
        stale = set(map(id, stale_findings(d)))
        for i, f in enumerate(d.suite.findings):
            verdict = f"**{f.verdict}**" + (" (written before the latest runs)" if id(f) in stale else "")
            body.append([link if i == 0 else "", _esc(f.finding), verdict, ran if i == 0 else ""])
    lines = [README_START, ""]
    lines += _md_table(["suite", "finding", "verdict", "seeds"], body)
    if waiting:
        lines += ["", "No verdict yet: " + "; ".join(waiting) + "."]
    lines += ["", README_END]
    return "\n".join(lines)


def _with_readme_block(text: str, block: str, where: str) -> str:
    if README_START not in text or README_END not in text:
        raise PosencError(
            f"{where}: no results block; put the two lines\n{README_START}\n{README_END}\nwhere the summary goes"
        )
    a = text.index(README_START)
    b = text.index(README_END) + len(README_END)
    return text[:a] + block + text[b:]


def _machine(records: list[dict[str, Any]]) -> list[str]:
    from .report import ENV_COLUMNS, _md_table, run_environments
    from ..runenv import differences

    head, body = run_environments(records)
    out = ["Where the runs were trained (each run records its own environment):", ""]
    out += _md_table(head[1:], [row[1:] for row in body])  # one suite: its column says nothing
    diff = differences([r.get("env") for r in records])
    if diff:
        what = "; ".join(f"{ENV_COLUMNS.get(k, k)}: {' / '.join(v)}" for k, v in diff.items())
        out += [
            "",
            f"> **Warning:** the runs of this suite were trained in different environments ({what}): "
            "their last digits may differ for that reason alone.",
        ]
    return out


def _findings(data: SuiteData) -> list[str]:
    from .report import _md_table

    suite = data.suite
    if suite is None or not suite.findings:
        return ["No verdict written yet (give the suite file `[[findings]]`: see docs/bench.md)."]
    out = _md_table(
        ["finding", "verdict", "evidence", "written"],
        [[f.finding, f"**{f.verdict}**", f.evidence or "—", f.written] for f in suite.findings],
    )
    stale = stale_findings(data)
    if stale:
        last = _last_finished(data)
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
    from .report import _mean_std, _pct

    by = {(r["config"]["task"], r.get("label", r["config"]["encoding"]), r["config"]["seed"]): r for r in records}
    tasks = sorted({r["config"]["task"] for r in records})
    pct = any(_pct(r["metric"]) for r in records)
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
                m, sd = _mean_std(diffs)
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
        m, sd = _mean_std(every)
        total = (
            f"Mean over every task, pair and seed ({len(every)} differences): **{m:+.1f}{unit}** (std {sd:.1f}); "
            f"the {col} averaged {what[comparison.lengths]}, a − b per seed (cells: mean ± std over seeds, (seeds))."
        )
    else:
        total = f"No pair of runs to compare yet (the {col} {what[comparison.lengths]})."
    return head, body, total


def _comparisons(data: SuiteData) -> list[str]:
    from .report import _md_table

    out: list[str] = []
    for c in data.suite.comparisons if data.suite is not None else []:
        head, body, total = comparison_table(data.records, c)
        out += [f"**{c.name}**", "", *_md_table(head, body), "", total, ""]
    return out


def _problems(data: SuiteData, rows: list[dict[str, Any]]) -> list[str]:
    """The runs that failed (or "No run failed."), then report.py's other problems: rows that did not learn
    their task in distribution, lengths an encoding could not evaluate."""
    from .report import PROBLEM_TEXT, problems

    probs = problems(rows, data.failures)
    out = [] if probs["failed"] else ["No run failed.", ""]
    for kind, items in probs.items():
        if items:
            out += [f"**{PROBLEM_TEXT[kind]}**", ""]
            out += [f"- {p['run']}: {_esc(p['error'].splitlines()[-1]) if p['error'] else ''}" for p in items]
            out += [""]
    return out[:-1]


def section(data: SuiteData, *, img_rel: str, data_rel: str) -> list[str]:
    """The Markdown lines of one suite's section (``img_rel``, ``data_rel``: the plots' and data's folders,
    relative to the page)."""
    from .report import leaderboard, markdown_table, published_table

    suite = data.suite
    out = [f"## {data.name}", ""]
    if suite is None:
        out += [f"The suite file cannot be loaded here: {_esc(data.error)}", ""]
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
    rows = leaderboard(records)
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
        seeds = _seeds(records)
        out.append(f"- **Seeds:** {', '.join(map(str, seeds))} ({len(seeds)} seed{'s' if len(seeds) != 1 else ''})")
    out.append("")

    if records:
        out += ["### Machine", "", *_machine(records), ""]
        out += ["### Results", ""]
        pictures = images(data)
        for task in sorted({r["task"] for r in rows}):
            out.append(markdown_table([r for r in rows if r["task"] == task]).rstrip("\n"))
            out.append("")
            pics = pictures.get(task, {})
            if "metric" in pics:
                out.append(f"![{task}: the metric against test length]({img_rel}/{pics['metric']})")
            if "curves" in pics:
                out.append(f"![{task}: training loss]({img_rel}/{pics['curves']})")
            out.append("")
        if suite is not None and suite.published:
            out += ["### Beside the published numbers", "", published_table(suite.published, rows).rstrip("\n"), ""]
        if suite is not None and suite.comparisons:
            out += ["### Paired comparisons", "", *_comparisons(data)]
    out += ["### Verdicts", "", *_findings(data), ""]
    out += ["### Failures and problems", "", *_problems(data, rows), ""]
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
        "(`[[findings]]`).",
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
    from ..extend.report import page_section

    return page_section(data_dir, img_rel=img_rel)


def _rel(path: Path, page: Path) -> str:
    return Path(os.path.relpath(path.resolve(), page.resolve().parent)).as_posix()


def _dirs(page: Path, data_dir: Path | None, img_dir: Path | None) -> tuple[Path, Path]:
    base = page.parent / "results"
    return (Path(data_dir) if data_dir else base / "data"), (Path(img_dir) if img_dir else base / "img")


def build_page(
    page: str | Path,
    *,
    suites: list[str | Path] | None = None,
    data_dir: str | Path | None = None,
    img_dir: str | Path | None = None,
    _loaded: list[SuiteData] | None = None,
) -> tuple[str, list[SuiteData]]:
    """The text of ``page`` from the JSONL data alone (``data_dir``: default ``<page folder>/results/data``),
    and the suites' data. ``suites``: built-in names or suite files (default: every built-in suite)."""
    page = Path(page)
    ddir, idir = _dirs(page, data_dir and Path(data_dir), img_dir and Path(img_dir))
    datas = collect(suites, ddir, loaded=_loaded)
    # the real model's section belongs to the whole page, not to a page of chosen suites
    extra = ddir if suites is None else None
    return render(datas, img_rel=_rel(idir, page), data_rel=_rel(ddir, page), data_dir=extra), datas


def write_page(
    page: str | Path,
    *,
    stores: str | Path | None = None,
    suites: list[str | Path] | None = None,
    data_dir: str | Path | None = None,
    img_dir: str | Path | None = None,
    plots: bool = True,
    readme: str | Path | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Write the results page ``page``, its plots, and (with ``stores``) the JSONL data first.

    ``stores``: a folder holding ``<suite>/results.sqlite`` per suite; each suite with a store has its
    runs exported to ``<data_dir>/<suite>.jsonl`` (a store with nothing of the suite leaves the file as
    it is). The page is then built from the JSONL files alone (:func:`build_page`), so it is the page
    ``posenc results --check`` expects. Returns ``{"page", "exported", "plots"}``.
    """
    page = Path(page)
    ddir, idir = _dirs(page, data_dir and Path(data_dir), img_dir and Path(img_dir))
    exported: list[Path] = []
    loaded = [_load(given) for given in (suites if suites is not None else builtin_order())]
    if stores is not None:
        if not Path(stores).is_dir():
            raise ConfigError(
                f"--stores {stores}: no such folder; give the folder that holds <suite>/results.sqlite "
                f"(posenc bench writes {STORES}/<suite>/ by default)"
            )
        found = [d.name for d in loaded if (Path(stores) / d.name / "results.sqlite").is_file()]
        real = None
        if suites is None:  # the real model's cells (posenc extend), exported beside the suites' runs
            from ..extend.report import export_store

            real = export_store(stores, ddir)
            if real is not None:
                exported.append(real)
                log(f"{stores}: the real model's cells (posenc extend) -> {real}")
        if not found and real is None:
            raise ConfigError(
                f"--stores {stores}: no store of any suite of the page in it (looked for "
                + ", ".join(f"{Path(stores) / d.name / 'results.sqlite'}" for d in loaded[:3])
                + (" ..." if len(loaded) > 3 else "")
                + ")"
            )
        for data in loaded:
            store = Path(stores) / data.name / "results.sqlite"
            if not store.is_file():
                continue
            n = export_suite(data, store, ddir)
            if n:
                exported.append(ddir / f"{data.name}.jsonl")
                log(f"{store}: {n} run(s) and failure(s) of suite {data.name!r} -> {ddir / (data.name + '.jsonl')}")
            else:
                log(f"{store}: nothing of suite {data.name!r} stored; its data file is left as it is")
    text, datas = build_page(page, suites=suites, data_dir=ddir, img_dir=idir, _loaded=loaded)
    drawn = draw(datas, idir) if plots else []
    if plots and suites is None and (ddir / "extend.jsonl").is_file():
        from ..extend.report import page_section

        page_section(ddir, img_rel=_rel(idir, page), img_dir=idir)
        drawn += [p for p in (idir / "extend-loss.png", idir / "extend-passkey.png") if p.is_file()]
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(text, encoding="utf-8")
    if readme is not None:
        readme = Path(readme)
        old = readme.read_text(encoding="utf-8")
        link = os.path.relpath(page, readme.parent).replace(os.sep, "/")
        readme.write_text(_with_readme_block(old, readme_block(datas, link), str(readme)), encoding="utf-8")
        log(f"{readme}: the block of verdicts rewritten")
    ran = [d.name for d in datas if d.ran]
    log(
        f"{page}: {len(datas)} suite(s), {len(ran)} with runs ({', '.join(ran) or 'none'}); "
        f"{len(drawn)} plot(s) in {idir}"
    )
    return {"page": page, "exported": exported, "plots": drawn}


def check_page(
    page: str | Path,
    *,
    suites: list[str | Path] | None = None,
    data_dir: str | Path | None = None,
    img_dir: str | Path | None = None,
    readme: str | Path | None = None,
) -> tuple[bool, str]:
    """Whether ``page`` (and ``readme``'s block of verdicts) is what the committed JSONL data gives (the plots are
    not compared), and a unified diff against the data's where it is not."""
    page = Path(page)
    if not page.is_file():
        raise PosencError(f"{page}: no such file; write it with: posenc results --write {page}")
    pairs = []
    new, datas = build_page(page, suites=suites, data_dir=data_dir, img_dir=img_dir)
    pairs.append((page, page.read_text(encoding="utf-8"), new))
    if readme is not None:
        readme = Path(readme)
        old = readme.read_text(encoding="utf-8")
        link = os.path.relpath(page, readme.parent).replace(os.sep, "/")
        pairs.append((readme, old, _with_readme_block(old, readme_block(datas, link), str(readme))))
    diffs = [
        "\n".join(
            difflib.unified_diff(
                old.splitlines(), want.splitlines(), f"{path} (as it is)", f"{path} (from the data)", lineterm="", n=1
            )
        )
        for path, old, want in pairs
        if old != want
    ]
    return not diffs, "\n".join(diffs)


# ---------------------------------------------------------------------------- command line
DESCRIPTION = f"""\
Write the results page (e.g. {PAGE}): one section per suite (quick, then the paper suites),
each with its command, dates, measured time, machine, seeds, leaderboards and plots, the
published numbers beside ours, the verdicts of the suite file's [[findings]], and failures.

With --stores DIR, the runs of every suite whose store DIR/<suite>/results.sqlite exists are
first exported to <page folder>/results/data/<suite>.jsonl (text to commit). The page and its
plots (<page folder>/results/img/) are always built from those JSONL files alone, so --check
can tell whether the page is what the committed data gives."""

EXAMPLES = f"""\
examples:
  {WRITE_FROM_STORES}
      export the stores, then write the page, its plots and README's table of verdicts
  {WRITE_FROM_DATA}
      the same from the committed data (docs/results/data) alone
  {CHECK}
      exit 1 if the page or README's table is not what the data gives
"""


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``posenc results`` to the main command line's subparsers."""
    pr = sub.add_parser(
        "results",
        help="write the results page (docs/results.md) from the benchmark stores, or check it",
        description=DESCRIPTION,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = pr.add_mutually_exclusive_group(required=True)
    g.add_argument("--write", metavar="FILE", help=f"write the page (e.g. {PAGE}) and its plots")
    g.add_argument("--check", metavar="FILE", help="exit 1 if FILE differs from the page the committed data gives")
    pr.add_argument(
        "--stores",
        metavar="DIR",
        help=f"export DIR/<suite>/results.sqlite of each suite to the data folder first (e.g. {STORES})",
    )
    pr.add_argument(
        "--readme",
        metavar="FILE",
        help="also write (or check) the block of verdicts between FILE's results:start/end lines (e.g. README.md)",
    )
    pr.add_argument("--data", metavar="DIR", help="the JSONL data folder (default: <page folder>/results/data)")
    pr.add_argument("--img", metavar="DIR", help="the plots' folder (default: <page folder>/results/img)")
    pr.add_argument(
        "--suite",
        dest="suites",
        action="append",
        metavar="NAME|FILE",
        help="only this suite, a built-in name or a file (repeatable; default: every built-in suite)",
    )
    pr.set_defaults(func=run)
    return pr


def run(args: argparse.Namespace) -> int:
    """``posenc results``: write or check the page; 0 when done or up to date, 1 when ``--check`` finds it stale."""
    # a suite named on the command line must load: a typo would otherwise give a page of one empty section
    bad = [d for d in (_load(given) for given in args.suites or ()) if d.suite is None]
    if bad:
        raise ConfigError(
            "--suite: " + "; ".join(d.error for d in bad) + " (posenc bench --list-suites lists the built-in suites)"
        )
    if args.check:
        if args.stores:
            raise ConfigError("--check reads the committed data only; leave out --stores")
        ok, diff = check_page(args.check, suites=args.suites, data_dir=args.data, img_dir=args.img, readme=args.readme)
        if ok:
            print(f"{args.check}: up to date with its data")
            return 0
        lines = diff.splitlines()
        shown = "\n".join(lines[:60]) + (f"\n... ({len(lines) - 60} more diff lines)" if len(lines) > 60 else "")
        print(
            f"{args.check}: not the page its data gives (edited by hand, or the data or a suite file changed); "
            f"run: posenc results --write {args.check}\n{shown}",
            file=sys.stderr,
        )
        return 1
    write_page(
        args.write, stores=args.stores, suites=args.suites, data_dir=args.data, img_dir=args.img, readme=args.readme
    )
    return 0


__all__ = [
    "SuiteData",
    "add_parser",
    "build_page",
    "builtin_order",
    "check_page",
    "collect",
    "draw",
    "duration",
    "export_suite",
    "measured_time",
    "read_jsonl",
    "readme_block",
    "render",
    "run",
    "write_page",
]
