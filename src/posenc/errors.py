"""Errors raised by posenc.

Every error says what was wrong and what would be right. They derive from
:class:`ValueError` so that code catching bad input the usual way still works.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class PosencError(ValueError):
    """Base class for posenc's errors about bad input."""


class UnknownNameError(PosencError):
    """A name (encoding, task, suite ...) that is not registered."""

    def __init__(self, kind: str, name: str, known: Iterable[str]):
        known = sorted(known)
        close = difflib.get_close_matches(name, known, n=5, cutoff=0.5)
        msg = f"unknown {kind} {name!r}."
        if close:
            msg += f" Did you mean: {', '.join(close)}?"
        msg += f" Known {kind}s: {', '.join(known)}."
        super().__init__(msg)
        self.name = name
        self.close_matches = close


class PositionError(PosencError):
    """Positions that an encoding cannot take (too large, negative, not integer, wrong shape)."""


class ConfigError(PosencError):
    """An impossible configuration (odd head dimension for RoPE, unknown option ...)."""
