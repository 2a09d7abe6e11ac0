r"""p-RoPE: RoPE with its lowest frequencies removed (Barbero et al. 2025).

Barbero, Vitvitskyi, Perivolaropoulos, Pascanu, Veličković, "Round and Round We Go! What makes Rotary
Positional Encodings useful?" (ICLR 2025). Studying Gemma 7B, the paper finds that the highest RoPE frequencies
build the positional attention patterns while the lowest ones are used as (non-robust) semantic channels, and
proposes to keep a fraction ``p`` of the frequencies -- the highest -- and leave the other pairs unrotated:

.. math::
    \theta_i = \begin{cases} \mathrm{base}^{-2i/d} & i < k \\ 0 & k \le i < d/2 \end{cases}, \qquad
    k = \lfloor p \cdot d / 2 \rfloor, \qquad
    \mathrm{pRoPE}(x, m) = x \odot \cos(m\Theta) + \mathrm{rotate\_half}(x) \odot \sin(m\Theta)

The kept frequencies are RoPE's own top ``k`` (the exponent is still ``2i/d`` over the whole head, the schedule is
not recomputed over the kept pairs), and the truncated pairs rotate by the angle 0: they carry no position. This
is the paper's pseudocode (``apply_p_rope``: ``rope_angles = int(rope_percentage * head_dim // 2)``, the other
``nope_angles`` pairs unrotated) and Gemma 4's ``proportional`` RoPE in transformers
(``_compute_proportional_rope_parameters``: the top ``k`` of ``base^{-2i/d}``, then zeros), which the tests
compare with. The paper's proposal truncates the lowest frequencies and its pseudocode has no other choice, so
that is the only one offered (the full text was not at hand here; its pseudocode and Gemma's code were).

``p = 1`` is RoPE exactly (the same numbers as ``rope``); as ``p → 0`` fewer pairs rotate, and a ``p`` with
``p · d / 2 < 1`` rotates none: NoPE. Layout rotate-half (pair ``i`` is dimensions ``(i, i + d/2)``), as ``rope``,
the paper's pseudocode and Gemma.

Precision: as ``rope`` (:func:`~posenc.rotary.rope.rope_angles`); the zero frequencies give the angle 0 exactly.
"""

from __future__ import annotations

from torch import Tensor

from ..base import Card, Cost
from ..errors import ConfigError
from ..registry import register
from .rope import RoPE


def keep_highest(inv_freq: Tensor, kept: int) -> Tensor:
    """``inv_freq`` (RoPE's ``θ_i``, highest first) with every frequency from index ``kept`` on set to 0."""
    out = inv_freq.clone()
    out[kept:] = 0.0
    return out


def check_even_head_dim(name: str, head_dim: int) -> None:
    """The head width of an encoding that rotates every pair of it (no ``rotary_dim``): an even integer >= 2."""
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
        hint = f"; use head_dim={head_dim - 1} or {head_dim + 1}" if isinstance(head_dim, int) and head_dim > 1 else ""
        raise ConfigError(
            f"{name} rotates pairs of dimensions, so head_dim must be a positive even integer, got {head_dim!r}{hint}"
        )


class _TruncatedRoPE(RoPE):
    """RoPE whose lowest frequencies are 0 (not registered): ``kept`` pairs rotate, the others carry no position."""

    randomized_variant = False
    # RoFormer's relative scores, direction and boundedness hold for any set of frequencies; its long-term decay is
    # what both papers argue against (the low frequencies that make it are the ones removed)
    claims = dict(relative_only=True, direction_aware=True, bounded=True, linear_offset=True, consistent=True)
    kept: int

    def _truncate(self, kept: int) -> None:
        self.kept = kept
        self.inv_freq = keep_highest(self.inv_freq, kept)

    def cost(self, head_dim: int) -> Cost:
        # the cheapest exact form rotates only the 2·kept dimensions that carry a position (3 per element of q and
        # of k); the kernels rotate every pair, the truncated ones by the angle 0 (cos 1, sin 0)
        return Cost(
            token_elementwise=6.0 * 2 * self.kept,
            note="q and k rotated once per token on the kept pairs only, nothing per pair",
        )


@register
class PRoPE(_TruncatedRoPE):
    r"""p-RoPE: RoPE keeping its highest ``⌊p·d/2⌋`` frequencies, the other pairs unrotated.

    .. math::
        \theta_i = \mathrm{base}^{-2i/d}\ (i < \lfloor p d / 2 \rfloor), \qquad \theta_i = 0\ \text{otherwise}

    Args:
        head_dim: head width ``d``, even.
        p: the fraction of RoPE's frequencies kept, in ``(0, 1]`` (the highest ones): 1 is RoPE; the paper trains
            0.25- and 0.75-RoPE, Gemma 4's global layers use 0.25.
        base: RoPE's frequency base.
    """

    info = Card(
        name="p-rope",
        title="p-RoPE (RoPE without its lowest frequencies)",
        paper="Barbero et al., Round and Round We Go! What makes Rotary Positional Encodings useful? (ICLR)",
        year=2025,
        family="rotary",
        position="relative",
        learnable=False,
        summary="RoPE keeping its highest fraction p of frequencies; the other pairs are not rotated (no position).",
        reference=(
            "HF transformers 5.24 Gemma 4 'proportional' RoPE (Gemma4TextRotaryEmbedding + apply_rotary_pos_emb): "
            "cos/sin bit for bit; rotated q, k bit for bit (PyTorch path without posenc.native: max |Δ| 4.8e-7 "
            "float32, 4.4e-16 float64)"
        ),
        aliases=("prope", "proportional-rope", "rope-proportional"),
    )
    option_limits = {
        "p": (
            lambda v: 0 < v <= 1,
            "in (0, 1]: the fraction of RoPE's frequencies kept (1 is RoPE; towards 0, NoPE)",
        )
    }

    def __init__(self, head_dim: int, p: float = 0.75, base: float = 10000.0):
        check_even_head_dim(self.info.name, head_dim)
        super().__init__(head_dim, base)
        self.p = float(p)
        # the paper's and Gemma's count, written as they write it: int(p * head_dim // 2)
        kept = int(p * head_dim // 2)
        if kept < 1:
            raise ConfigError(
                f"encoding 'p-rope': p={p!r} keeps int(p * head_dim // 2) = 0 of the {head_dim // 2} pairs of "
                f"head_dim={head_dim}, which is NoPE (encoding 'nope'); the smallest p that keeps one pair is "
                f"2 / head_dim = {2 / head_dim:g}"
            )
        self._truncate(kept)
