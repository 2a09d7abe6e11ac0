"""The tables of encodings in README.md and docs/encodings.md, generated from the registry.

    posenc readme-table                    print the table (what `posenc list --markdown` prints)
    posenc readme-table --write README.md docs/encodings.md   rewrite the tables between the files' markers
    posenc readme-table --check README.md docs/encodings.md   exit 1 when a file's table is not the generated one

(``python -m posenc.readme_table`` takes the same arguments.) The full table (:func:`table`: paper, summary,
what the tests check each encoding against) lies between the lines ``<!-- encodings:start -->`` and
``<!-- encodings:end -->`` (docs/encodings.md); the short one of the README's front page (:func:`short_table`:
name, family, learned, first author and year) between ``<!-- encodings-short:start -->`` and
``<!-- encodings-short:end -->``. A file may hold either or both; nothing else in it changes.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from .errors import PosencError

START = "<!-- encodings:start -->"
END = "<!-- encodings:end -->"
SHORT_START = "<!-- encodings-short:start -->"
SHORT_END = "<!-- encodings-short:end -->"
#: what to run when a table is out of date (from the repository root, in the .venv)
COMMAND = ".venv/bin/posenc readme-table --write README.md docs/encodings.md"

_BETWEEN = re.compile(re.escape(START) + r"\n(.*?)" + re.escape(END), flags=re.S)
_SHORT_BETWEEN = re.compile(re.escape(SHORT_START) + r"\n(.*?)" + re.escape(SHORT_END), flags=re.S)
_AUTHOR = re.compile(r"[A-Z][\w'’-]*")


def table(family: str | None = None) -> str:
    """The Markdown table of every registered encoding (of one family), one row each, ending in a newline."""
    from .registry import available, resolve

    lines = [
        "| name | family | sees | learned | paper | what it does | checked against |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in available():
        info = resolve(name).info
        if family and info.family != family:
            continue
        learned = "yes" if info.learnable else "no"
        paper, summary, reference = (_cell(s) for s in (info.paper, info.summary, info.reference))
        lines.append(
            f"| `{name}` | {info.family} | {info.position} | {learned} | {paper} ({info.year}) "
            f"| {summary} | {reference} |"
        )
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    """``text`` for a cell of a Markdown table: a ``|`` of its own would end the cell."""
    return text.replace("|", "\\|")


def cited(paper: str) -> str:
    """The first author of an encoding's ``paper`` field: ``"Su et al., RoFormer: ..."`` -> ``"Su et al."``,
    ``"Press, Smith, Lewis, Train Short, ..."`` -> ``"Press et al."``; a field that does not start with an author's
    surname gives its first part (``"anon."``, ``"bloc97"``)."""
    parts = paper.split(", ")
    if parts[0].endswith(" et al."):
        return parts[0]
    authors = []
    for part in parts:
        if not _AUTHOR.fullmatch(part):
            break
        authors.append(part)
    if not authors:
        return parts[0]
    return authors[0] if len(authors) == 1 else f"{authors[0]} et al."


def short_table() -> str:
    """The short table of every registered encoding (name, family, learned, first author and year), one row each,
    ending in a newline: the README's, where the full :func:`table` would not fit a front page."""
    from .registry import available, resolve

    lines = ["| name | family | learned | from |", "|---|---|---|---|"]
    for name in available():
        info = resolve(name).info
        learned = "yes" if info.learnable else "no"
        lines.append(f"| `{name}` | {info.family} | {learned} | {_cell(cited(info.paper))} {info.year} |")
    return "\n".join(lines) + "\n"


def current(text: str, short: bool = False) -> str:
    """The table between the markers of ``text`` (the full one's, or with ``short`` the short one's)."""
    start, end, between = (SHORT_START, SHORT_END, _SHORT_BETWEEN) if short else (START, END, _BETWEEN)
    m = between.search(text)
    if m is None:
        raise PosencError(f"no table between {start!r} and {end!r} (each on a line of its own)")
    return m.group(1)


def replaced(text: str) -> str:
    """``text`` with the table between each pair of its markers (full, short) replaced by the generated one."""
    if not _BETWEEN.search(text) and not _SHORT_BETWEEN.search(text):
        raise PosencError(
            f"no table between {START!r} and {END!r}, nor between {SHORT_START!r} and {SHORT_END!r} "
            "(each marker on a line of its own)"
        )
    if _BETWEEN.search(text):
        new = table()
        text = _BETWEEN.sub(lambda m: f"{START}\n{new}{END}", text, count=1)
    if _SHORT_BETWEEN.search(text):
        short = short_table()
        text = _SHORT_BETWEEN.sub(lambda m: f"{SHORT_START}\n{short}{SHORT_END}", text, count=1)
    return text


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="posenc readme-table",
        description="Print the table of registered encodings, or put it into a README between the lines "
        f"{START} and {END}.",
    )
    add_arguments(p)
    return run(p.parse_args(argv))


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--write", metavar="FILE", nargs="+", help="rewrite the tables in each FILE (e.g. README.md docs/encodings.md)"
    )
    g.add_argument(
        "--check", metavar="FILE", nargs="+", help="exit 1 when a FILE's table differs from the generated one"
    )


def run(args: argparse.Namespace) -> int:
    if not args.write and not args.check:
        print(table(), end="")
        return 0
    paths = [Path(p) for p in (args.write or args.check)]
    for path in paths:
        if not path.is_file():
            raise PosencError(f"{path}: no such file")
    n = table().count("\n") - 2
    status = 0
    for path in paths:
        text = path.read_text(encoding="utf-8")
        new = replaced(text)
        if args.check:
            if new != text:
                print(f"{path}: the table of encodings is out of date; run: {COMMAND}", file=sys.stderr)
                status = 1
            else:
                print(f"{path}: the table of encodings is up to date ({n} encodings)")
        elif new != text:
            path.write_text(new, encoding="utf-8")
            print(f"{path}: table of {n} encodings written")
        else:
            print(f"{path}: the table of {n} encodings was already up to date")
    return status


if __name__ == "__main__":
    try:
        sys.exit(main())
    except PosencError as exc:
        print(f"posenc readme-table: error: {exc}", file=sys.stderr)
        sys.exit(2)
