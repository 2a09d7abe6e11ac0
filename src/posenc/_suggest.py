"""The close matches of a mistyped encoding name and the error that names them: shared by the registry (which
raises it for an unknown name) and the command line's torch-free check (:mod:`posenc._cards`, from cached cards).

Imports only :mod:`posenc.errors`.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping

from .errors import UnknownNameError


def normalized(name: str) -> str:
    """A name as the registry looks it up: stripped, lower case, ``_`` as ``-``."""
    return name.strip().lower().replace("_", "-")


def close_names(name: str, names: Iterable[str], aliases: Mapping[str, str], n: int = 5) -> list[str]:
    """The names closest to ``name`` (a typo), each a name ``posenc list`` shows: names and aliases are ranked by
    how close they are, and an alias stands for its name (``rope-neoxx`` -> ``rope``, by its alias ``rope-neox``;
    ``yarnn`` -> ``rope-yarn``), never shown itself; no name twice."""
    pool = sorted({*names, *aliases})
    out: list[str] = []
    for match in difflib.get_close_matches(normalized(name), pool, n=len(pool)):
        canonical = aliases.get(match, match)
        if canonical not in out:
            out.append(canonical)
    return out[:n]


def unknown_encodings(
    bad: list[str], names: Iterable[str], aliases: Mapping[str, str], where: str = ""
) -> UnknownNameError:
    """The error for the unknown encoding names ``bad`` (one or more): each with its close matches
    (:func:`close_names`), and where the whole list is (``posenc list``), not the ~90 names themselves."""
    names = list(names)
    exc = UnknownNameError("encoding", bad[0], names)
    exc.close_matches = close_names(bad[0], names, aliases)
    if len(bad) == 1:
        msg = f"unknown encoding {bad[0]!r}."
        if exc.close_matches:
            msg += f" Did you mean: {', '.join(exc.close_matches)}?"
        msg += " `posenc list` (or posenc.available()) lists every encoding."
    else:
        parts = []
        for b in bad:
            close = close_names(b, names, aliases)
            parts.append(f"{b!r}" + (f" (did you mean: {', '.join(close)}?)" if close else ""))
        msg = f"unknown encodings: {', '.join(parts)}. `posenc list` lists every encoding."
    exc.args = (f"{where}: {msg}" if where else msg,)
    return exc
