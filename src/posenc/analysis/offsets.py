"""The properties of ``posenc inspect`` about offsets between positions: a linear map takes ``PE_t`` to ``PE_{t+k}``
(``linear_offset``), ``+k`` and ``-k`` score differently (``direction_aware``), only the offset matters
(``relative_only``), and the score falls with the distance (``decay``). Imports :mod:`posenc.analysis.probe` and
:mod:`~posenc.analysis.measurement`.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .measurement import (
    REL_TOL,
    Measurement,
    _arange,
    _fmt,
    _rel_diff,
    _spearman,
    mean_score_by_offset,
)
from .probe import Probe, Unmeasurable


def measure_linear_offset(probe: Probe) -> Measurement:
    if probe.kind == "attention" and not probe.rotary_only:
        raise Unmeasurable(f"no per-position code ({', '.join(probe.hooks)} act on scores)")
    L = probe.length
    c = probe.code(_arange(L))
    D = c.shape[-1]
    ks = [k for k in (1, 2, 4, 8, L // 4) if L - k >= D + 1]
    if not ks:
        raise Unmeasurable(f"needs length > dim + 1 positions to fit a {D}x{D} map (length={L})")
    res = {}
    for k in sorted(set(ks)):
        x, y = c[: L - k], c[k:]
        # gelsd (SVD): codes with constant dimensions (rotary pairs at frequency 0, p-RoPE, HoPE) are exactly rank
        # deficient, where gelsy's pivoted QR left residuals of 1e-3..0.4 for an exact map
        sol = torch.linalg.lstsq(x, y, driver="gelsd").solution
        r = float((x @ sol - y).norm()) / max(float(y.norm()), 1e-12)
        res[k] = r
    worst = max(res.values())
    holds = worst <= REL_TOL
    value = "residual ||PE_{t+k} - T_k PE_t|| / ||PE_{t+k}||: " + ", ".join(f"k={k}: {_fmt(r)}" for k, r in res.items())
    return Measurement(
        "linear_offset",
        value,
        holds,
        how=f"least squares over t = 0..L-k-1, L={L}; holds when every residual <= {REL_TOL}",
        data=dict(residuals=res),
    )


def measure_direction(probe: Probe) -> Measurement:
    L = probe.length
    pos = _arange(L)
    s = probe.scores(pos, pos)  # [B, H, L, L]
    diffs, scale = [], max(float(s.abs().max()), 1e-12)
    for k in range(1, L // 2):
        i = torch.arange(k, L - k)
        fwd, bwd = s[..., i, i + k], s[..., i, i - k]
        diffs.append(float((fwd - bwd).abs().mean()))
    d = max(diffs) / scale
    holds = d > REL_TOL
    what = "PE_t·PE_{t+k} vs PE_t·PE_{t-k}" if probe.kind == "code" else "score(t, t+k) vs score(t, t-k)"
    extra = ""
    data: dict[str, Any] = dict(rel_diff=d)
    if probe.kind == "code":
        sw = probe.scores_through_w(pos, pos)
        dws = []
        for k in range(1, L // 2):
            i = torch.arange(k, L - k)
            dws.append(float((sw[..., i, i + k] - sw[..., i, i - k]).abs().mean()))
        dw = max(dws) / max(float(sw.abs().max()), 1e-12)
        extra = f"; through a random W: {_fmt(dw)}"
        data["rel_diff_through_w"] = dw
    value = f"largest mean |{what}| / max|score|: {_fmt(d)}{extra}"
    return Measurement("direction_aware", value, holds, how=f"k = 1..{L // 2 - 1}, same query t", data=data)


def measure_relative_only(probe: Probe) -> Measurement:
    L = probe.length // 2  # positions 0..L/2-1 shifted by up to L/2 stay inside a table of max_len = L
    pos = _arange(L)
    base = probe.scores(pos, pos)
    diffs = {}
    for shift in (1, 7, L):
        diffs[shift] = _rel_diff(probe.scores(pos + shift, pos + shift), base)
    worst = max(diffs.values())
    holds = worst <= REL_TOL
    value = "max relative change of the scores when all positions shift by " + ", ".join(
        f"{s}: {_fmt(d)}" for s, d in diffs.items()
    )
    data: dict[str, Any] = dict(rel_diffs=diffs)
    if probe.kind == "code":
        dw = _rel_diff(probe.scores_through_w(pos + 7, pos + 7), probe.scores_through_w(pos, pos))
        value += f"; through a random W (shift 7): {_fmt(dw)}"
        data["rel_diff_through_w"] = dw
    return Measurement("relative_only", value, holds, how=f"positions 0..{L - 1} vs shifted", data=data)


def measure_decay(probe: Probe) -> Measurement:
    L = probe.length
    offsets, means = mean_score_by_offset(probe, L)
    stats = {}
    for side, sel in (("past", offsets <= 0), ("future", offsets >= 0)):
        dist, m = offsets[sel].abs().double(), means[sel]
        near = float(m[dist == 0].mean())
        far = float(m[dist >= 0.75 * (L - 1)].mean())
        stats[side] = (_spearman(dist, m), near, far)
    rho, near, far = stats["past"]
    holds = rho <= -0.5 and far < near
    content = " (content q = k, mean over draws and heads)" if probe.kind == "attention" else ""
    value = (
        f"keys before the query: rank correlation of the mean score with |k| {_fmt(rho)}, "
        f"score at k=0 {_fmt(near)}, at |k| >= {math.ceil(0.75 * (L - 1))}: {_fmt(far)}; "
        f"keys after: rank correlation {_fmt(stats['future'][0])}"
    )
    return Measurement(
        "decay",
        value,
        holds,
        how=f"mean score(i, i-k) over queries i, k = 0..{L - 1}{content}; holds when the rank correlation "
        "with k is <= -0.5 for keys before the query (the direction every model sees)",
        data=dict(spearman=rho, near=near, far=far, future_spearman=stats["future"][0]),
    )
