r"""ALiBi, attention with linear biases (Press, Smith and Lewis 2022, "Train Short, Test Long").

ALiBi adds no position vector anywhere. Each head ``h`` penalises the attention
score between query ``i`` and key ``j`` linearly in their distance,

.. math::
    \mathrm{softmax}\big(q_i K^\top / \sqrt{d} + m_h \cdot [-(i-1), \dots, -2, -1, 0]\big)
    \quad\Longleftrightarrow\quad A_{ij} = \frac{q_i \cdot k_j}{\sqrt{d}} - m_h (i - j), \; j \le i

with a fixed, head-specific slope ``m_h``. The bias is *not* multiplied by the
softmax temperature (it goes through the ``bias`` hook). It depends on ``i - j`` only, so at
contiguous positions it is ``Lq + Lk - 1`` numbers per head (``bias_offsets``), which the
``offset-bias`` kernel reads without ever making the ``[H, Lq, Lk]`` matrix; elsewhere (a padding
mask, a GPU, short calls) the matrix goes to SDPA as an additive mask.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..base import AttentionContext, Card, Cost, PositionalEncoding
from ..errors import ConfigError
from ..registry import register
from ..relative._skew import arange_rows, offset_rows, offsets, toeplitz


def alibi_slopes(n_heads: int) -> list[float]:
    r"""The head slopes ``m_1 .. m_n`` of ALiBi, as the paper and its repository define them.

    * ``n`` a power of two: the geometric sequence that starts at ``2^{-8/n}`` with
      ratio ``2^{-8/n}``, i.e. ``m_h = 2^{-8h/n}``, ``h = 1 .. n`` (n = 8: 1/2, 1/4, ..., 1/256).
    * otherwise (ofirpress/attention_with_linear_biases, ``get_slopes``): with
      ``c = 2^{\lfloor \log_2 n \rfloor}`` the closest smaller power of two, take the ``c``
      slopes of ``c`` heads, ``2^{-8h/c}``, then the first ``n - c`` slopes at the odd
      positions (1st, 3rd, 5th ...) of the ``2c``-head sequence, i.e. ``2^{-8k/(2c)}`` for
      ``k = 1, 3, 5, ...``: the slopes of ``2c`` heads that the ``c``-head sequence lacks.
      (BLOOM's ``build_alibi_tensor`` computes the same numbers.)
    """
    if not isinstance(n_heads, int) or isinstance(n_heads, bool) or n_heads < 1:
        raise ConfigError(f"ALiBi needs n_heads >= 1 (an integer), got {n_heads!r}")
    c = 2 ** int(math.floor(math.log2(n_heads)))
    slopes = [2.0 ** (-8.0 * h / c) for h in range(1, c + 1)]
    extra = [2.0 ** (-8.0 * k / (2 * c)) for k in range(1, 2 * (n_heads - c), 2)]
    return slopes + extra


@register
class ALiBi(PositionalEncoding):
    r"""ALiBi: a fixed linear distance penalty per head, added after the temperature.

    Causal form (the paper's, ``bidirectional=False``):

    .. math:: B^{(h)}_{ij} = -m_h\,(i - j)

    which for ``j <= i`` is the paper's ``m_h · [-(i-1), ..., -1, 0]``. For ``j > i`` the
    same formula is extended literally (``+m_h (j - i)``); a causal mask removes those
    entries, so use it in decoders. Extended literally it equals ``m_h · j`` up to a
    per-query constant, BLOOM's form, which softmax cannot tell apart.

    Symmetric bidirectional form (``bidirectional=True``, registered as
    ``alibi-bidirectional``), for encoders without a causal mask:

    .. math:: B^{(h)}_{ij} = -m_h\,|i - j|

    Slopes: :func:`alibi_slopes`. Positions are the explicit ``ctx.q_pos`` / ``ctx.k_pos``,
    so KV caches, offsets and packed sequences get the true distances. The bias
    depends on ``i - j`` only: translation invariant, defined at every length.
    """

    info = Card(
        name="alibi",
        title="ALiBi (attention with linear biases)",
        paper="Press, Smith, Lewis, Train Short, Test Long: Attention with Linear Biases Enables "
        "Input Length Extrapolation",
        year=2022,
        family="bias",
        position="relative",
        learnable=False,
        summary="-m_h (i-j) added after scaling; slopes 2^(-8h/n).",
        reference="the paper's slopes and a naive-loop bias matrix; HF BLOOM build_alibi_tensor slopes",
        shortcoming="a fixed recency prior: far tokens are attended ever less (a local window in effect)",
    )
    randomized_variant = True
    claims = {"relative_only": True, "decay": True, "params_constant": True}
    bidirectional_default = False

    def __init__(self, n_heads: int, bidirectional: bool | None = None):
        super().__init__()
        self.n_heads = n_heads
        self.bidirectional = self.bidirectional_default if bidirectional is None else bool(bidirectional)
        self.register_buffer("slopes", torch.tensor(alibi_slopes(n_heads), dtype=torch.float64), persistent=False)
        self._memo: tuple[tuple, Tensor] | None = None  # the last Toeplitz matrix (see bias)

    def cost(self, head_dim: int) -> Cost:
        # -m_h (i - j) is one value per offset and head (O(L)); each pair adds it: 1 add per pair and head
        return Cost(pair_elementwise=1.0, note="one add per pair and head (the offset-bias kernel reads it per offset)")

    def _matrix(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        dist = q_pos[:, :, None].double() - k_pos[:, None, :].double()  # i - j, [B, Lq, Lk]
        if self.bidirectional:
            dist = dist.abs()
        return -self.slopes[None, :, None, None] * dist[:, None]

    def _check_heads(self, ctx: AttentionContext) -> None:
        if ctx.n_heads != self.n_heads:
            raise ConfigError(f"ALiBi was built for n_heads={self.n_heads} but the attention has {ctx.n_heads}")

    @staticmethod
    def _dtype(ctx: AttentionContext) -> torch.dtype:
        """The attention's dtype (float64 in a ``.double()`` model), float32 standalone."""
        weight = getattr(ctx.attention, "q_proj", None)
        return weight.weight.dtype if isinstance(weight, torch.nn.Linear) else torch.float32

    def bias_offsets(self, ctx: AttentionContext) -> Tensor | None:
        r"""``-m_h (i - j)`` (or ``-m_h |i - j|``) at the ``Lq + Lk - 1`` offsets of contiguous positions: ``[H, P]``.

        ``None`` on the reference path or for positions that are not ``start + arange`` per row. The
        ``offset-bias`` kernel reads these ``H·P`` numbers and never makes the ``[H, Lq, Lk]`` bias (2.4 GB at
        ``L = 8192`` and 9 heads); computed in float64 like :meth:`matrix`, then cast to the attention's dtype.
        """
        if ctx.reference or not offset_rows(ctx):
            return None
        self._check_heads(ctx)
        d = offsets(ctx).double()  # j - i, ascending
        dist = d.abs() if self.bidirectional else -d  # i - j, or |i - j|
        return (-self.slopes.to(d.device)[:, None] * dist[None, :]).to(self._dtype(ctx))

    def bias(self, ctx: AttentionContext) -> Tensor:
        self._check_heads(ctx)
        dtype = self._dtype(ctx)
        if ctx.reference:  # the paper's matrix, computed afresh from i and j
            return self._matrix(ctx.q_pos, ctx.k_pos).to(dtype)
        key = ("alibi", id(self), id(ctx.q_pos), id(ctx.k_pos), dtype)
        got = ctx.cache.get(key)
        if got is not None:  # once per forward, shared by every layer
            return got[2]
        lq, lk = ctx.q_pos.shape[-1], ctx.k_pos.shape[-1]
        if arange_rows(ctx) and lq * lk < self.fused_min_pairs:
            # short calls (the plan's offset-bias kernel starts at fused_min_pairs pairs): the matrix of one
            # (Lq, Lk, first offset) is reused by later forwards, as x-transformers keeps its bias buffer; at most
            # H * fused_min_pairs numbers (a changed slope buffer bumps its version)
            memo = (lq, lk, int(offsets(ctx)[0]), dtype, ctx.q_pos.device, id(self.slopes), self.slopes._version)
            memo += (torch.is_inference_mode_enabled(),)
            if self._memo is None or self._memo[0] != memo:
                self._memo = (memo, toeplitz(self.bias_offsets(ctx), lq, lk))
            out = self._memo[1]
        elif ctx.contiguous:  # offset-only: Lq + Lk - 1 values laid out as a Toeplitz matrix (built per forward)
            out = toeplitz(self.bias_offsets(ctx), lq, lk)
        else:
            rel = ctx.relative()
            dist = rel.abs() if self.bidirectional else -rel
            out = -self.slopes.to(dtype)[None, :, None, None] * dist[:, None].to(dtype)
        ctx.cache[key] = (ctx.q_pos, ctx.k_pos, out)  # keeps the position tensors (and their ids) alive
        return out

    def matrix(self, length: int) -> Tensor:
        """The ``[H, L, L]`` bias for positions ``0 .. length-1`` (float64), e.g. to plot it."""
        pos = torch.arange(length)[None]
        return self._matrix(pos, pos)[0]


@register
class ALiBiBidirectional(ALiBi):
    r"""ALiBi's symmetric form for bidirectional encoders: :math:`B^{(h)}_{ij} = -m_h |i - j|`.

    The same slopes as ``alibi``; no direction information (the bias cannot tell
    ``i - j = 3`` from ``-3``), so in an encoder the order comes only through the
    distance.
    """

    info = Card(
        name="alibi-bidirectional",
        title="ALiBi, symmetric (bidirectional)",
        paper="Press, Smith, Lewis, Train Short, Test Long (symmetric form as in encoder ports)",
        year=2022,
        family="bias",
        position="relative",
        learnable=False,
        summary="-m_h |i-j| added after scaling: ALiBi for encoders.",
        reference="a naive loop of -m_h |i-j|",
        shortcoming="symmetric: cannot tell before from after",
        aliases=("alibi-symmetric",),
    )
    bidirectional_default = True
