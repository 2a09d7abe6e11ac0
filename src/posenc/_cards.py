"""The registered encodings' cards for ``posenc list``, kept on disk so that a listing imports no torch.

Building the registry imports every encoding module, and with them torch (about 1.5 s). The cards it
yields depend only on posenc's own source files, so they are stored once per state of those files in
``$POSENC_CACHE/cards-<key>.json`` (default ``~/.cache/posenc``), ``<key>`` hashing posenc's version and the
path, size and modification time of every source file. Any edit (a new encoding file included) gives a new
key and the registry is built again; a cache that cannot be read or written is ignored.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

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


def cards() -> list[dict[str, Any]]:
    """Every registered encoding's card (``FIELDS``), in ``posenc.available()`` order."""
    path = cache_folder() / f"cards-{source_key()}.json"
    try:
        got = json.loads(path.read_text())
        if isinstance(got, list) and all(isinstance(c, dict) and set(FIELDS) <= set(c) for c in got):
            return got
    except (OSError, ValueError):
        pass
    built = _build()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump(built, f)
        os.replace(f.name, path)
    except OSError:
        pass
    return built
