"""Property cards (one encoding) and the comparison table (all encodings), in text, Markdown and HTML.

:func:`inspect` measures one encoding, draws its pictures and writes its card;
:func:`gallery` does it for every registered encoding and writes the side-by-side
comparison (``index.md`` and ``index.html``).
"""

from __future__ import annotations

import html
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..base import PositionalEncoding
from ..errors import ConfigError
from ..registry import available
from .names import CARD_FORMATS as CARD_FORMATS  # re-exported: the keys of RENDERERS
from .names import FORMATS
from .plots import plot
from .properties import PROPERTIES, PROPERTY_KEYS, PROPERTY_TITLES, Report, measure

_SYMBOL = {"pass": "pass", "FAIL": "FAIL", "-": "-", "n/a": "n/a"}


def _yes_no(v: bool | None) -> str:
    return "n/a" if v is None else ("yes" if v else "no")


def _claim(v: bool | None) -> str:
    return "-" if v is None else ("yes" if v else "no")


def _md_escape(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def _header(r: Report) -> list[str]:
    c = r.card
    s = r.settings
    lines = [
        f"{c.title} ({c.paper}, {c.year})",
        f"family: {c.family}; position: {c.position}; learnable: {'yes' if c.learnable else 'no'}; "
        f"hooks: {', '.join(r.hooks) or 'none'}",
        f"measured at dim={s['dim']}, heads={s['heads']} (head_dim={s['head_dim']}), trained length L={s['length']}"
        + (f", options {s['options']}" if s.get("options") else ""),
    ]
    if c.shortcoming:
        lines.append(f"claimed shortcoming: {c.shortcoming}")
    lines.extend(r.notes)
    return lines


# ---------------------------------------------------------------- one card
def card_text(r: Report) -> str:
    """The card as plain text (what ``posenc inspect NAME`` prints)."""
    rows = [(m.title, _yes_no(m.holds), _claim(m.claim), m.verdict, m.value) for m in r.measurements.values()]
    w0 = max(len("property"), *(len(x[0]) for x in rows))
    out = [f"== {r.name} ==", *(f"  {h}" for h in _header(r)), ""]
    out.append(f"  {'property':<{w0}}  holds  claim  check  measured")
    for t, h, c, v, val in rows:
        out.append(f"  {t:<{w0}}  {h:<5}  {c:<5}  {v:<5}  {val}")
    fails = r.failures
    out.append("")
    if r.kind == "unbuilt":
        out.append("  nothing measured: it cannot be built at these settings")
    elif fails:
        out.append(f"  disagrees with its claims on: {', '.join(PROPERTY_TITLES[k] for k in fails)}")
    else:
        out.append("  every measurement agrees with the claims")
    return "\n".join(out)


def card_markdown(r: Report, pictures: dict[str, Any] | None = None, image_dir: str = "") -> str:
    """The card as a Markdown section: header, a table (property, measured, holds, claim, check), pictures."""
    out = [f"## {r.name}", ""]
    out += [f"- {_md_escape(h)}" for h in _header(r)]
    out += ["", "| property | measured | holds | claim | check |", "|---|---|---|---|---|"]
    for m in r.measurements.values():
        out.append(f"| {m.title} | {_md_escape(m.value)} | {_yes_no(m.holds)} | {_claim(m.claim)} | {m.verdict} |")
    if pictures:
        out.append("")
        for name, got in pictures.items():
            if isinstance(got, list):
                png = [p for p in got if str(p).endswith(".png")]
                if png:
                    out.append(f"![{r.name} {name}]({image_dir}{Path(png[0]).name})")
    return "\n".join(out) + "\n"


_CSS = """
body { font-family: sans-serif; margin: 2em; max-width: 1400px; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 3px 6px; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
td.pass { background: #e3f6e3; } td.FAIL { background: #f9d6d6; } td.na { color: #999; }
td.yes { color: #1a6b1a; } td.no { color: #a33; }
img { max-width: 48%; margin: 4px; border: 1px solid #eee; }
"""


def _html_page(title: str, body: str) -> str:
    return (
        f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{_CSS}</style></head><body>\n{body}\n</body></html>\n"
    )


def card_html(r: Report, pictures: dict[str, Any] | None = None, image_dir: str = "", page: bool = True) -> str:
    """The card as HTML (a whole page, or a ``<section>`` with ``page=False``)."""
    e = html.escape
    parts = [f"<section id='{e(r.name)}'><h2>{e(r.name)}</h2><ul>"]
    parts += [f"<li>{e(h)}</li>" for h in _header(r)]
    parts.append("</ul><table><tr><th>property</th><th>measured</th><th>holds</th><th>claim</th><th>check</th></tr>")
    for m in r.measurements.values():
        cls = "na" if m.verdict == "n/a" else m.verdict if m.verdict in ("pass", "FAIL") else ""
        hv = _yes_no(m.holds)
        parts.append(
            f"<tr><td title='{e(m.how)}'>{e(m.title)}</td><td>{e(m.value)}</td>"
            f"<td class='{hv if hv in ('yes', 'no') else 'na'}'>{hv}</td><td>{_claim(m.claim)}</td>"
            f"<td class='{cls}'>{m.verdict}</td></tr>"
        )
    parts.append("</table>")
    if pictures:
        for name, got in pictures.items():
            if isinstance(got, list):
                png = [p for p in got if str(p).endswith(".png")]
                if png:
                    parts.append(f"<img src='{e(image_dir + Path(png[0]).name)}' alt='{e(r.name)} {e(name)}'>")
    parts.append("</section>")
    body = "\n".join(parts)
    return _html_page(f"posenc inspect {r.name}", body) if page else body


def card_json(r: Report) -> str:
    return json.dumps(r.as_dict(), indent=2, default=str)


RENDERERS: dict[str, Callable[[Report], str]] = {
    "text": card_text,
    "markdown": card_markdown,
    "html": card_html,
    "json": card_json,
}


# ---------------------------------------------------------------- side by side
def _cell(r: Report, key: str) -> str:
    m = r.measurements.get(key)
    if m is None or m.holds is None:
        return "n/a"
    s = "yes" if m.holds else "no"
    if m.verdict == "FAIL":
        s += " (!)"
    return s


def comparison_markdown(reports: list[Report]) -> str:
    """One table of all encodings side by side: yes / no per property; "(!)" marks a claim the measurement refutes."""
    head = "| encoding | family | position | " + " | ".join(PROPERTY_TITLES[k] for k in PROPERTY_KEYS) + " |"
    sep = "|" + "---|" * (3 + len(PROPERTY_KEYS))
    rows = [
        f"| {r.name} | {r.card.family} | {r.card.position} | " + " | ".join(_cell(r, k) for k in PROPERTY_KEYS) + " |"
        for r in reports
    ]
    legend = (
        "\nyes / no: whether the property holds, as measured; n/a: not measurable for this encoding "
        "(see its card); (!): the measurement disagrees with the claim in the encoding's card.\n"
    )
    return "\n".join([head, sep, *rows]) + "\n" + legend


def comparison_html(reports: list[Report], link: bool = True) -> str:
    e = html.escape
    parts = ["<table><tr><th>encoding</th><th>family</th><th>position</th>"]
    parts += [f"<th title='{e(meaning)}'>{e(title)}</th>" for _, title, meaning in PROPERTIES]
    parts.append("</tr>")
    for r in reports:
        name = f"<a href='#{e(r.name)}'>{e(r.name)}</a>" if link else e(r.name)
        cells = []
        for k in PROPERTY_KEYS:
            m = r.measurements.get(k)
            c = _cell(r, k)
            cls = "FAIL" if m is not None and m.verdict == "FAIL" else ("na" if c == "n/a" else c)
            title = e(m.value) if m is not None else ""
            cells.append(f"<td class='{cls}' title='{title}'>{e(c)}</td>")
        parts.append(
            f"<tr><td>{name}</td><td>{e(r.card.family)}</td><td>{e(r.card.position)}</td>{''.join(cells)}</tr>"
        )
    parts.append("</table>")
    return "\n".join(parts)


# ---------------------------------------------------------------- writers
def inspect(
    encoding: str | PositionalEncoding,
    out: str | Path | None = None,
    *,
    dim: int = 64,
    length: int = 128,
    heads: int = 4,
    options: dict[str, Any] | None = None,
    formats: tuple[str, ...] = FORMATS,
    strict: bool = False,
) -> tuple[Report, dict[str, Any]]:
    """Measure ``encoding``; with ``out``, draw its pictures into ``out`` and write ``card.md`` / ``card.html``.

    An encoding that cannot be built at these sizes and options gives a card of ``n/a`` rows
    (``report.kind == "unbuilt"``); with ``strict=True`` it raises :class:`~posenc.ConfigError`
    instead, before anything is drawn or written.
    """
    report = measure(encoding, dim=dim, length=length, heads=heads, options=options)
    if strict and report.kind == "unbuilt":
        given = f" and options {options}" if options else ""
        hint = "" if options else " (settings it needs go in as options: `posenc inspect NAME --option KEY=VALUE`)"
        raise ConfigError(
            f"cannot build {report.name!r} at dim={dim}, heads={heads}, length={length}{given}: {report.error}{hint}"
        )
    pictures: dict[str, Any] = {}
    if out is not None:
        out = Path(out)
        pictures = plot(encoding, out, dim=dim, length=length, heads=heads, options=options, formats=formats)
        out.mkdir(parents=True, exist_ok=True)
        (out / "card.md").write_text(card_markdown(report, pictures))
        (out / "card.html").write_text(card_html(report, pictures))
        (out / "card.json").write_text(card_json(report))
    return report, pictures


def gallery(
    out: str | Path,
    *,
    names: list[str] | None = None,
    dim: int = 64,
    length: int = 128,
    heads: int = 4,
    formats: tuple[str, ...] = FORMATS,
    pictures: bool = True,
    progress: Callable[[str], None] | None = None,
) -> list[Report]:
    """Inspect every registered encoding (or ``names``) into ``out/<name>/`` and write the comparison.

    Writes ``out/index.md`` and ``out/index.html`` (the comparison table, then every card with
    its pictures) and ``out/comparison.md`` (the table alone).
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    reports: list[Report] = []
    sections_md: list[str] = []
    sections_html: list[str] = []
    t0 = time.time()
    for name in available() if names is None else names:
        if progress is not None:
            progress(name)
        sub = out / name if pictures else None
        report, pics = inspect(name, sub, dim=dim, length=length, heads=heads, formats=formats)
        reports.append(report)
        sections_md.append(card_markdown(report, pics, image_dir=f"{name}/"))
        sections_html.append(card_html(report, pics, image_dir=f"{name}/", page=False))
    table_md = comparison_markdown(reports)
    s = f"dim={dim}, heads={heads}, trained length L={length}"
    intro = (
        f"# posenc inspect: {len(reports)} encodings\n\nMeasured at {s} in {time.time() - t0:.0f} s. "
        "What each property means and how it is measured: docs/inspect.md.\n\n"
    )
    (out / "comparison.md").write_text(table_md)
    (out / "index.md").write_text(intro + table_md + "\n" + "\n".join(sections_md))
    body = (
        f"<h1>posenc inspect: {len(reports)} encodings</h1><p>Measured at {html.escape(s)}. "
        "Hover a cell for the measured value.</p>" + comparison_html(reports) + "\n".join(sections_html)
    )
    (out / "index.html").write_text(_html_page("posenc inspect", body))
    return reports
