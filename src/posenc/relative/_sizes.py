"""The size checks the relative encodings with their own projections share (Transformer-XL, XLNet, DeBERTa).

Imports :mod:`posenc.errors` only.
"""

from __future__ import annotations

from ..errors import ConfigError


def head_dim_of(d_model: int, n_heads: int, head_dim: int | None) -> int:
    """``head_dim``, or ``d_model // n_heads`` where it is ``None``: checked to be a positive integer (and, when
    derived, that ``n_heads`` divides ``d_model``). ``d_model`` and ``n_heads`` are checked by the caller."""
    if head_dim is None:
        if d_model % n_heads:
            raise ConfigError(f"d_model={d_model} is not divisible by n_heads={n_heads}; pass head_dim")
        head_dim = d_model // n_heads
    if not isinstance(head_dim, int) or head_dim <= 0:
        raise ConfigError(f"head_dim must be a positive integer, got {head_dim!r}")
    return head_dim
