"""The files of a report: ``results.json``, ``leaderboard.json``, ``leaderboard.md``, the plots and ``report.html``.

:func:`write_report` builds the model once (:class:`~.model.RunSet`), draws its plots (:mod:`.plots`) and hands
it to the renderers (:mod:`.markdown`, :mod:`.html`). It is the top of the reporting package: it imports
every module of it, and nothing imports it but the facades (:mod:`posenc.bench.report`) and the package.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .context import environment
from .html import report_page
from .markdown import leaderboard_page
from .model import RunSet
from .plots import plot, plot_curves
from .rows import jsonable


def write_report(
    results: list[dict[str, Any]],
    out_dir: Path,
    title: str = "posenc bench",
    *,
    published: dict[str, Any] | None = None,
    failures: list[dict[str, Any]] | None = None,
    description: str = "",
    controls: Mapping[str, str] | None = None,
) -> dict[str, Path]:
    """Write ``results.json``, ``leaderboard.md``, ``leaderboard.json``, plots and ``report.html``.

    ``report.html`` is one self-contained page (plots embedded as PNG, CSS inline, no
    external reference): the tasks and their chance levels, the results, the plots, the
    published numbers beside ours (``published``: a suite's ``published`` section), the
    failures (``failures``: runs that raised; rows that did not learn in distribution;
    lengths not reached), the settings and the environment. ``leaderboard.md`` has the
    same sections, without the plots. ``controls``: the suite's controls (label or encoding name -> why it is
    at chance by design): marked in the tables, not counted as failures while at chance.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = RunSet(results, failures, controls)
    env = environment()
    files = {
        "results": out_dir / "results.json",
        "leaderboard": out_dir / "leaderboard.md",
        "leaderboard_json": out_dir / "leaderboard.json",
    }
    files["results"].write_text(json.dumps({"leaderboard": jsonable(runs.rows), "runs": results}, indent=1))
    files["leaderboard_json"].write_text(json.dumps({"title": title, "rows": jsonable(runs.rows)}, indent=1))
    png = plot(results, out_dir / "accuracy_vs_length.png", styles=runs.styles, rows=runs.rows)
    if png is not None:
        files["plot"] = png
    curves = plot_curves(results, out_dir / "training_curves.png", styles=runs.styles)
    if curves is not None:
        files["curves"] = curves
    pictures = {k: files[k] for k in ("plot", "curves") if k in files}
    files["leaderboard"].write_text(
        leaderboard_page(
            runs,
            title=title,
            description=description,
            env=env,
            published_spec=published,
            pictures=[p.name for p in pictures.values()],
        )
    )
    beside = [p.name for p in files.values()]
    if (out_dir / "results.sqlite").exists():
        beside.insert(0, "results.sqlite (every finished run and failure: the store the next run resumes from)")
    files["report"] = out_dir / "report.html"
    files["report"].write_text(
        report_page(
            runs,
            title=title,
            description=description,
            env=env,
            published_spec=published,
            pictures=pictures,
            beside=beside,
        )
    )
    return files
