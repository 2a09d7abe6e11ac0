"""The properties of ``posenc inspect`` about the trained length: defined and in range past it (``extrapolates``), and
a parameter count that does not grow with ``max_len`` (``params_constant``). Imports :mod:`posenc.analysis.probe`
and :mod:`~posenc.analysis.measurement`.
"""

from __future__ import annotations

import torch

from .measurement import (
    Measurement,
    _arange,
    _fmt,
)
from .probe import Probe, Unmeasurable, _short


def measure_extrapolates(probe: Probe) -> Measurement:
    L = probe.length
    n = 4 * L
    try:
        if probe.kind == "attention":
            qs = torch.tensor([L - 1, 2 * L, n - 1])
            s = probe.scores(qs, _arange(n))
            within = float(s[..., :1, :L].abs().max())
            past = float(s.abs().max())
            finite = bool(torch.isfinite(s).all())
        else:
            c = probe.code(_arange(n))
            within = float(c[:L].abs().max())
            past = float(c[L:].abs().max())
            finite = bool(torch.isfinite(c).all())
    except Unmeasurable:
        raise
    except Exception as e:
        return Measurement(
            "extrapolates",
            f"not defined past the trained length {L}: {_short(e)}",
            False,
            how=f"positions up to {n - 1} with max_len={L}",
            data=dict(defined=False),
        )
    ratio = past / max(within, 1e-12)
    holds = finite and ratio <= 1.5
    value = f"finite: {'yes' if finite else 'no'}; max |value| past L / within L: {_fmt(ratio)}"
    return Measurement(
        "extrapolates",
        value,
        holds,
        how=f"positions up to 4L = {n - 1}, trained length L = {L}; holds when finite and the range grows <= 1.5x",
        data=dict(defined=True, finite=finite, ratio=ratio),
    )


def measure_params(probe: Probe) -> Measurement:
    if not probe.from_name:
        counts = [probe.parameter_count()]
        return Measurement(
            "params_constant",
            f"{counts[0]} parameters (growth not measured: built from an instance)",
            None,
            data=dict(counts=counts),
        )
    L = probe.length
    lengths = [L, 2 * L, 4 * L]
    counts = []
    for n in lengths:
        counts.append(probe.parameter_count(probe.build(n)))
    d1, d2 = counts[1] - counts[0], counts[2] - counts[1]
    if d1 == 0 and d2 == 0:
        growth = "constant in max_len"
    elif d2 == 2 * d1:
        growth = f"linear in max_len (+{d1 // L} per position)" if d1 % L == 0 else "linear in max_len"
    else:
        growth = "grows with max_len"
    others = ", ".join(f"{c} at {n}" for n, c in zip(lengths[1:], counts[1:]))
    value = f"{counts[0]} at max_len={L} ({growth}; {others})"
    return Measurement(
        "params_constant",
        value,
        d1 == 0 and d2 == 0,
        how="trainable parameters of the encoding at max_len = L, 2L, 4L",
        data=dict(lengths=lengths, counts=counts),
    )
