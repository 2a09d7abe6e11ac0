"""Small statistics shared by the layers that report intervals (``posenc.extend``'s RULER cells and
``posenc.bench``'s separation tests); no torch, no other posenc module."""

from __future__ import annotations

import math


def wilson_bounds(p: float, n: int, z: float) -> tuple[float, float]:
    """Wilson's score interval of a proportion ``p`` observed over ``n`` trials, at normal quantile ``z``
    (two-sided): the proportions ``q`` with ``|p - q| <= z sqrt(q (1 - q) / n)``, clipped to [0, 1]. The callers
    check ``n`` and ``p``."""
    z2 = z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)
