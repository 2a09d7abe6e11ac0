r"""HoPE: High-frequency rotary Position Encoding (Chen et al. 2025).

Chen, Lv, Luan, Wang, Liu, "HoPE: A Novel Positional Encoding Without Long-Term Decay for Enhanced Context
Awareness and Extrapolation" (ACL 2025; arXiv 2410.21216). The paper finds that trained models attend with a
U shape (near and initial tokens), made by the RoPE components whose rotation does not complete a full turn within
the training length -- those whose angle ``θ_i t`` only sweeps part of a period over ``t < L`` (the "activated"
components) and the lowest ones, which settle into near-constant patterns and carry semantics. HoPE replaces those
components with position-independent ones and keeps only the high-frequency signals:

.. math::
    \theta_i^{\mathrm{H}} = \begin{cases} \theta_i = \mathrm{base}^{-2i/d} & \theta_i L \ge 2\pi \\
                                        0 & \theta_i L < 2\pi \end{cases}, \qquad
    \mathrm{HoPE}(x, m) = x \odot \cos(m\Theta^{\mathrm{H}}) + \mathrm{rotate\_half}(x) \odot \sin(m\Theta^{\mathrm{H}})

with ``L`` the training length (``max_len``): a component is kept when its period ``2π/θ_i`` fits in the training
length, so that every kept one has been seen through at least one whole turn; the others rotate by 0, the
position-independent part, and the scores lose RoPE's long-term decay (they do not decay with the distance, the
point of the paper). Written from the paper's definition as stated above (its text and code were not at hand
here: the tests check this formula); with ``L < 2π`` (``max_len <= 6``) no component qualifies and it is NoPE.

Layout rotate-half, as ``rope``. Precision: as ``rope`` (:func:`~posenc.rotary.rope.rope_angles`); the choice of
the kept components compares the float32 ``θ_i`` with ``2π / L`` in float64.
"""

from __future__ import annotations

import math

import torch

from ..base import Card
from ..errors import ConfigError
from ..registry import register
from .prope import _TruncatedRoPE, check_even_head_dim


def high_frequency_count(inv_freq: torch.Tensor, length: int) -> int:
    """How many of RoPE's ``θ_i`` (highest first) complete a whole turn within ``length`` positions: ``θ_i L >= 2π``."""
    return int((inv_freq.double() * length >= 2 * math.pi).sum())


@register
class HoPE(_TruncatedRoPE):
    r"""HoPE: RoPE keeping only the components that complete a full turn within the training length ``L``.

    .. math::
        \theta_i^{\mathrm{HoPE}} = \theta_i\ \text{if}\ \theta_i L \ge 2\pi, \qquad 0\ \text{otherwise}

    Args:
        head_dim: head width ``d``, even.
        max_len: ``L``, the training length (a model passes its own ``max_len``).
        base: RoPE's frequency base.
    """

    info = Card(
        name="hope",
        title="HoPE (high-frequency RoPE, no long-term decay)",
        paper=(
            "Chen et al., HoPE: A Novel Positional Encoding Without Long-Term Decay for Enhanced Context Awareness "
            "and Extrapolation (ACL)"
        ),
        year=2025,
        family="rotary",
        position="relative",
        learnable=False,
        summary="RoPE keeping only the frequencies that turn fully within the training length L; the rest unrotated.",
        reference="the paper's formula as a naive per-pair loop (float64; float32 phases: within m·2^-24 rad)",
        aliases=("hope-rope", "high-frequency-rope"),
    )
    # the paper's title: no long-term decay (its kept components all turn fully within L, so the mean score does
    # not fall with the distance), besides what every truncated RoPE keeps of RoFormer's claims
    claims = {**_TruncatedRoPE.claims, "decay": False}

    def __init__(self, head_dim: int, max_len: int, base: float = 10000.0):
        check_even_head_dim(self.info.name, head_dim)
        if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
            raise ConfigError(f"hope: max_len is the training length L and must be a positive integer, got {max_len!r}")
        super().__init__(head_dim, base)
        self.max_len = max_len
        kept = high_frequency_count(self.inv_freq, max_len)
        if kept < 1:
            # the highest frequency, theta_0 = 1, turns fully once L >= 2*pi
            least = math.ceil(2 * math.pi / float(self.inv_freq.double().max()))
            raise ConfigError(
                f"encoding 'hope': with max_len={max_len} no frequency of RoPE turns fully (theta_i * L >= 2*pi), so "
                f"every pair would be left unrotated, which is NoPE (encoding 'nope'); the smallest max_len that keeps "
                f"one pair is {least}"
            )
        self._truncate(kept)
