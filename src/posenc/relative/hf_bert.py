r"""HF BERT's relative position embeddings: ``position_embedding_type="relative_key"`` / ``"relative_key_query"``.

These are described in anon., "Revisiting absolute position embedding" (Huang et al. 2020,
"Improve Transformer Models with Better Relative Position Embeddings", method 3/4, as
implemented in HF ``BertSelfAttention``):
one learned vector per signed distance ``i - j`` (query minus key),

.. math::
    E \in \mathbb{R}^{(2L_{max} - 1) \times d_h}, \qquad
    r_{ij} = E[\,i - j + L_{max} - 1\,]

    \text{relative\_key:}\quad A_{ij} = \frac{q_i \cdot k_j + q_i \cdot r_{ij}}{\sqrt{d_h}} \qquad
    \text{relative\_key\_query:}\quad A_{ij} = \frac{q_i \cdot k_j + q_i \cdot r_{ij} + k_j \cdot r_{ij}}{\sqrt{d_h}}

Both extra terms are added before the division by ``sqrt(d_h)`` (the ``logits`` hook).
The table is shared by the heads and each layer has its own.

Differences from HF transformers 4.57 (the reference; removed in transformers 5):

* HF takes no position ids here: it uses ``arange(Lq)`` for queries and ``arange(Lk)`` for
  keys, and with a KV cache it gives *every* query the position ``Lk - 1`` (right for one new
  token at a time, wrong for a chunk of several new tokens). posenc uses the explicit
  positions of the context, so offsets, caches and chunks are all exact.
* A distance ``|i - j| >= max_len`` makes HF index outside its table (an ``IndexError``).
  posenc raises a :class:`~posenc.errors.PositionError` naming the limit, or clips the
  distance to ``±(max_len - 1)`` when built with ``clip=True``.
* ``max_len`` is HF's ``max_position_embeddings`` (the models pass their own ``max_len``).

The fast path scores ``q`` (and ``k``) against the table rows that the batch's distances
use and gathers by distance; it never builds the ``[Lq, Lk, d_h]`` tensor ``r_{ij}`` that
HF (and the reference path) materialise.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..base import AttentionContext, Card, Cost, PositionalEncoding
from ..errors import ConfigError, PositionError
from ..fused import RelativeForm, offset_table
from ..registry import register
from ._skew import cached_index, key_table_term, materialise, offset_rows, offsets, query_table_term


@register
class RelativeKey(PositionalEncoding):
    r"""HF BERT ``relative_key``: a learned vector per distance ``i - j``, dotted with the query.

    .. math::
        A_{ij} = \frac{q_i \cdot k_j + q_i \cdot E[i - j + L_{max} - 1]}{\sqrt{d_h}}

    Args:
        head_dim: ``d_h`` (the table is ``[2 · max_len - 1, head_dim]``, shared by the heads).
        max_len: ``L_max`` (HF's ``max_position_embeddings``): distances ``-(max_len-1) .. max_len-1``.
        clip: clip longer distances to ``±(max_len - 1)`` instead of raising a ``PositionError``.
    """

    info = Card(
        name="relative-key",
        title="BERT relative_key",
        paper="Huang et al., Improve Transformer Models with Better Relative Position Embeddings (HF BERT)",
        year=2020,
        family="relative",
        position="relative",
        learnable=True,
        summary="q_i · E[i-j] added to q_i · k_j before the 1/sqrt(d) scaling; one table per layer.",
        reference="HF transformers 4.57 BertSelfAttention(position_embedding_type='relative_key') (fixture)",
        shortcoming="a table of 2·max_len-1 rows: no distance beyond max_len-1 (unless clipped)",
        aliases=("bert-relative-key",),
    )
    shared_across_layers = False
    key_query = False  # relative_key_query also adds k_j · r_ij

    def __init__(self, head_dim: int, max_len: int = 512, clip: bool = False):
        super().__init__()
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0:
            raise ConfigError(f"head_dim must be a positive integer, got {head_dim!r}")
        if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
            raise ConfigError(
                f"max_len (HF's max_position_embeddings) must be an integer >= 1, got {max_len!r}; "
                "the table has 2 * max_len - 1 rows"
            )
        self.head_dim, self.max_len, self.clip = head_dim, max_len, bool(clip)
        self.distance_embedding = nn.Embedding(2 * max_len - 1, head_dim)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.distance_embedding.weight, std=0.02)  # BERT's initializer_range

    def cost(self, head_dim: int) -> Cost:
        # q_i · E[i-j]: 2·d per pair and head; relative_key_query adds k_j · E[i-j]: 4·d (E is a lookup)
        pair = 2.0 * head_dim * (2 if self.key_query else 1)
        return Cost(pair=pair, note="q·E (and k·E) per pair, E read per offset (blocked kernel)")

    def index(self, ctx: AttentionContext) -> Tensor:
        """``(i - j) + max_len - 1``: ``[B|1, Lq, Lk]`` in ``0 .. 2 max_len - 2`` (checked or clipped)."""
        return cached_index(ctx, ("bert-distance", self.max_len, self.clip), self._build_index, self.info.name)

    def _build_index(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        return self._rows(q_pos[:, :, None] - k_pos[:, None, :])  # i - j, as HF

    def _rows(self, distance: Tensor) -> Tensor:
        """Table rows of distances ``i - j``: ``i - j + max_len - 1`` (checked, or clipped)."""
        top = self.max_len - 1
        if self.clip:
            distance = distance.clamp(-top, top)
        elif distance.numel() and not torch.compiler.is_compiling():
            far = int(distance.abs().max())
            if far > top:
                raise PositionError(
                    f"{self.info.name} has distance embeddings for |i - j| <= {top} (max_len={self.max_len}, "
                    f"2 * max_len - 1 = {2 * self.max_len - 1} rows) but a query and a key are {far} positions "
                    f"apart; build it with max_len >= {far + 1}, or with clip=True to clip longer distances"
                )
        return distance + top

    def relative_form(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> RelativeForm | None:
        """The table at the ``Lq + Lk - 1`` distances (see :mod:`posenc.fused`)."""
        if ctx.reference or not offset_rows(ctx):
            return None
        if q.shape[-1] != self.head_dim:
            raise ConfigError(f"{self.info.name} was built for head_dim={self.head_dim}, got {q.shape[-1]}")
        table = offset_table(self.distance_embedding.weight.to(q.dtype)[:, None], self._rows(-offsets(ctx)))
        return RelativeForm(q=q, k=k, query_terms=[(q, table)], key_terms=[(k, table)] if self.key_query else [])

    def logits(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> Tensor:
        if q.shape[-1] != self.head_dim:
            raise ConfigError(f"{self.info.name} was built for head_dim={self.head_dim}, got {q.shape[-1]}")
        index = self.index(ctx)
        table = self.distance_embedding.weight
        if ctx.reference:
            r = materialise(table.to(q.dtype), index).expand(q.shape[0], -1, -1, -1)  # [B, Lq, Lk, d]
            out = torch.einsum("bhld,blrd->bhlr", q, r)
            if self.key_query:
                out = out + torch.einsum("bhrd,blrd->bhlr", k, r)
            return out
        out = query_table_term(q, table, index)
        if self.key_query:
            out = out + key_table_term(k, table, index)
        return out


@register
class RelativeKeyQuery(RelativeKey):
    r"""HF BERT ``relative_key_query``: the distance vector is dotted with the query and with the key.

    .. math::
        A_{ij} = \frac{q_i \cdot k_j + q_i \cdot E[i - j + L_{max} - 1] + k_j \cdot E[i - j + L_{max} - 1]}{\sqrt{d_h}}
    """

    info = Card(
        name="relative-key-query",
        title="BERT relative_key_query",
        paper="Huang et al., Improve Transformer Models with Better Relative Position Embeddings (HF BERT)",
        year=2020,
        family="relative",
        position="relative",
        learnable=True,
        summary="q_i · E[i-j] + k_j · E[i-j] added to q_i · k_j before the 1/sqrt(d) scaling.",
        reference="HF transformers 4.57 BertSelfAttention(position_embedding_type='relative_key_query') (fixture)",
        shortcoming="a table of 2·max_len-1 rows: no distance beyond max_len-1 (unless clipped)",
        aliases=("bert-relative-key-query",),
    )
    key_query = True
