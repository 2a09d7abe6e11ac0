"""The properties of ``posenc inspect`` about the codes (scores) along the positions themselves: each position (offset)
has its own (``unique``), one step moves it a little (``continuous``), far values do not grow with the length
(``bounded``), and a position's code does not depend on the sequence length (``consistent``). Imports
:mod:`posenc.analysis.probe` and :mod:`~posenc.analysis.measurement`.
"""

from __future__ import annotations

import math

import torch

from .measurement import (
    REL_TOL,
    Measurement,
    _arange,
    _fmt,
    _rel_diff,
    offset_profiles,
)
from .probe import Probe, Unmeasurable, _short


def measure_unique(probe: Probe) -> Measurement:
    L = probe.length
    if probe.kind == "attention":
        prof = offset_profiles(probe, L)
        d = torch.cdist(prof, prof)
        d.fill_diagonal_(float("inf"))
        scale = max(float(prof.abs().max()), 1e-12)
        i, j = divmod(int(d.argmin()), L)
        dmin = float(d.min())
        holds = dmin > REL_TOL * scale
        value = (
            f"min distance between offset profiles {_fmt(dmin)} (offsets {min(i, j)}, {max(i, j)}; "
            f"|score| up to {_fmt(scale)})"
        )
        how = f"scores of a query at {L - 1} with keys 0..{L - 1}, over {prof.shape[1]} content draws x heads"
        return Measurement("unique", value, holds, how=how, data=dict(min_distance=dmin, pair=(min(i, j), max(i, j))))
    c = probe.code(_arange(L))
    d = torch.cdist(c, c)
    d.fill_diagonal_(float("inf"))
    scale = max(float(c.norm(dim=-1).max()), 1e-12)
    i, j = divmod(int(d.argmin()), L)
    dmin = float(d.min())
    holds = dmin > REL_TOL * scale
    value = f"min ||PE_i - PE_j|| = {_fmt(dmin)} (positions {min(i, j)}, {max(i, j)}; max norm {_fmt(scale)})"
    return Measurement(
        "unique", value, holds, how=f"all pairs of positions 0..{L - 1}", data=dict(min_distance=dmin, pair=(i, j))
    )


def measure_continuous(probe: Probe) -> Measurement:
    L = probe.length
    if probe.kind == "attention":
        c = offset_profiles(probe, L)
        what = "offset profiles"
    else:
        c = probe.code(_arange(L))
        what = "codes"
    steps = (c[1:] - c[:-1]).norm(dim=-1)
    d = torch.cdist(c, c)
    iu = torch.triu_indices(L, L, offset=1)
    med_dist = float(d[iu[0], iu[1]].median())
    med_step, max_step = float(steps.median()), float(steps.max())
    if med_dist == 0:
        return Measurement("continuous", "all codes are equal", False, how=what, data={})
    uniform = max_step <= 1.5 * max(med_step, 1e-12 * med_dist) and med_step > 0
    small = med_step <= 0.5 * med_dist
    holds = uniform and small
    t = int(steps.argmax())
    value = (
        f"largest/median step {_fmt(max_step / med_step) if med_step else 'inf'} (largest at {t}->{t + 1}); "
        f"median step/median distance {_fmt(med_step / med_dist)}"
    )
    return Measurement(
        "continuous",
        value,
        holds,
        how=f"adjacent {what} over 0..{L - 1}: largest/median step <= 1.5 and median step <= 0.5 x median distance",
        data=dict(max_step=max_step, median_step=med_step, median_distance=med_dist),
    )


def _far_and_max(probe: Probe, n: int) -> tuple[float, float]:
    """Mean ``|value|`` over the farthest 10% of positions (offsets) and the largest ``|value|``, at length n."""
    tail = max(1, n // 10)
    if probe.kind == "attention":
        s = probe.scores(torch.tensor([n - 1]), _arange(n))[..., 0, :]  # keys 0..n-1 of the last query
        return float(s[..., :tail].abs().mean()), float(s.abs().max())
    c = probe.code(_arange(n))
    return float(c[-tail:].abs().mean()), float(c.abs().max())


def measure_bounded(probe: Probe) -> Measurement:
    L = probe.length
    lengths = [L, 2 * L, 4 * L, 8 * L]
    far: list[float] = []
    top: list[float] = []
    for n in lengths:
        try:
            f, m = _far_and_max(probe, n)
        except Unmeasurable:
            raise
        except Exception as e:
            if n == L:
                raise
            return Measurement(
                "bounded",
                f"n/a: max |value| {_fmt(top[0])} at L={L}, but not defined at length {n} ({_short(e)})",
                None,
                how="not measurable past the table",
                data=dict(lengths=lengths[: len(far)], far=far, max=top),
            )
        far.append(f)
        top.append(m)
    growth = far[-1] / max(far[0], 1e-12)
    top_growth = top[-1] / max(top[0], 1e-12)
    finite = all(math.isfinite(v) for v in far + top)
    holds = finite and (growth <= 1.2 or top_growth <= 1.05)
    what = "|score|" if probe.kind == "attention" else "|PE|"
    where = "keys farthest from the last query" if probe.kind == "attention" else "last positions"
    value = (
        f"mean {what} over the {where}: "
        + ", ".join(f"{_fmt(v)} (L={n})" for n, v in zip(lengths, far))
        + f" (x{_fmt(growth)}); max {what} {_fmt(top[0])} -> {_fmt(top[-1])}"
    )
    return Measurement(
        "bounded",
        value,
        holds,
        how=f"mean {what} over the farthest 10% of positions at lengths L, 2L, 4L, 8L; holds when it grows <= 1.2x "
        "or the largest value grows <= 1.05x",
        data=dict(lengths=lengths, far=far, max=top, growth=growth),
    )


def measure_consistent(probe: Probe, short_length: int) -> Measurement:
    L, s = probe.length, short_length
    if probe.kind == "attention":
        a = probe.scores(_arange(s), _arange(s))
        b = probe.scores(_arange(L), _arange(L))[..., :s, :s]
    else:
        a = probe.code(_arange(s))
        b = probe.code(_arange(L))[:s]
    diff = _rel_diff(a, b)
    holds = diff <= REL_TOL
    what = "scores" if probe.kind == "attention" else "codes"
    value = f"max relative difference of the {what} of positions 0..{s - 1} at length {s} vs {L}: {_fmt(diff)}"
    return Measurement("consistent", value, holds, how=f"lengths {s} and {L}", data=dict(rel_diff=diff))
