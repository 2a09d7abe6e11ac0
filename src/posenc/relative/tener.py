r"""TENER: direction- and distance-aware relative attention without a key projection (Yan et al. 2019).

TENER observes (Wu (2022), section "TENER") that the dot product of two sinusoidal
encodings depends on the distance only, ``PE_t·PE_{t+k} = Σ cos(c_j k) =
PE_{t-k}·PE_t``, so it cannot tell left from right, and that the projections
``W_q^T W_k`` between them blur even the distance. Its attention (paper eq. 2):

.. math::
    Q, K, V = H W_q,\; H_{d_k},\; H W_v

    R_{t-j} = \Big[\dots, \sin\!\Big(\frac{t-j}{10000^{2i/d_k}}\Big),
                         \cos\!\Big(\frac{t-j}{10000^{2i/d_k}}\Big), \dots\Big]^\top

    A^{rel}_{t,j} = Q_t K_j^\top + Q_t R_{t-j}^\top + u K_j^\top + v R_{t-j}^\top

    \mathrm{Attn}(Q, K, V) = \mathrm{softmax}(A^{rel}) V

* ``K = H`` split into heads: no ``W_k`` (``key_projection = False``), so
  ``n_heads · head_dim`` must equal ``d_model``;
* ``R_{t-j}`` is *not* projected, has the head width ``d_k`` and the
  interleaved ``sin, cos`` layout; ``sin`` is odd in ``t - j``, so
  ``R_{t-j} ≠ R_{j-t}``: the score sees the direction;
* ``u``, ``v`` learned per head (``[n_heads, d_k]``);
* *un-scaled*: no ``1/sqrt(d_k)`` (the ``scale`` hook returns 1); ``scaled=True``
  gives the usual ``1/sqrt(d_k)`` (the paper's "scaled" ablation: MSRA NER F1
  91.67 against 92.74 un-scaled).

How the authors' code (fastnlp/TENER ``modules/relative_transformer.py``,
``RelativeMultiHeadAttn``) differs from the paper's equation, which this
class follows:

* it adds a fifth term ``K_j R_{t-j}`` (its ``E_`` and ``_transpose_shift``),
  absent from eq. 2;
* its ``Q_t R`` and ``v R`` terms (``_shift``) use the offset ``j - t``
  (key minus query), the opposite sign to the paper's ``R_{t-j}``; with
  ``sin`` odd this flips the sign of every ``sin`` component;
* its sinusoid is fairseq/tensor2tensor's: ``[sin | cos]`` halves, frequencies
  ``10000^{-i/(d_k/2 - 1)}`` rather than ``10000^{-2i/d_k}``, a table of
  offsets ``-L .. L-1`` whose row at ``padding_idx=0`` is zeroed, odd ``d_k``
  padded with a zero;
* its biases are named the other way round from Transformer-XL's code: it
  adds ``r_r_bias`` to ``Q`` for the content term (the paper's ``u``) and
  ``r_w_bias`` for the position term (``v``), both ``[n_heads, d_k]``
  (xavier-normal init); ``W_q``, ``W_v`` have no bias;
* the scores are shifted with pad-and-reshape tricks on a ``[L, 2L]`` table
  (no memory, one sequence length);
* its current code (2020, after the paper) learns a key projection, ``K = H W_k``;
  this class follows the paper's ``K = H`` by default, and ``key_projection=True``
  gives the code's learned ``W_k`` (the rest of the equation unchanged).

Fast path: the distances of contiguous positions are shifted into place
(``relative_shift``), others gathered; the reference path materialises
``R_{t-j}`` ``[Lq, Lk, d_k]`` for every pair.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..base import AttentionContext, Card, Cost, PositionalEncoding
from ..errors import ConfigError
from ..fused import RelativeForm
from ..registry import register
from ._skew import offset_rows, offsets
from .transformer_xl import RelativeTerms, check_heads, relative_sinusoid, sinusoid_rows


@register
class TENER(PositionalEncoding):
    r"""TENER relative attention (Yan et al. 2019, eq. 2), un-scaled, with ``K = H``.

    .. math::
        A^{rel}_{t,j} = Q_t K_j^\top + Q_t R_{t-j}^\top + u K_j^\top + v R_{t-j}^\top,
        \quad R_{t-j} = [\dots, \sin((t-j)\,\omega_i), \cos((t-j)\,\omega_i), \dots],
        \quad \omega_i = 10000^{-2i/d_k}

    Args:
        head_dim, n_heads: the attention's heads (``K = H`` needs ``n_heads · head_dim == d_model``).
        scaled: ``True`` divides the logits by ``sqrt(head_dim)`` (the paper's "scaled" ablation).
        base: the sinusoid's base.
        key_projection: ``False`` (default): the paper's ``K = H``, no ``W_k``; ``True``: a learned ``W_k``,
            ``K = H W_k``, as fastnlp/TENER's current code (2020, after the paper).
    """

    info = Card(
        name="tener",
        title="TENER relative attention (un-scaled, K = H)",
        paper="Yan et al., TENER: Adapting Transformer Encoder for Named Entity Recognition",
        year=2019,
        family="relative",
        position="relative",
        learnable=True,
        summary="Q K + Q R_{t-j} + u K + v R_{t-j}; direction-aware sinusoid R, no W_k, no 1/sqrt(d_k).",
        reference="the paper's eq. 2 by a naive loop; direction awareness; un-scaled softmax",
    )
    claims = {"direction_aware": True}  # Wu (2022): TENER's relative sinusoid keeps the direction
    shared_across_layers = False  # u, v per layer
    key_projection = False  # K = H (the paper); key_projection=True: a learned W_k (fastnlp/TENER's code)

    def __init__(
        self, head_dim: int, n_heads: int, scaled: bool = False, base: float = 10000.0, key_projection: bool = False
    ):
        super().__init__()
        if not isinstance(key_projection, bool):
            raise ConfigError(f"key_projection must be True or False, got {key_projection!r}")
        self.key_projection = key_projection  # type: ignore[misc]  # read by the attention when it is built
        if not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
            raise ConfigError(
                f"{self.info.name} builds R_(t-j) from sin/cos pairs of width d_k = head_dim, so head_dim must be a "
                f"positive even integer, got {head_dim!r}; choose n_heads so that d_model / n_heads is even"
            )
        if not isinstance(n_heads, int) or n_heads <= 0:
            raise ConfigError(f"n_heads must be a positive integer, got {n_heads!r}")
        if base <= 1:
            raise ConfigError(f"base must be > 1, got {base}")
        self.head_dim, self.n_heads, self.scaled, self.base = head_dim, n_heads, scaled, base
        self.u = nn.Parameter(torch.empty(n_heads, head_dim))
        self.v = nn.Parameter(torch.empty(n_heads, head_dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.u, std=0.02)
        nn.init.normal_(self.v, std=0.02)

    def cost(self, head_dim: int) -> Cost:
        # (Q_t + v) · R_{t-j}: 2·d per pair and head (R: a sinusoid table, no product); u·K_j folds into the query,
        # (Q_t + u) · K_j (the adds Q + u, Q + v: 2·d per token); K = H, no W_k: 2·d_model·d products per token and
        # head fewer than plain attention (key_projection=False, the paper)
        saved = 0.0 if self.key_projection else -2.0 * self.n_heads * self.head_dim * head_dim
        return Cost(
            pair=2.0 * head_dim,
            token=saved,
            token_elementwise=2.0 * head_dim,
            note="(q+v)·R per pair, u folded into the query, no key projection (blocked kernel)",
        )

    def R(self, distances: Tensor) -> Tensor:
        """``R_d``, interleaved ``sin, cos`` of width ``head_dim``: ``[..., head_dim]`` (float64)."""
        return relative_sinusoid(distances, self.head_dim, base=self.base, interleaved=True)

    def R_rows(self, distances: Tensor, dtype: torch.dtype) -> Tensor:
        """``R_d`` in ``dtype`` from the shared table (:func:`sinusoid_rows`; the same numbers as :meth:`R`)."""
        return sinusoid_rows(distances, self.head_dim, dtype, base=self.base, interleaved=True)

    def scale(self, head_dim: int) -> float:
        return head_dim**-0.5 if self.scaled else 1.0

    def relative_form(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> RelativeForm | None:
        """``(Q + u) K`` and ``(Q + v) R`` over the offsets (see :mod:`posenc.fused`)."""
        if ctx.reference or not offset_rows(ctx):
            return None
        check_heads(self.info.name, q, self.n_heads, self.head_dim)
        R = self.R_rows(-offsets(ctx), q.dtype)[:, None]  # [P, 1, d_k] at distances t - j, shared by the heads
        qu = q + self.u[:, None, :].to(q.dtype)
        qv = q + self.v[:, None, :].to(q.dtype)
        return RelativeForm(q=qu, k=k, query_terms=[(qv, R)])

    def logits(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> Tensor:
        check_heads(self.info.name, q, self.n_heads, self.head_dim)
        qv = q + self.v[:, None, :].to(q.dtype)  # Q_t R + v R = (Q_t + v) R
        if ctx.reference:
            rel = ctx.q_pos[:, :, None] - ctx.k_pos[:, None, :]  # [B', Lq, Lk], t - j
            R = self.R(rel).to(q.dtype)  # [B', Lq, Lk, d_k]: R_{t-j} for every pair
            position = torch.einsum("bhid,bijd->bhij", qv, R.expand(q.shape[0], -1, -1, -1))
        else:
            terms = RelativeTerms.get(ctx)
            if terms.mode in ("shift", "gather"):  # R shared by the heads: one product, no per-head copy
                position = terms.scores_sinusoid(qv, self.R_rows(terms.distances, q.dtype))
            else:
                R = self.R(terms.distances).to(q.dtype)
                position = terms.scores(qv, R.unsqueeze(-2).expand(*R.shape[:-1], self.n_heads, self.head_dim))
        content = torch.einsum("hd,bhjd->bhj", self.u.to(k.dtype), k)[:, :, None, :]  # u K_j
        return position + content
