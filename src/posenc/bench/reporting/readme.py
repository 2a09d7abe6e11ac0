"""The README's block of verdicts: the paper suites' decided claims, drawn from the results page's data.

``posenc results --readme README.md`` writes it between :data:`README_START` and :data:`README_END` (and
``--check`` compares it), from the same :class:`~.suite_data.SuiteData` as the page, so that the README cannot
disagree with the page. (The README's table of *encodings* is :mod:`posenc.readme_table`'s, from the registry.)
It imports the suites' data and the formats of the reporting package.
"""

from __future__ import annotations

import re

from ...errors import PosencError
from .commands import README_END, README_START
from .format import anchor, md_escape, md_table
from .suite_data import SuiteData

#: the verdicts a README row is given for: a claim as published that the runs decided (the others are counted)
CONCLUSIVE = ("reproduced", "partly", "not reproduced")
_ORDER = (*CONCLUSIVE, "inconclusive", "not tested", "posenc's question")


def readme_block(datas: list[SuiteData], page_link: str = "docs/results.md", extra: list[str] | None = None) -> str:
    """The README's summary of the paper suites: one row per finding that tests a paper's claim as published and
    has a conclusive verdict (:data:`CONCLUSIVE`: suite, with its seeds where fewer than planned; finding;
    verdict), then one row per suite counting the rest (the inconclusive and not-tested claims, and posenc's own
    questions, which the results page lists with their claims and sources), then the suites without a verdict
    yet, then ``extra`` (the real model's RULER paragraph). Built from the same data as the page, so that it
    cannot disagree with it; the README stays short as the suites grow."""
    body = []
    waiting = []
    for d in datas:
        if d.suite is None or d.name == "quick":
            continue
        seeds = len(d.seeds) if d.ran else 0
        planned = len({s for g in d.suite.grids for s in g.seeds})
        ran = "not run yet" if not seeds else f"{seeds} of {planned}" if seeds < planned else str(seeds)
        link = f"[{d.name}]({page_link}#{anchor(d.name)})"
        if not d.suite.findings:
            waiting.append(f"{link} ({ran if not d.ran else f'{ran} seeds, no verdict written yet'})")
            continue
        stale = set(map(id, d.stale_findings()))
        # the seeds are said where they are fewer than the suite's (the text above the block says how many it has)
        first = link + (f" ({ran} seeds)" if seeds < planned else "")
        rows, rest = [], {}
        for f in d.suite.findings:
            if not f.as_published:
                rest["posenc's question"] = rest.get("posenc's question", 0) + 1
                continue
            if f.verdict not in CONCLUSIVE:
                rest[f.verdict] = rest.get(f.verdict, 0) + 1
                continue
            verdict = f"**{f.verdict}**" + (" (written before the latest runs)" if id(f) in stale else "")
            # the finding without its closing parenthesis (the paper's numbers, an aside): those are on the page
            short = re.sub(r"\s*\([^()]*\)$", "", f.finding) or f.finding
            rows.append([md_escape(short), verdict])
        if rest:
            counted = ", ".join(f"{n} {what}" + ("s" if what == "posenc's question" and n > 1 else "")
                                for what, n in sorted(rest.items(), key=lambda kv: _ORDER.index(kv[0])))
            rows.append([f"*and {counted}: on the page*", ""])
        body += [[first if i == 0 else "", *row] for i, row in enumerate(rows)]
    lines = [README_START, ""]
    lines += md_table(["suite", "finding (claim and source: the results page)", "verdict"], body)
    if waiting:
        lines += ["", "No verdict yet: " + "; ".join(waiting) + "."]
    if extra:
        lines += ["", *extra]
    lines += ["", README_END]
    return "\n".join(lines)


def with_readme_block(text: str, block: str, where: str) -> str:
    """``text`` (a README, named ``where`` in errors) with its block of verdicts replaced by ``block``."""
    if README_START not in text or README_END not in text:
        raise PosencError(
            f"{where}: no results block; put the two lines\n{README_START}\n{README_END}\nwhere the summary goes"
        )
    a = text.index(README_START)
    b = text.index(README_END) + len(README_END)
    return text[:a] + block + text[b:]
