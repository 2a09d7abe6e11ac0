r"""Relative position representations on keys and values: Shaw et al. (2018) and NEZHA (Wei et al. 2019).

Shaw et al. add a vector ``a_{ij}`` that depends on the clipped offset ``j - i`` to
the key and to the value of every query/key pair (their eqs. 3-5):

.. math::
    e_{ij} = \frac{x_i W^Q (x_j W^K + a^K_{ij})^\top}{\sqrt{d_z}}, \qquad
    z_i = \sum_j \alpha_{ij} (x_j W^V + a^V_{ij}), \\
    a^K_{ij} = w^K_{\mathrm{clip}(j-i,\,k)}, \quad a^V_{ij} = w^V_{\mathrm{clip}(j-i,\,k)}, \quad
    \mathrm{clip}(x, k) = \max(-k, \min(k, x))

so ``2k + 1`` learned vectors per table. In posenc's hooks the extra key term
``q_i · a^K_{ij}`` is ``logits`` (it is divided by ``sqrt(d_z)`` with ``q·k``) and
``Σ_j α_ij a^V_ij`` is ``values``.

NEZHA keeps the structure but fixes both tables to sinusoids of the clipped
offset (its "functional relative positional encoding"):

.. math::
    a_{ij}[2k] = \sin\!\left(\frac{j - i}{10000^{2k/d_z}}\right), \qquad
    a_{ij}[2k+1] = \cos\!\left(\frac{j - i}{10000^{2k/d_z}}\right)

The fast paths never build the ``[Lq, Lk, d]`` tensor of ``a_{ij}``: they score
``q`` against the ``2k + 1`` table rows and gather by offset, and sum the
attention probabilities per offset before multiplying by the value table (see
:mod:`posenc.relative._skew`). The reference paths (``ctx.reference``)
materialise ``a_{ij}`` exactly as the equations do.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..base import AttentionContext, Card, Cost, PositionalEncoding
from ..errors import ConfigError
from ..fused import RelativeForm, offset_table
from ..registry import register
from ._skew import cached_index, materialise, offset_rows, offsets, query_table_term, value_table_term


def clipped_rows(offset: Tensor, k: int) -> Tensor:
    """The table row ``clip(j - i, k) + k`` of offsets ``j - i`` (any shape), in ``0 .. 2k``."""
    return offset.clamp(-k, k) + k


def clipped_offset_index(q_pos: Tensor, k_pos: Tensor, k: int) -> Tensor:
    """``clip(j - i, k) + k`` for every query ``i`` and key ``j``: ``[B|1, Lq, Lk]`` in ``0 .. 2k``."""
    return clipped_rows(k_pos[:, None, :] - q_pos[:, :, None], k)


def _check_k(k: object) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ConfigError(
            f"max_relative_position (the clip distance k) must be an integer >= 0, got {k!r}; "
            "k=0 keeps one vector (no position information), Shaw et al. use k=16"
        )
    return k


class _ClippedRelative(PositionalEncoding):
    """Shared machinery: tables of ``2k + 1`` rows indexed by ``clip(j - i, k) + k``."""

    def __init__(self, head_dim: int, max_relative_position: int, keys: bool, values: bool):
        super().__init__()
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0:
            raise ConfigError(f"head_dim must be a positive integer, got {head_dim!r}")
        self.max_relative_position = _check_k(max_relative_position)
        if not keys and not values:
            raise ConfigError(
                f"{self.info.name} with keys=False and values=False adds no position information; "
                "enable keys, values or both"
            )
        self.head_dim, self.keys, self.values_term = head_dim, bool(keys), bool(values)

    def cost(self, head_dim: int) -> Cost:
        # q_i · a^K_ij: 2·d per pair and head; Σ_j p_ij a^V_ij: 2·d per pair and head (the tables are lookups by
        # clip(j - i, k): no product)
        pair = 2.0 * head_dim * (int(self.keys) + int(self.values_term))
        return Cost(pair=pair, note="q·a^K and p·a^V per pair, the tables read per offset (blocked kernel)")

    # the two tables, [2k + 1, head_dim]
    def key_table(self) -> Tensor:
        raise NotImplementedError

    def value_table(self) -> Tensor:
        raise NotImplementedError

    def index(self, ctx: AttentionContext) -> Tensor:
        """``clip(j - i, k) + k``: ``[B|1, Lq, Lk]``, cached per forward."""
        k = self.max_relative_position
        return cached_index(
            ctx,
            ("clipped-offset", k, self.info.name),
            lambda qp, kp: clipped_offset_index(qp, kp, k),
            self.info.name,
        )

    def _check_dim(self, x: Tensor) -> None:
        if x.shape[-1] != self.head_dim:
            raise ConfigError(f"{self.info.name} was built for head_dim={self.head_dim}, got {x.shape[-1]}")

    def logits(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> Tensor | None:
        r"""``q_i · a^K_{ij}`` (term (b)); the attention divides it by ``sqrt(d_z)`` with ``q_i · k_j``."""
        if not self.keys:
            return None
        self._check_dim(q)
        index = self.index(ctx)
        table = self.key_table()
        if ctx.reference:
            a_k = materialise(table.to(q.dtype), index)  # [B|1, Lq, Lk, d]: the paper's a^K_ij
            return torch.einsum("bhid,bijd->bhij", q, a_k.expand(q.shape[0], -1, -1, -1))
        return query_table_term(q, table, index)

    # the gathers of a (2k + 1)-row table are cheap, so the batched hook path stays faster up to L = 256
    # (B=16, H=4, d=32: 94 ms against 114 ms fused); from L = 512 on the blocked kernel wins (benchmarks/README.md)
    fused_min_pairs = 512 * 512

    def relative_form(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> RelativeForm | None:
        """Both tables expanded to the ``Lq + Lk - 1`` offsets ``clip(j - i, k)`` (see :mod:`posenc.fused`)."""
        if ctx.reference or not offset_rows(ctx):
            return None
        self._check_dim(q)
        rows = clipped_rows(offsets(ctx), self.max_relative_position)
        terms = [(q, offset_table(self.key_table().to(q.dtype)[:, None], rows))] if self.keys else []
        vt = offset_table(self.value_table().to(q.dtype)[:, None], rows) if self.values_term else None
        return RelativeForm(q=q, k=k, query_terms=terms, value_table=vt)

    def values(self, probs: Tensor, ctx: AttentionContext) -> Tensor | None:
        r"""``Σ_j α_{ij} a^V_{ij}``: ``[B, H, Lq, d]``."""
        if not self.values_term:
            return None
        index = self.index(ctx)
        table = self.value_table()
        if ctx.reference:
            a_v = materialise(table.to(probs.dtype), index)  # [B|1, Lq, Lk, d]: the paper's a^V_ij
            return torch.einsum("bhij,bijd->bhid", probs, a_v.expand(probs.shape[0], -1, -1, -1))
        return value_table_term(probs, table, index)


@register
class Shaw(_ClippedRelative):
    r"""Learned relative position representations on keys and values (Shaw, Uszkoreit, Vaswani 2018).

    .. math::
        e_{ij} = \frac{x_i W^Q (x_j W^K + a^K_{ij})^\top}{\sqrt{d_z}}, \quad
        z_i = \sum_j \alpha_{ij} (x_j W^V + a^V_{ij}), \quad
        a^{K,V}_{ij} = w^{K,V}_{\mathrm{clip}(j-i,\,k)}

    Args:
        head_dim: ``d_z``, the width of one head (the tables are shared by the heads, as in the paper).
        max_relative_position: the clip distance ``k`` (``2k + 1`` vectors per table); ``k = 0``
            leaves one vector, i.e. no position information.
        keys, values: use ``a^K`` and/or ``a^V`` (the paper's ablation: keys only, values only, both).

    Each layer has its own tables (``shared_across_layers = False``), initialised
    ``N(0, d_z^{-1/2})``.
    """

    info = Card(
        name="shaw",
        title="Relative position representations (Shaw et al.)",
        paper="Shaw, Uszkoreit, Vaswani, Self-Attention with Relative Position Representations",
        year=2018,
        family="relative",
        position="relative",
        learnable=True,
        summary="Learned a^K, a^V of clip(j-i, k) added to keys and values in every layer.",
        reference="the paper's eqs. 3-5 as a naive loop over i, j; fast (gather/scatter) == literal L×L×d form",
        shortcoming="beyond distance k every offset looks the same; a^V forces an explicit softmax",
        aliases=("shaw2018", "relative-shaw"),
    )
    shared_across_layers = False

    def __init__(self, head_dim: int, max_relative_position: int = 16, keys: bool = True, values: bool = True):
        super().__init__(head_dim, max_relative_position, keys, values)
        rows = 2 * self.max_relative_position + 1
        self.w_K = nn.Parameter(torch.empty(rows, head_dim)) if self.keys else None
        self.w_V = nn.Parameter(torch.empty(rows, head_dim)) if self.values_term else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for w in (self.w_K, self.w_V):
            if w is not None:
                nn.init.normal_(w, std=self.head_dim**-0.5)

    def key_table(self) -> Tensor:
        assert self.w_K is not None
        return self.w_K

    def value_table(self) -> Tensor:
        assert self.w_V is not None
        return self.w_V


NEZHA_TABLES = ("paper", "hf")


def nezha_table(head_dim: int, max_relative_position: int, table: str = "paper", base: float = 10000.0) -> Tensor:
    r"""NEZHA's fixed sinusoid table, ``[2k + 1, head_dim]`` in float64; row ``r`` serves offset ``r - k``.

    * ``table="paper"``: row ``r`` is the sinusoid of the offset ``r - k`` itself (the paper's formula);
    * ``table="hf"``: row ``r`` is the sinusoid of ``r`` (the released NEZHA code and HF
      ``NezhaRelativePositionsEncoding`` build the sinusoid of the *shifted* index ``clip(j-i)+k``).
    """
    if table not in NEZHA_TABLES:
        raise ConfigError(f"table must be one of {NEZHA_TABLES}, got {table!r}")
    k = max_relative_position
    x = torch.arange(-k, k + 1, dtype=torch.float64) if table == "paper" else torch.arange(2 * k + 1).double()
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = x[:, None] * inv_freq  # [2k+1, d/2]
    return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)  # interleaved: sin at 2i, cos at 2i+1


@register
class Nezha(_ClippedRelative):
    r"""NEZHA's functional (fixed sinusoidal) relative positions on keys and values (Wei et al. 2019).

    .. math::
        e_{ij} = \frac{q_i (k_j + a_{ij})^\top}{\sqrt{d_z}}, \quad
        z_i = \sum_j \alpha_{ij} (v_j + a_{ij}), \\
        a_{ij}[2k] = \sin\!\left(\frac{c_{ij}}{10000^{2k/d_z}}\right), \quad
        a_{ij}[2k+1] = \cos\!\left(\frac{c_{ij}}{10000^{2k/d_z}}\right), \quad
        c_{ij} = \mathrm{clip}(j - i, k)

    The same fixed table serves keys and values (``a^K = a^V``), and every layer.

    Differences between the paper and the reference implementation (HF transformers 4.57
    ``models/deprecated/nezha``, ported from the released NEZHA code), checked against its source:

    * **the table's argument is shifted**: HF builds the sinusoid of the table *row*
      ``clip(j-i, k) + k`` (``0 .. 2k``), not of the offset ``clip(j-i, k)`` the paper writes.
      ``table="paper"`` (default) follows the paper; ``table="hf"`` reproduces HF / the released
      checkpoints number for number. Both depend only on ``clip(j - i)``; they differ by a fixed
      rotation ``R_k`` of each (sin, cos) pair, which the value term does not absorb.
    * **clipping**: the paper's formula has none; the code clips at ``max_relative_position``
      (HF config default 64, the encoding class's own default 127). We clip at
      ``max_relative_position`` (default 64).
    * HF computes the table in float32 from ``exp(2i · -ln(10000)/d)``; we compute it in float64.
    * HF assumes positions ``0 .. L-1`` for both queries and keys (its table is sliced
      ``[:L, :L]`` by the key length, a query length different from the key length fails, and
      no sequence may be longer than ``max_position_embeddings``); we use the explicit
      positions, so KV caches, offsets and any length work.

    Args:
        head_dim: ``d_z`` (must be even: sin/cos pairs).
        max_relative_position: the clip distance ``k`` (default 64, HF's ``NezhaConfig``).
        table: ``"paper"`` or ``"hf"`` (see above).
        keys, values: use the key term and/or the value term (NEZHA uses both).
        base: the sinusoid base (10000).
    """

    info = Card(
        name="nezha",
        title="NEZHA functional relative positions",
        paper="Wei et al., NEZHA: Neural Contextualized Representation for Chinese Language Understanding",
        year=2019,
        family="relative",
        position="relative",
        learnable=False,
        summary="Shaw's a^K, a^V fixed to sinusoids of clip(j-i, k); no parameters.",
        reference="HF transformers 4.57 NezhaSelfAttention (fixture, table='hf'); the paper's formula (naive loop)",
        shortcoming="beyond distance k every offset looks the same; the value term forces an explicit softmax",
        aliases=("nezha-relative", "functional-relative"),
    )

    def __init__(
        self,
        head_dim: int,
        max_relative_position: int = 64,
        table: str = "paper",
        keys: bool = True,
        values: bool = True,
        base: float = 10000.0,
    ):
        super().__init__(head_dim, max_relative_position, keys, values)
        if head_dim % 2:
            raise ConfigError(
                f"nezha's table holds (sin, cos) pairs, so head_dim must be even, got {head_dim}; "
                f"use head_dim={head_dim - 1} or {head_dim + 1}"
            )
        if table not in NEZHA_TABLES:
            raise ConfigError(
                f"table must be one of {NEZHA_TABLES} ('paper': sinusoid of clip(j-i); "
                f"'hf': sinusoid of clip(j-i)+k as HF and the released code), got {table!r}"
            )
        if not base > 1:
            raise ConfigError(f"base must be > 1, got {base!r}")
        self.table_kind, self.base = table, float(base)
        self.register_buffer("a", nezha_table(head_dim, self.max_relative_position, table, base), persistent=False)

    def key_table(self) -> Tensor:
        return self.a

    def value_table(self) -> Tensor:
        return self.a
