"""The table of encodings in README.md, generated from the registry.

    posenc readme-table                    print the table (what `posenc list --markdown` prints)
    posenc readme-table --write README.md  rewrite the table between the README's markers
    posenc readme-table --check README.md  exit 1 when the README's table is not the generated one

(``python -m posenc.readme_table`` takes the same arguments.) The table lies between the lines
``<!-- encodings:start -->`` and ``<!-- encodings:end -->``; nothing else in the file changes.
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
#: what to run when the README's table is out of date (from the repository root, in the .venv)
COMMAND = ".venv/bin/posenc readme-table --write README.md"

_BETWEEN = re.compile(re.escape(START) + r"\n(.*?)" + re.escape(END), flags=re.S)


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
        lines.append(
            f"| `{name}` | {info.family} | {info.position} | {learned} | {info.paper} ({info.year}) "
            f"| {info.summary} | {info.reference} |"
        )
    return "\n".join(lines) + "\n"


def current(text: str) -> str:
    """The table between the markers of ``text`` (a README)."""
    m = _BETWEEN.search(text)
    if m is None:
        raise PosencError(f"no table between {START!r} and {END!r} (each on a line of its own)")
    return m.group(1)


def replaced(text: str) -> str:
    """``text`` with the table between its markers replaced by the generated one."""
    current(text)  # the markers must be there
    new = table()
    return _BETWEEN.sub(lambda m: f"{START}\n{new}{END}", text, count=1)


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
    g.add_argument("--write", metavar="FILE", help="rewrite the table in FILE (e.g. README.md)")
    g.add_argument("--check", metavar="FILE", help="exit 1 when FILE's table differs from the generated one")


def run(args: argparse.Namespace) -> int:
    if not args.write and not args.check:
        print(table(), end="")
        return 0
    path = Path(args.write or args.check)
    if not path.is_file():
        raise PosencError(f"{path}: no such file")
    text = path.read_text(encoding="utf-8")
    new = replaced(text)
    n = table().count("\n") - 2
    if args.check:
        if new != text:
            print(f"{path}: the table of encodings is out of date; run: {COMMAND}", file=sys.stderr)
            return 1
        print(f"{path}: the table of encodings is up to date ({n} encodings)")
        return 0
    if new != text:
        path.write_text(new, encoding="utf-8")
        print(f"{path}: table of {n} encodings written")
    else:
        print(f"{path}: the table of {n} encodings was already up to date")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except PosencError as exc:
        print(f"posenc readme-table: error: {exc}", file=sys.stderr)
        sys.exit(2)
