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

This module is the command and its driver (export, draw, write, check). What the page says is the reporting
package's: the data (:mod:`posenc.bench.reporting.suite_data`), the text (:mod:`posenc.bench.reporting.page`,
each suite a renderer of the one model of its runs, :class:`~posenc.bench.reporting.model.RunSet`), the README's
block of verdicts (:mod:`posenc.bench.reporting.readme`) and the plots (:mod:`posenc.bench.reporting.plots`).
Their public names are re-exported here. It may import the reporting package and everything of posenc.bench
below it.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, PosencError
from .reporting.commands import CHECK, PAGE, README_END, README_START, STORES, WRITE_FROM_DATA, WRITE_FROM_STORES

if TYPE_CHECKING:
    from .reporting.page import (
        INTRO,
        comparison_table,
        duration,
        extra_sections,
        measured_time,
        render,
        section,
        summary_table,
        verdict_counts,
    )
    from .reporting.readme import readme_block
    from .reporting.suite_data import SuiteData, builtin_order, collect, export_suite, images, read_jsonl

#: the names this module re-exports from the reporting package, by module; loaded on first use, so that
#: ``posenc results --help`` imports neither the model nor torch
_LAZY = {
    **dict.fromkeys(
        ("INTRO", "comparison_table", "duration", "extra_sections", "measured_time", "render", "section"), "page"
    ),
    **dict.fromkeys(("summary_table", "verdict_counts"), "page"),
    **dict.fromkeys(("readme_block", "with_readme_block"), "readme"),
    **dict.fromkeys(
        ("SuiteData", "builtin_order", "collect", "export_suite", "images", "read_jsonl", "load"), "suite_data"
    ),
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__package__}.reporting.{module}"), name)
    globals()[name] = value
    return value


# ---------------------------------------------------------------------------- plots
def draw(datas: list[SuiteData], img_dir: Path) -> list[Path]:
    """Draw every plot the page links into ``img_dir`` (report.py's figures, one colour per encoding across a
    suite); remove the suites' older plots that the page no longer links. Returns the files drawn."""
    from .reporting.plots import plot, plot_curves
    from .reporting.suite_data import images, task_sections

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError("the results page's plots need matplotlib: pip install 'posenc[plots]'") from None
    img_dir.mkdir(parents=True, exist_ok=True)
    drawn: list[Path] = []
    for data in datas:
        styles = data.runs.styles
        for task, files in images(data).items():
            runs = [r for r in data.records if r["config"]["task"] == task]
            own = {f"section:{sec.slug}": sec.draw for sec in task_sections(data, task) if sec.draw is not None}
            for kind, name in files.items():
                if kind in own:
                    saved = own[kind](img_dir / name)
                else:
                    fn = plot if kind == "metric" else plot_curves
                    saved = fn(runs, img_dir / name, styles=styles)
                if saved is not None:
                    drawn.append(img_dir / name)
    linked = {name for d in datas for files in images(d).values() for name in files.values()}
    for data in datas:
        for old in img_dir.glob(f"{data.name}-*.png"):
            if old.name not in linked:
                old.unlink()
    return drawn


# ---------------------------------------------------------------------------- the page
def _rel(path: Path, page: Path) -> str:
    return Path(os.path.relpath(path.resolve(), page.resolve().parent)).as_posix()


def _dirs(page: Path, data_dir: Path | None, img_dir: Path | None) -> tuple[Path, Path]:
    base = page.parent / "results"
    return (Path(data_dir) if data_dir else base / "data"), (Path(img_dir) if img_dir else base / "img")


def _readme_text(readme: Path, page: Path, datas: list[SuiteData], data_dir: Path | None = None) -> tuple[str, str]:
    """(the README as it is, the README with the block of verdicts the page's data gives, and the real model's RULER
    paragraph where ``data_dir`` holds its cells)."""
    from ..extend.report import RULER_PAGE_DATA, _read_lines
    from ..extend.ruler_report import readme_lines
    from .reporting.format import anchor
    from .reporting.readme import readme_block, with_readme_block

    old = readme.read_text(encoding="utf-8")
    link = os.path.relpath(page, readme.parent).replace(os.sep, "/")
    extra = None
    ruler = Path(data_dir) / RULER_PAGE_DATA if data_dir is not None else None
    if ruler is not None and ruler.is_file():
        records = _read_lines(ruler)
        name = str(records[0].get("model", {}).get("name", "?")) if records else "?"
        extra = readme_lines(records, f"{link}#{anchor(f'RULER by length: {name}')}")
    return old, with_readme_block(old, readme_block(datas, link, extra), str(readme))


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
    from .reporting.page import render
    from .reporting.suite_data import collect

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
    from .reporting.suite_data import builtin_order, export_suite, load

    page = Path(page)
    ddir, idir = _dirs(page, data_dir and Path(data_dir), img_dir and Path(img_dir))
    exported: list[Path] = []
    loaded = [load(given) for given in (suites if suites is not None else builtin_order())]
    if stores is not None:
        if not Path(stores).is_dir():
            raise ConfigError(
                f"--stores {stores}: no such folder; give the folder that holds <suite>/results.sqlite "
                f"(posenc bench writes {STORES}/<suite>/ by default)"
            )
        found = [d.name for d in loaded if (Path(stores) / d.name / "results.sqlite").is_file()]
        real: list[Path] = []
        if suites is None:  # the real model's cells (posenc extend), exported beside the suites' runs
            from ..extend.report import export_store

            real = export_store(stores, ddir)
            exported += real
            for path in real:
                log(f"{stores}: the real model's cells (posenc extend) -> {path}")
        folders = [d.name for d in loaded if (Path(stores) / d.name / "results.sqlite").is_dir()]
        if folders:
            raise ConfigError(
                f"--stores {stores}: {Path(stores) / folders[0] / 'results.sqlite'} exists as a folder, not a "
                "SQLite file written by posenc bench; remove or rename that folder, or give --stores the folder "
                "that holds <suite>/results.sqlite files"
            )
        if not found and not real:
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
    if plots and suites is None:  # the real model's section belongs to the whole page
        from ..extend.report import page_plots

        drawn += page_plots(ddir, idir)
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(text, encoding="utf-8")
    if readme is not None:
        readme = Path(readme)
        readme.write_text(_readme_text(readme, page, datas, ddir if suites is None else None)[1], encoding="utf-8")
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
        ddir = _dirs(page, data_dir and Path(data_dir), None)[0] if suites is None else None
        pairs.append((Path(readme), *_readme_text(Path(readme), page, datas, ddir)))
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
    from .reporting.suite_data import load

    bad = [d for d in (load(given) for given in args.suites or ()) if d.suite is None]
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
    "CHECK",
    "INTRO",
    "PAGE",
    "README_END",
    "README_START",
    "STORES",
    "WRITE_FROM_DATA",
    "WRITE_FROM_STORES",
    "SuiteData",
    "comparison_table",
    "extra_sections",
    "images",
    "section",
    "summary_table",
    "verdict_counts",
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
