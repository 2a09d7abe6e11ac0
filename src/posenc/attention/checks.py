"""The argument checks of the attention modules (and of :mod:`posenc.models`, which re-uses them).

Each raises :class:`~posenc.errors.ConfigError` with a message that says what was expected. Imports only
:mod:`posenc.errors` and :mod:`posenc.base`.
"""

from __future__ import annotations

from typing import Any

from ..base import PositionalEncoding
from ..errors import ConfigError


def check_int(name: str, value: Any, minimum: int = 1, *, optional: bool = False) -> None:
    """Raise :class:`ConfigError` unless ``value`` is an integer ``>= minimum`` (or ``None`` where ``optional``)."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")


def check_probability(name: str, value: Any) -> None:
    """Raise :class:`ConfigError` unless ``value`` is a number in ``[0, 1)`` (a dropout probability)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ConfigError(f"{name} must be a number in [0, 1), got {value!r}")


def check_encoding(encoding: Any, head_dim: int) -> None:
    """Raise :class:`ConfigError` unless ``encoding`` is a :class:`~posenc.base.PositionalEncoding` or ``None``."""
    if encoding is not None and not isinstance(encoding, PositionalEncoding):
        raise ConfigError(
            f"encoding must be a posenc.PositionalEncoding (e.g. posenc.get('rope', head_dim={head_dim})) or "
            f"None, got {type(encoding).__name__} {encoding!r}"
        )


def check_groups(n_heads: int, kv_heads: int) -> int:
    """``H / Hkv``: how many query heads each key/value head serves (a :class:`ConfigError` if it is not whole)."""
    if kv_heads < 1 or n_heads % kv_heads:
        raise ConfigError(
            f"grouped-query attention needs the query heads ({n_heads}) to be a multiple of the key/value heads "
            f"({kv_heads})"
        )
    return n_heads // kv_heads
