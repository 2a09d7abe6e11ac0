"""The naive position codes of anon., "Positional encoding of the Transformer", each with its shortcoming.

That article (see docs/background.md) walks from the simplest idea to the sinusoid, and each step fixes the
previous step's flaw. They are here so that the flaws can be *measured*
(``posenc inspect``) and seen to matter in training (``posenc bench``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..base import Card
from ..errors import ConfigError
from ..registry import register
from ._additive import AdditiveAbsolute

#: the article these codes come from (docs/background.md)
_ARTICLE = 'anon., "Positional encoding of the Transformer"'


def _check_dim(d_model: int) -> None:
    if not isinstance(d_model, int) or d_model <= 0:
        raise ConfigError(f"d_model must be a positive integer, got {d_model!r}")


def alternating(d_model: int) -> Tensor:
    """``u = (+1, -1, +1, ...)``: the direction a scalar position code is written along.

    A scalar code added equally to every dimension (``t · (1, 1, ..., 1)``) is erased
    by LayerNorm, which subtracts the mean over dimensions: a pre-LN model would
    never see it. ``u`` has (near) zero mean, so it survives the normalisation while
    every coordinate still holds ``±t``.
    """
    u = torch.ones(d_model)
    u[1::2] = -1.0
    return u


@register
class IntegerPosition(AdditiveAbsolute):
    r"""Integer position index (anon., "Positional encoding of the Transformer", section 1).

    .. math:: PE_t = (t + s)\,u, \quad u = (+1, -1, +1, \dots)

    Every dimension carries the index itself (with alternating sign, see
    :func:`alternating`: a code equal in all dimensions would be erased by
    LayerNorm), counted from ``s`` (``start=1``: "the first token is 1, the
    second 2"). Shortcoming: unbounded -- the code
    grows without limit with the length, so lengths unseen in training give
    inputs of a scale the model never saw.
    """

    info = Card(
        name="integer",
        title="Integer position index",
        paper=f"{_ARTICLE} (naive baseline)",
        year=2017,
        family="absolute",
        position="absolute",
        learnable=False,
        summary="PE_t = t in every dimension: unique but unbounded.",
        shortcoming="unbounded: |PE_t| grows linearly with t",
    )
    claims = {"unique": True}  # the article: unique but unbounded

    def __init__(self, d_model: int, start: int = 1):
        super().__init__()
        _check_dim(d_model)
        self.d_model, self.start = d_model, start
        self.register_buffer("u", alternating(d_model), persistent=False)

    def table(self, positions: Tensor) -> Tensor:
        t = (positions + self.start).float()
        return t[..., None] * self.u


@register
class NormalizedPosition(AdditiveAbsolute):
    r"""Position scaled to [0, 1] (anon., "Positional encoding of the Transformer", section 2).

    .. math:: PE_t = \frac{t}{N - 1}\,u, \quad u = (+1, -1, +1, \dots)

    ``N`` is the length of the sequence (the largest position in the row plus
    one, or ``length`` if given): 3 tokens give ``[0, 0.5, 1]``. Shortcoming:
    the same offset means different distances at different lengths (0.5 at
    N = 3, 0.33 at N = 4), so nothing learned about "the next word" transfers
    across lengths.

    Padding: ``N`` is the sequence's own length, not the padded batch's. The models give the padding tokens of
    an ``attention_mask`` position 0 for this code (``codes_read_the_row``), so a sequence right-padded beside a
    longer one gets the codes (and the outputs) it gets alone (tests/test_bad_input.py). Called directly (``embed``,
    ``forward``, ``codes``) it sees positions only: give the padding position 0 there
    (``positions=torch.arange(L) * attention_mask``), or fix ``length``.
    """

    info = Card(
        name="normalized",
        title="[0,1]-normalised position",
        paper=f"{_ARTICLE} (naive baseline)",
        year=2017,
        family="absolute",
        position="absolute",
        learnable=False,
        summary="PE_t = t/(N-1): bounded, but an offset's size depends on the length N.",
        shortcoming="inconsistent across lengths: offset 1 is 1/(N-1)",
    )
    claims = {"bounded": True, "unique": True}  # the article: bounded, inconsistent across lengths
    codes_read_the_row = True  # N is the row's largest position + 1: the models hide the padding from it

    def __init__(self, d_model: int, length: int | None = None):
        super().__init__()
        _check_dim(d_model)
        if length is not None and length < 1:
            raise ConfigError(f"length must be >= 1, got {length}")
        self.d_model, self.length = d_model, length
        self.register_buffer("u", alternating(d_model), persistent=False)

    def cache_problem(self, shortest: int, longest: int) -> str | None:
        if self.length is None:
            return (
                f"{self.info.name} divides every position by the current length N - 1, so every token's code "
                "changes as N grows"
            )
        return None

    def table(self, positions: Tensor) -> Tensor:
        if self.length is not None:
            n = torch.full_like(positions[..., :1], self.length)
        else:
            n = positions.max(dim=-1, keepdim=True).values + 1
        t = positions.float() / (n - 1).clamp(min=1).float()
        return t[..., None] * self.u


@register
class BinaryPosition(AdditiveAbsolute):
    r"""Binary code of the position (anon., "Positional encoding of the Transformer", section 3).

    .. math:: PE_t[i] = \left\lfloor t / 2^i \right\rfloor \bmod 2, \quad i = 0 \dots D-1

    Dimension ``i`` holds bit ``i`` of ``t`` (least significant first). Bounded
    in [0, 1] and unique for ``t < 2^D``. Shortcoming: discontinuous -- 7 -> 8
    flips four bits at once, so the distance between neighbours jumps around.
    """

    info = Card(
        name="binary",
        title="Binary position vector",
        paper=f"{_ARTICLE} (naive baseline)",
        year=2017,
        family="absolute",
        position="absolute",
        learnable=False,
        summary="Bit i of t in dimension i: bounded and unique, but discontinuous.",
        shortcoming="discontinuous: neighbouring positions can differ in many bits",
    )
    claims = {"unique": True, "bounded": True}  # the article: unique, bounded, discontinuous

    def __init__(self, d_model: int):
        super().__init__()
        _check_dim(d_model)
        self.d_model = d_model
        bits = min(d_model, 62)
        self.max_len = 2**bits
        self.register_buffer("shifts", torch.arange(d_model).clamp(max=62), persistent=False)

    def table(self, positions: Tensor) -> Tensor:
        # positions are < 2**62, so bits 62 and above are 0 (the shift is clamped to 62)
        return ((positions[..., None].long() >> self.shifts) & 1).float()


@register
class SinPow2Position(AdditiveAbsolute):
    r"""Sine codes with frequencies 1/2^i (anon., "Positional encoding of the Transformer", section 4).

    .. math:: PE_t[i] = \sin\!\left(\frac{t}{2^{i}}\right), \quad i = 0 \dots D-1

    The continuous version of the binary code: dimension ``i`` varies about
    half as fast as dimension ``i-1``. Shortcoming: the fast dimensions wrap
    around after a few positions, and with sine alone ``PE_{t+k}`` is not a
    linear function of ``PE_t`` (that needs the cosine partner, section 5).
    """

    info = Card(
        name="sin-pow2",
        title="Sine with frequencies 1/2^i",
        paper=f"{_ARTICLE} (naive baseline)",
        year=2017,
        family="absolute",
        position="absolute",
        learnable=False,
        summary="sin(t / 2^i): continuous and bounded, no linear offset map.",
        shortcoming="no linear map PE_t -> PE_{t+k}; fast dimensions alias",
    )
    claims = {"bounded": True, "continuous": True}

    def __init__(self, d_model: int):
        super().__init__()
        _check_dim(d_model)
        self.d_model = d_model
        self.register_buffer("freq", 0.5 ** torch.arange(d_model, dtype=torch.float64), persistent=False)

    def table(self, positions: Tensor) -> Tensor:
        return torch.sin(positions[..., None].double() * self.freq).float()


@register
class SinOnlyPosition(AdditiveAbsolute):
    r"""Sine codes with frequencies 1/10000^(i/(D-1)) (anon., "Positional encoding of the Transformer", section 4).

    .. math:: PE_t[i] = \sin\!\left(\frac{t}{10000^{i/(D-1)}}\right), \quad i = 0 \dots D-1

    Stretches the wavelengths from 2π to 10000·2π so that codes stay distinct
    over long ranges. Shortcoming: still sine only, so ``PE_{t+k}`` is not a
    linear function of ``PE_t`` -- the motivation for sin/cos pairs.
    """

    info = Card(
        name="sin-only",
        title="Sine with frequencies 1/10000^(i/(d-1))",
        paper=f"{_ARTICLE} (naive baseline)",
        year=2017,
        family="absolute",
        position="absolute",
        learnable=False,
        summary="sin(t / 10000^(i/(d-1))): slow and bounded, no linear offset map.",
        shortcoming="no linear map PE_t -> PE_{t+k} (sine without cosine)",
    )
    claims = {"bounded": True, "continuous": True}

    def __init__(self, d_model: int, base: float = 10000.0):
        super().__init__()
        _check_dim(d_model)
        self.d_model, self.base = d_model, base
        i = torch.arange(d_model, dtype=torch.float64)
        freq = base ** (-i / max(d_model - 1, 1))
        self.register_buffer("freq", freq, persistent=False)

    def table(self, positions: Tensor) -> Tensor:
        return torch.sin(positions[..., None].double() * self.freq).float()
