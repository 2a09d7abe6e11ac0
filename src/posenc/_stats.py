"""Small statistics shared by the layers that report intervals (``posenc.extend``'s RULER cells,
``posenc.bench``'s separation tests and the tasks' own report sections); no torch, no other posenc module."""

from __future__ import annotations

import functools
import math
import statistics


def wilson_bounds(p: float, n: int, z: float) -> tuple[float, float]:
    """Wilson's score interval of a proportion ``p`` observed over ``n`` trials, at normal quantile ``z``
    (two-sided): the proportions ``q`` with ``|p - q| <= z sqrt(q (1 - q) / n)``, clipped to [0, 1]. The callers
    check ``n`` and ``p``."""
    z2 = z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


# ---------------------------------------------------------------------------- Student's t
def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        for num in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1 + num * d
            d = 1 / (d if abs(d) > tiny else tiny)
            c = 1 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return h


def _ibeta(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function ``I_x(a, b)``."""
    if x <= 0:
        return 0.0
    if x >= 1:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1) / (a + b + 2):
        return front * _betacf(a, b, x) / a
    return 1 - front * _betacf(b, a, 1 - x) / b


def t_cdf(t: float, df: int) -> float:
    """Student's *t* distribution function with ``df`` degrees of freedom."""
    tail = 0.5 * _ibeta(df / 2, 0.5, df / (df + t * t))
    return 1 - tail if t >= 0 else tail


@functools.lru_cache(maxsize=256)
def t_quantile(p: float, df: int) -> float:
    """Student's *t* quantile at ``p`` (> 0.5) for ``df`` degrees of freedom (bisection on :func:`t_cdf`)."""
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        lo, hi = hi, 2 * hi
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return (lo + hi) / 2


def paired_t(
    diffs: list[float], level: float = 0.95, bounds: tuple[float, float] | None = None
) -> tuple[float, float] | None:
    """The ``level`` *t* interval of the mean of paired differences, cut to ``bounds`` (the range the difference can
    take); None for fewer than 2 pairs."""
    n = len(diffs)
    if n < 2:
        return None
    m, sd = statistics.fmean(diffs), statistics.stdev(diffs)
    half = t_quantile(1 - (1 - level) / 2, n - 1) * sd / math.sqrt(n)
    lo, hi = m - half, m + half
    if bounds is not None:
        lo, hi = max(lo, bounds[0]), min(hi, bounds[1])
    return lo, hi
