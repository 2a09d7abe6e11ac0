"""The registered encodings' cards and the built-in task names, kept on disk so that a listing imports no torch.

Building the registry imports every encoding module, and with them torch (about 1.5 s; 13-24 s on a busy
machine). The cards it yields depend only on posenc's own source files, so they are stored once per state of
those files in ``$POSENC_CACHE/cards-<key>.json`` (default ``~/.cache/posenc``), ``<key>`` hashing posenc's
version and the path, size and modification time of every source file. Any edit (a new encoding file included)
gives a new key and the registry is built again; a cache that cannot be read or written is ignored. The names of
the benchmark's tasks are kept the same way (``tasks-<key>.json``, :func:`task_names`).

``posenc list`` reads the cards, and the command line checks the names a user typed against them before any
command imports torch (:func:`unknown_encodings`: the close matches of a typo, among the names ``posenc list``
shows; the registry's own errors use the same function). ``posenc`` stores both files after any command that
loaded the registry or the tasks anyway (:func:`keep`), so a first ``posenc bench`` leaves them for the next.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ._suggest import close_names, normalized, unknown_encodings  # noqa: F401 (close_names: the CLI's too)

FIELDS = ("name", "family", "position", "learnable", "paper", "year", "summary", "reference", "aliases")
_PACKAGE = Path(__file__).resolve().parent


def cache_folder() -> Path:
    env = os.environ.get("POSENC_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "posenc"


def source_key() -> str:
    """A hash of posenc's version and of the path, size and mtime of each of its source files."""
    from . import __version__

    h = hashlib.sha1(f"{__version__} {sys.version_info[:2]}".encode())
    for path in sorted(_PACKAGE.rglob("*.py")):
        st = path.stat()
        h.update(f"{path.relative_to(_PACKAGE)} {st.st_size} {st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def _build() -> list[dict[str, Any]]:
    from .registry import available, resolve

    out = []
    for name in available():
        info = resolve(name).info
        card = {f: getattr(info, f) for f in FIELDS if f != "name"}
        card["name"] = name
        card["aliases"] = list(info.aliases)
        out.append(card)
    return out


def _cached(kind: str, build: Callable[[], Any], valid: Callable[[Any], bool], key: str | None = None) -> Any:
    """``$POSENC_CACHE/<kind>-<key>.json`` where it holds a valid value, else ``build()``, stored there."""
    path = cache_folder() / f"{kind}-{key or source_key()}.json"
    try:
        got = json.loads(path.read_text())
        if valid(got):
            return got
    except (OSError, ValueError):
        pass
    built = build()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump(built, f)
        os.replace(f.name, path)
    except OSError:
        pass
    return built


def cards() -> list[dict[str, Any]]:
    """Every registered encoding's card (``FIELDS``), in ``posenc.available()`` order."""
    return _cached(
        "cards",
        _build,
        lambda got: isinstance(got, list) and all(isinstance(c, dict) and set(FIELDS) <= set(c) for c in got),
    )


# ---------------------------------------------------------------------------- names and their close matches
# (the functions live in posenc._suggest, below the registry, which raises the same error)


def check_encodings(names: list[str], where: str = "") -> None:
    """Raise :func:`unknown_encodings`'s error for the names of ``names`` that are neither a registered encoding
    nor an alias, from the cards (no torch once they are cached). Where this process has loaded the registry (a
    program that registered an encoding of its own, then called the command line), the registry is asked."""
    if sys.modules.get("posenc.registry") is not None:
        from .schedule import check_names  # plain names by the registry, schedules parsed

        check_names(names, where)
        return
    listed = cards()
    known = [c["name"] for c in listed]
    aliases = {a: c["name"] for c in listed for a in c.get("aliases") or ()}
    from .schedule import is_schedule_text  # torch-free; a schedule ("rope@w64*3+nope") is checked when it is parsed

    bad = [n for n in names if not is_schedule_text(n) and normalized(n) not in aliases and normalized(n) not in known]
    if bad:
        raise unknown_encodings(bad, known, aliases, where)
    for text in names:  # a schedule's layer names, checked the same way (its syntax is checked when it is parsed)
        if is_schedule_text(text):
            for layer, name in _schedule_names(text):
                if normalized(name) not in aliases and normalized(name) not in known:
                    from .errors import UnknownNameError

                    close = close_names(name, known, aliases)
                    hint = f" (close matches: {', '.join(close)})" if close else ""
                    exc = UnknownNameError("encoding", name, known)
                    exc.close_matches = close
                    exc.args = (
                        f"{where + ': ' if where else ''}{text!r}: layer {layer}: unknown encoding {name!r}{hint}; "
                        "`posenc list` (or posenc.available()) lists every encoding",
                    )
                    raise exc


def _schedule_names(text: str) -> list[tuple[int, str]]:
    """(first layer, encoding name) of each term of a schedule string (``"rope@w64*3+nope"``: (0, rope), (3, nope)),
    as :func:`posenc.schedule.Schedule.parse` reads them, without the registry; a term it cannot read is skipped
    (the parse, when the command runs, says what is wrong with it)."""
    from .schedule import _NAME, _split_top

    out: list[tuple[int, str]] = []
    layer = 0
    body = text.strip().removesuffix("...")
    for term in _split_top(body, "+"):
        pieces = _split_top(term, "*")
        m = _NAME.match(pieces[0].strip())
        if m is None:
            return out
        out.append((layer, m.group(0)))
        count = pieces[1].strip() if len(pieces) == 2 else "1"
        if not count.isdigit():
            return out
        layer += int(count)
    return out


# ---------------------------------------------------------------------------- the benchmark's tasks
TASK_GROUP = "posenc.tasks"


def _builtin_tasks() -> list[str]:
    from .bench.types import _TASKS, is_builtin, load_builtin_tasks

    load_builtin_tasks()
    return sorted(n for n, t in _TASKS.items() if is_builtin(type(t)))


def task_names() -> list[str] | None:
    """The names of the built-in tasks, from the cache (built once per state of posenc's files), and those this
    process registered (a program's own tasks); None where installed packages declare tasks of their own (entry
    points: their names are known only once loaded)."""
    from importlib.metadata import entry_points

    if list(entry_points(group=TASK_GROUP)):
        return None
    names = _cached("tasks", _builtin_tasks, lambda got: isinstance(got, list) and all(isinstance(t, str) for t in got))
    types = sys.modules.get("posenc.bench.types")
    return sorted({*names, *getattr(types, "_TASKS", {})})


def keep() -> None:
    """Store the cards and the task names where this process has loaded the registry or the tasks anyway (a
    command that needed them): then the next command's name checks and ``posenc list`` import no torch."""
    registry = sys.modules.get("posenc.registry")
    try:
        if registry is not None and getattr(registry, "_ready", False):
            cards()
        types = sys.modules.get("posenc.bench.types")
        if types is not None and getattr(types, "_loaded", False):
            task_names()
    except Exception:  # noqa: BLE001 -- a cache is a convenience: never an error of the command
        pass
