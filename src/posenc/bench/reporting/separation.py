"""Whether two rows of a task differ: an interval for the difference of their scores, and the rule that calls a
gap *separable*. The verdicts (:mod:`.verdicts`) and the tables' "ahead of" column read it.

Two kinds of noise stand between a row's score and the encoding's: the **test examples** (each run is scored on
a finite sample: 512 examples per length in the quick suite) and **training** (another seed trains another model).
The quick suite runs two seeds, and with two seeds no interval over seeds separates anything but an exactly
repeated gap: the 95 % paired *t* interval of two per-seed differences is ±12.7 standard errors (one degree of
freedom), which gave "rope and sinusoidal are not separable" beside a 19.7-point lead that both seeds showed, and
reached past what accuracies can take ("−89.5 to +128.9 points"). Two seeds that agree in sign happen one time in
two with no difference at all, so no test of the seed noise alone can reach 95 % with two seeds.

So, where a score is a share of examples answered right (:func:`posenc.bench.outcomes.examples`: the task says how
many examples it counted at each label), the interval is over **the test examples, pooled over seeds and
lengths**, and a gap is separable only where, besides, **every seed agrees**:

1. Each (seed, length) of the score is a stratum with counts ``k`` of ``n`` for either row. The score is the mean
   of the strata's accuracies, so the difference is a linear combination ``Σ c_i p_i`` of independent binomial
   proportions (weights ``±1/S``, ``S`` strata a side). Its interval is Zou and Donner's MOVER (2008) from each
   proportion's Wilson score interval (:func:`wilson`): with one stratum a side it is Newcombe's hybrid score
   interval for a difference of proportions (1998, method 10), which :func:`mover` is tested against. It
   cannot leave the range the difference can take (``[-1, 1]``: the lower limit is at least ``Σ c_i l_i`` over
   the positive weights minus ``Σ |c_i| u_i`` over the negative ones), unlike a *t* interval, and it keeps its
   level near 0 and 1 where a Wald interval does not (most scores here are near 50 % or 100 %). The strata are
   treated as independent samples; both rows of a seed are in fact scored on the same examples (the evaluation
   data is a function of the seed and the length), and answers of two models on one example are positively
   correlated, so the unpaired interval is, if anything, wider than a paired one could be (the stored records
   keep counts, not each example's answer).
2. That interval is about the runs that were made (the test-sample noise); training noise is the seeds'. A gap is
   separable only where every seed in common has the same sign, and where there are two seeds or more: a gap that
   one seed carries (normalized on adjacent: 99.8 % on one seed, 49.0 % on the other) is not separable however
   many examples were counted. This is a guard, not a test of its own (it only makes the rule stricter); more
   seeds make it a strong one, and then the paired interval over seeds narrows too.

Where the task counts no examples (perplexity, F1, a split of unknown size), the interval is the paired *t*
interval of the per-seed differences, cut to the range the difference can take (the intersection of a
confidence interval with the parameter's range covers the parameter as often as the interval did).

Every interval of a task is at a level for the **family of its pairs** (Bonferroni: each pair's at
``1 - 0.05 / m`` for ``m`` pairs): a table says of every row which rows it is ahead of, and the family of those
claims is wrong with probability at most 5 %. With two rows that is the usual 95 %.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from ..._stats import paired_t, wilson_bounds
from ..outcomes import is_pct, metric_range

#: the family-wise error rate of a task's claims
ALPHA = 0.05


def z_quantile(p: float) -> float:
    """The standard normal quantile at ``p``."""
    return statistics.NormalDist().inv_cdf(p)


def wilson(k: int, n: int, z: float) -> tuple[float, float]:
    """Wilson's score interval of a proportion ``k / n`` at normal quantile ``z`` (two-sided): the proportions ``p``
    with ``|k/n - p| <= z sqrt(p (1 - p) / n)``."""
    if n <= 0 or not 0 <= k <= n:
        raise ValueError(f"a proportion needs 0 <= k <= n and n > 0, got k={k}, n={n}")
    return wilson_bounds(k / n, n, z)


def mover(plus: list[tuple[int, int]], minus: list[tuple[int, int]], z: float) -> tuple[float, float, float]:
    """(estimate, low, high) of ``mean(plus) - mean(minus)``, each a list of independent counts ``(k, n)``: Zou and
    Donner's MOVER from Wilson intervals (one count a side: Newcombe's hybrid score interval)."""
    if not plus or not minus:
        raise ValueError("a difference needs counts on both sides")
    terms = [(1 / len(plus), k, n) for k, n in plus] + [(-1 / len(minus), k, n) for k, n in minus]
    est = sum(c * k / n for c, k, n in terms)
    below = above = 0.0
    for c, k, n in terms:
        p = k / n
        lo, hi = wilson(k, n, z)
        if c > 0:
            below += (c * (p - lo)) ** 2
            above += (c * (hi - p)) ** 2
        else:
            below += (c * (hi - p)) ** 2
            above += (c * (p - lo)) ** 2
    return est, est - math.sqrt(below), est + math.sqrt(above)


# ---------------------------------------------------------------------------- two rows
@dataclass
class Separation:
    """How row ``a`` compares with row ``b`` on their score (positive: ``a`` is better)."""

    a: str
    b: str
    #: the difference of the scores over the seeds in common (a better: positive), and its interval
    diff: float
    low: float | None
    high: float | None
    #: "examples" (the test examples pooled over seeds and lengths) or "seeds" (paired t over seeds), or ""
    method: str
    #: the seeds in common and each one's difference of scores (a better: positive)
    seeds: list[int] = field(default_factory=list)
    per_seed: list[float] = field(default_factory=list)
    #: the strata of the examples method: how many (seed, label) pairs a side, and the examples in each
    strata: int = 0
    examples: list[int] = field(default_factory=list)
    level: float = 1 - ALPHA

    @property
    def interval_excludes_zero(self) -> bool:
        return self.low is not None and self.high is not None and (self.low > 0 or self.high < 0)

    @property
    def seeds_agree(self) -> bool:
        """Every seed in common has the sign of the difference (and there are two or more)."""
        if len(self.per_seed) < 2 or self.diff == 0:
            return False
        return all(d * self.diff > 0 for d in self.per_seed)

    @property
    def separable(self) -> bool:
        """The rule of :mod:`this module <.separation>`: the interval excludes 0 and, for the examples' interval,
        every one of two or more seeds agrees."""
        if not self.interval_excludes_zero:
            return False
        return self.seeds_agree if self.method == "examples" else True

    @property
    def winner(self) -> str | None:
        """The label of the better row where the gap is separable, else None."""
        return (self.a if self.diff > 0 else self.b) if self.separable else None


def _value(row: dict[str, Any], seed: int, key: str) -> float | None:
    v = row.get("seed_values", {}).get(seed, {}).get(key)
    return float(v) if isinstance(v, int | float) and math.isfinite(v) else None


def _counts(row: dict[str, Any], seeds: list[int], keys: list[str]) -> list[tuple[int, int]] | None:
    """The (right, examples) of each (seed, key) of ``row``, or None where one is missing or not a count."""
    out = []
    for s in seeds:
        for k in keys:
            n = (row.get("examples") or {}).get(k)
            v = _value(row, s, k)
            if not n or v is None:
                return None
            right = v * n
            if abs(right - round(right)) > 1e-6 * n:  # not k / n: the stored value is not a share of n examples
                return None
            out.append((int(round(right)), int(n)))
    return out


def diff_bounds(metric: str) -> tuple[float, float] | None:
    """The range a difference of two values of ``metric`` can take, or None if unbounded."""
    rng = metric_range(metric)
    if rng is None or not all(math.isfinite(x) for x in rng):
        return None
    width = rng[1] - rng[0]
    return -width, width


def compare(a: dict[str, Any], b: dict[str, Any], level: float = 1 - ALPHA) -> Separation:
    """Row ``a`` against row ``b`` of one task (leaderboard rows, :func:`.rows.leaderboard`), on the seeds they
    share, at confidence ``level`` (the module's rule: the examples pooled where they are counts, else the seeds)."""
    higher = a["higher_is_better"]
    sign = 1.0 if higher else -1.0
    seeds = sorted(set(a.get("seed_scores", {})) & set(b.get("seed_scores", {})))
    per_seed = [sign * (a["seed_scores"][s] - b["seed_scores"][s]) for s in seeds]
    finite = [d for d in per_seed if math.isfinite(d)]
    diff = statistics.fmean(per_seed) if seeds and len(finite) == len(per_seed) else float("nan")
    out = Separation(a["label"], b["label"], diff, None, None, "", seeds, per_seed, level=level)
    if not seeds or diff != diff:
        return out
    keys = a.get("score_keys") or []
    z = z_quantile(1 - (1 - level) / 2)
    ca = _counts(a, seeds, keys) if higher and keys == b.get("score_keys") else None
    cb = _counts(b, seeds, keys) if ca is not None else None
    if ca is not None and cb is not None and is_pct(a["metric"]):
        est, lo, hi = mover(ca, cb, z)
        out.diff, out.low, out.high, out.method = est, lo, hi, "examples"
        out.strata, out.examples = len(ca), sorted({n for _, n in ca + cb})
        return out
    got = paired_t(per_seed, level, diff_bounds(a["metric"]))
    if got is not None:
        out.low, out.high = got
        out.method = "seeds"
    return out


def family_level(n_rows: int) -> float:
    """The confidence level of each pair's interval in a task of ``n_rows`` rows (Bonferroni over its pairs)."""
    pairs = max(1, n_rows * (n_rows - 1) // 2)
    return 1 - ALPHA / pairs


def compare_all(rows: list[dict[str, Any]]) -> dict[tuple[str, str], Separation]:
    """Every pair of a task's rows, ``(a, b)`` for ``a`` ranked above ``b``, at the family's level."""
    level = family_level(len(rows))
    return {(a["label"], b["label"]): compare(a, b, level) for i, a in enumerate(rows) for b in rows[i + 1 :]}
