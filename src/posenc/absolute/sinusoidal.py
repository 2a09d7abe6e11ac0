"""Sinusoidal absolute encodings (Vaswani et al. 2017), in both layouts."""

from __future__ import annotations

import torch
from torch import Tensor

from ..base import Card
from ..errors import ConfigError
from ..registry import register
from ._additive import AdditiveAbsolute


def inverse_frequencies(dim: int, base: float = 10000.0) -> Tensor:
    r"""``ω_i = base^{-2i/dim}`` for ``i = 0 .. dim/2 - 1`` (float64)."""
    return base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)


@register
class Sinusoidal(AdditiveAbsolute):
    r"""Sinusoidal position encoding, interleaved layout (Vaswani et al. 2017, section 3.5).

    .. math::
        PE_{(pos, 2i)}   = \sin\!\left(pos / 10000^{2i/d_{model}}\right) \\
        PE_{(pos, 2i+1)} = \cos\!\left(pos / 10000^{2i/d_{model}}\right)

    Bounded, unique over a very long range, and ``PE_{pos+k} = R_k PE_{pos}``
    with ``R_k`` a block-diagonal rotation by ``ω_i k`` (Xixiaoyao, "Three positional
    encoding methods", eq. 9), so ``PE_t · PE_{t+k} = Σ_i cos(ω_i k)`` depends on ``|k|``
    only -- it cannot tell before from after (Wu (2022)). ``base`` (10000) is configurable.
    """

    info = Card(
        name="sinusoidal",
        title="Sinusoidal (interleaved sin, cos)",
        paper="Vaswani et al., Attention Is All You Need",
        year=2017,
        family="absolute",
        position="absolute",
        learnable=False,
        summary="PE(pos,2i)=sin(pos/10000^(2i/d)), PE(pos,2i+1)=cos(...).",
        reference="PE(1) as written out in Wu (2022); PE_{t+k} = R_k PE_t; Σ cos(ω k) dot products",
        shortcoming="dot products are symmetric in the offset: no direction",
    )
    randomized_variant = True
    # Wu (2022); anon., "Positional encoding of the Transformer"; Xixiaoyao, "Three positional encoding methods"
    claims = dict(
        unique=True,
        continuous=True,
        bounded=True,
        consistent=True,
        linear_offset=True,
        direction_aware=False,
        decay=True,
        extrapolates=True,
        params_constant=True,
    )
    concat = False

    def __init__(self, d_model: int, base: float = 10000.0):
        super().__init__()
        if not isinstance(d_model, int) or d_model <= 0 or d_model % 2:
            raise ConfigError(f"{self.info.name} needs an even, positive d_model (sin/cos pairs), got {d_model!r}")
        if base <= 1:
            raise ConfigError(f"base must be > 1, got {base}")
        self.d_model, self.base = d_model, base
        self.register_buffer("inv_freq", inverse_frequencies(d_model, base), persistent=False)

    def angles(self, positions: Tensor) -> Tensor:
        """``pos · ω_i``: ``[..., d/2]`` in float64."""
        return positions[..., None].double() * self.inv_freq

    def table(self, positions: Tensor) -> Tensor:
        a = self.angles(positions)
        if self.concat:
            out = torch.cat([a.sin(), a.cos()], dim=-1)
        else:
            out = torch.stack([a.sin(), a.cos()], dim=-1).flatten(-2)
        return out.float()


@register
class SinusoidalConcat(Sinusoidal):
    r"""Sinusoidal position encoding, concatenated layout.

    The layout of ``FixedAbsolutePositionEmbedding`` in anon., "Positional encoding of the Transformer".

    .. math::
        PE_{pos} = [\sin(pos\,\omega_0), \dots, \sin(pos\,\omega_{d/2-1}),
                    \cos(pos\,\omega_0), \dots, \cos(pos\,\omega_{d/2-1})],
        \quad \omega_i = 10000^{-2i/d}

    The same numbers as ``sinusoidal``, permuted: sines in the first half,
    cosines in the second (as many implementations, e.g. tensor2tensor, lay
    them out).
    """

    info = Card(
        name="sinusoidal-concat",
        title="Sinusoidal (sin | cos halves)",
        paper='Vaswani et al., Attention Is All You Need (layout of anon., "Positional encoding of the Transformer")',
        year=2017,
        family="absolute",
        position="absolute",
        learnable=False,
        summary="[sin(pos ω) | cos(pos ω)]: the sinusoid with the halves concatenated.",
        reference=(
            'FixedAbsolutePositionEmbedding of anon., "Positional encoding of the Transformer"; '
            "a permutation of 'sinusoidal'"
        ),
        shortcoming="dot products are symmetric in the offset: no direction",
    )
    concat = True
