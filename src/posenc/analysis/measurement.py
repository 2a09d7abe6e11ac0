"""One measured property (:class:`Measurement`) and what the measures of ``posenc inspect`` share: the tolerance
under which two values count as equal, number formatting, rank correlation, and the score profiles by offset.
Imports torch and :mod:`posenc.analysis.probe`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .names import PROPERTY_TITLES
from .probe import Probe

REL_TOL = 1e-3  # relative tolerance under which two float32 quantities count as equal


@dataclass
class Measurement:
    """One row of a property card."""

    key: str
    value: str  # the measured value, for people
    holds: bool | None  # None: not measurable
    claim: bool | None = None
    how: str = ""
    data: dict[str, Any] = field(default_factory=dict)

    @property
    def title(self) -> str:
        return PROPERTY_TITLES.get(self.key, self.key)

    @property
    def measurable(self) -> bool:
        return self.holds is not None

    @property
    def verdict(self) -> str:
        """``pass`` (the measurement agrees with the claim), ``FAIL``, ``-`` (no claim) or ``n/a``."""
        if self.holds is None:
            return "n/a"
        if self.claim is None:
            return "-"
        return "pass" if self.holds == self.claim else "FAIL"


def _fmt(x: float) -> str:
    if x != x:  # nan
        return "nan"
    if math.isinf(x):
        return "inf"
    if x == 0:
        return "0"
    a = abs(x)
    if a >= 1e4 or a < 1e-3:
        return f"{x:.2e}"
    return f"{x:.4g}"


def _rel_diff(a: Tensor, b: Tensor) -> float:
    scale = max(float(b.abs().max()), float(a.abs().max()), 1e-12)
    return float((a - b).abs().max()) / scale


def _spearman(x: Tensor, y: Tensor) -> float:
    rx = x.argsort().argsort().double()
    ry = y.argsort().argsort().double()
    rx, ry = rx - rx.mean(), ry - ry.mean()
    den = float(rx.norm() * ry.norm())
    return float((rx * ry).sum()) / den if den > 0 else 0.0


def _arange(n: int, start: int = 0) -> Tensor:
    return torch.arange(start, start + n)


def offset_profiles(probe: Probe, length: int) -> Tensor:
    """Scores of a query at position ``length-1`` and keys ``0 .. length-1``: ``[length, n]``.

    Row ``k`` is the profile (over content draws and heads) of the key ``k`` positions back.
    """
    q = torch.tensor([length - 1])
    s = probe.scores(q, _arange(length))  # [B, H, 1, L]
    prof = s[:, :, 0, :].reshape(-1, length).T  # [L(key), n]
    return prof.flip(0)  # row k: the key k positions back


def mean_score_by_offset(probe: Probe, length: int, *, through_w: bool = False) -> tuple[Tensor, Tensor]:
    """Offsets ``-(L-1) .. L-1`` and the mean score ``score(i, i+k)`` over queries i (and content q = k)."""
    pos = _arange(length)
    if through_w:
        s = probe.scores_through_w(pos, pos)
    else:
        s = probe.scores(pos, pos, same_content=True)
    s = s.mean(dim=(0, 1)) if s.dim() == 4 else s  # [L, L]
    offsets = torch.arange(-(length - 1), length)
    means = torch.stack([torch.diagonal(s, offset=int(k)).mean() for k in offsets])
    return offsets, means
