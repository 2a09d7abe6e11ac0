r"""The ``RelativePositionEmbedding`` of anon., "Positional encoding of the Transformer": T5-style log buckets.

That article (see docs/background.md; "the article" below) buckets the relative position
``i - j`` (query minus key; T5 uses ``j - i``, so the two halves of the bucket range are
swapped with respect to T5) with T5's bidirectional log buckets (:func:`seed_relative_position_bucket`) and offers

* ``bias``: a learned scalar per head and bucket, ``A_{ij} \mathrel{+}= b_h[\beta(i-j)]``;
* ``contextual(1)``: a learned vector ``r`` of the hidden size per bucket, projected by
  ``W_r`` (``to_r``) and dotted with the query, ``A_{ij} \mathrel{+}= q_i \cdot (W_r r_{\beta(i-j)})_h``;
* ``contextual(2)``: the same ``r`` projected by the attention's own key and query
  projections, ``A_{ij} \mathrel{+}= q_i \cdot (W_k r)_h + k_j \cdot (W_q r)_h``.

where ``β`` is the bucket and ``(·)_h`` the slice of head ``h``. The article shows
``compute_bias`` but not where its result enters the attention; posenc adds the
position·position ``bias`` *after* the temperature (as T5 does) and the two
content·position terms *before* it, with ``q·k`` (as Shaw, Transformer-XL, DeBERTa and HF
``relative_key`` scale their content·position terms). One module serves every layer
(``shared_across_layers``), as one ``RelativePositionEmbedding`` would; ``contextual-2``
still uses each layer's own ``W_k`` and ``W_q``.

The fast paths of the contextual terms project the ``num_buckets`` table rows once,
score ``q`` (and ``k``) against them (``[B, H, L, num_buckets]``) and gather by bucket;
the reference paths materialise ``r_{ij}`` ``[Lq, Lk, d_model]`` exactly as the article's code does.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from ..base import AttentionContext, Card, Cost, PositionalEncoding
from ..errors import ConfigError
from ..fused import RelativeForm, offset_table
from ..registry import register
from ._skew import cached_index, key_table_term, offset_rows, offsets, project, query_table_term, toeplitz

#: the article these encodings come from (docs/background.md)
_ARTICLE = 'anon., "Positional encoding of the Transformer"'


def seed_relative_position_bucket(relative_position: Tensor, num_buckets: int, max_distance: int = 128) -> Tensor:
    r"""The article's ``_relative_position_bucket`` (T5's bidirectional log buckets).

    With ``n = num_buckets // 2`` and ``e = n // 2``: positive offsets go to the upper half
    (``+n``); ``|x| < e`` keeps its own bucket; larger ``|x|`` fall in
    ``e + ⌊log(|x|/e) / log(max_distance/e) · (n - e)⌋``, capped at ``n - 1``.
    Computed in float32, as the article (and T5) do, so the bucket edges are the article's.
    """
    half = num_buckets // 2
    buckets = (relative_position > 0).to(torch.long) * half
    n = relative_position.abs()
    max_exact = half // 2
    is_small = n < max_exact
    # the article takes log(0) for n = 0 and discards it with the `where`; clamping leaves n >= max_exact unchanged
    ratio = n.float().clamp(min=max_exact) / max_exact
    large = max_exact + (torch.log(ratio) / math.log(max_distance / max_exact) * (half - max_exact)).to(torch.long)
    large = torch.clamp(large, max=half - 1)
    return buckets + torch.where(is_small, n, large)


def _check_buckets(num_buckets: object, max_distance: object) -> tuple[int, int]:
    if isinstance(num_buckets, bool) or not isinstance(num_buckets, int) or num_buckets < 4:
        raise ConfigError(
            f"num_buckets must be an integer >= 4 (half per direction, of which half are exact), got {num_buckets!r}"
        )
    max_exact = (num_buckets // 2) // 2
    if isinstance(max_distance, bool) or not isinstance(max_distance, int) or max_distance <= max_exact:
        raise ConfigError(
            f"max_distance must be an integer > {max_exact} (the exact buckets of num_buckets={num_buckets}), "
            f"got {max_distance!r}"
        )
    return num_buckets, max_distance


class _Bucketed(PositionalEncoding):
    """Shared: the bucket index ``β(q_pos - k_pos)`` ``[B|1, Lq, Lk]``, cached per forward."""

    num_buckets: int
    max_distance: int

    def offset_rows(self, ctx: AttentionContext) -> Tensor:
        """The bucket of each of the ``Lq + Lk - 1`` offsets of contiguous positions (``[P]``, of ``i - j``).

        Outside ``torch.compile``, a slice of a table of the buckets of the offsets ``-N .. N`` this module keeps
        (the buckets depend on no parameter), grown a half at a time: a decoding step then buckets no offset."""
        if torch.compiler.is_compiling():
            return seed_relative_position_bucket(-offsets(ctx), self.num_buckets, self.max_distance)
        lq, lk = ctx.q_pos.shape[-1], ctx.k_pos.shape[-1]
        low = int(ctx.k_pos[0, 0]) - int(ctx.q_pos[0, -1])  # the lowest offset j - i; P of them from there
        n = max(abs(low), abs(low + lq + lk - 2))
        memo = self.__dict__.get("_bucket_memo")
        if memo is None or memo.shape[0] < 2 * n + 1 or memo.device != ctx.q_pos.device:
            size = max(64, n + n // 2)
            offs = torch.arange(-size, size + 1, device=ctx.q_pos.device)
            memo = seed_relative_position_bucket(-offs, self.num_buckets, self.max_distance)
            self.__dict__["_bucket_memo"] = memo
        mid = memo.shape[0] // 2  # offset 0
        return memo[mid + low : mid + low + lq + lk - 1]

    def _kept(self, slot: object, params: tuple[Tensor | None, ...], build: Callable[[], Tensor]) -> Tensor:
        """``build()`` (a projected bucket table), kept under ``slot`` between calls without autograd while
        ``params`` do not change (version counters): a decoding step projects no table. With autograd (or while
        ``torch.compile`` traces) it is built each call, so its gradient reaches the parameters."""
        if torch.is_grad_enabled() or torch.compiler.is_compiling():
            return build()
        key = tuple((id(t), t._version, t.dtype, t.device) for t in params if t is not None)
        memo = self.__dict__.setdefault("_projected_memo", {})
        got = memo.get(slot)
        if got is None or got[0] != key:
            got = (key, build(), params)  # params kept: their ids stay theirs
            memo[slot] = got
        return got[1]

    def index(self, ctx: AttentionContext) -> Tensor:
        nb, md = self.num_buckets, self.max_distance
        return cached_index(
            ctx,
            ("seed001-bucket", nb, md),
            lambda qp, kp: seed_relative_position_bucket(qp[:, :, None] - kp[:, None, :], nb, md),
            self.info.name,
        )


@register
class RelativeBias(_Bucketed):
    r"""The article's ``bias`` flavour: a learned scalar per head and bucket of ``i - j``.

    .. math:: A_{ij} = \frac{q_i \cdot k_j}{\sqrt{d}} + b_h[\beta(i - j)]

    Args:
        n_heads: number of heads (one scalar per head and bucket).
        num_buckets: buckets of the bidirectional log bucketing (>= 4).
        max_distance: distances from here on share the last bucket.
    """

    info = Card(
        name="relative-bias",
        title="Bucketed relative bias (the 'bias' flavour)",
        paper=f"{_ARTICLE}, RelativePositionEmbedding('bias'), after Raffel et al. (T5)",
        year=2020,
        family="relative",
        position="relative",
        learnable=True,
        summary="A learned scalar per head and log-bucket of i-j, added after the temperature.",
        reference=f"compute_bias of {_ARTICLE} re-evaluated independently in the test",
        aliases=("seed-relative-bias",),
    )

    def __init__(self, n_heads: int, num_buckets: int = 32, max_distance: int = 128):
        super().__init__()
        if isinstance(n_heads, bool) or not isinstance(n_heads, int) or n_heads <= 0:
            raise ConfigError(f"n_heads must be a positive integer, got {n_heads!r}")
        self.num_buckets, self.max_distance = _check_buckets(num_buckets, max_distance)
        self.n_heads = n_heads
        self.embeddings = nn.Embedding(num_buckets, n_heads)

    def cost(self, head_dim: int) -> Cost:
        # a learned value per bucket and head, looked up per offset; each pair adds it
        return Cost(pair_elementwise=1.0, note="a lookup per offset, one add per pair and head (offset-bias kernel)")

    def bias_offsets(self, ctx: AttentionContext) -> Tensor | None:
        """The bucket embeddings of the ``Lq + Lk - 1`` offsets of contiguous positions: ``[H, P]`` (else ``None``)."""
        if ctx.reference or not offset_rows(ctx):
            return None
        if ctx.n_heads != self.n_heads:
            raise ConfigError(f"{self.info.name} was built for n_heads={self.n_heads}, got {ctx.n_heads}")
        buckets = seed_relative_position_bucket(-offsets(ctx), self.num_buckets, self.max_distance)  # of i - j
        return self.embeddings(buckets).t()

    def bias(self, ctx: AttentionContext) -> Tensor:
        if ctx.n_heads != self.n_heads:
            raise ConfigError(f"{self.info.name} was built for n_heads={self.n_heads}, got {ctx.n_heads}")
        vals = self.bias_offsets(ctx)
        if vals is not None:  # offset-only: Lq + Lk - 1 lookups laid out as a Toeplitz matrix
            return toeplitz(vals, ctx.q_pos.shape[-1], ctx.k_pos.shape[-1])
        return self.embeddings(self.index(ctx)).permute(0, 3, 1, 2)  # [B|1, H, Lq, Lk]


@register
class Contextual1(_Bucketed):
    r"""The article's ``contextual(1)``: the query dotted with a projected bucket embedding.

    .. math::
        A_{ij} = \frac{q_i \cdot k_j + q_i \cdot (W_r\, r_{\beta(i-j)})_h}{\sqrt{d_h}}, \qquad
        r \in \mathbb{R}^{\text{num\_buckets} \times d_{model}}, \;
        W_r \in \mathbb{R}^{(H d_h) \times d_{model}} \text{ (no bias)}

    Args:
        d_model: width of the bucket embeddings ``r`` (the article's ``hidden_size``).
        n_heads, head_dim: the attention's heads; ``W_r`` maps ``d_model -> n_heads · head_dim``.
        num_buckets, max_distance: the bucketing (see :func:`seed_relative_position_bucket`).
    """

    info = Card(
        name="contextual-1",
        title="Contextual relative position (the 'contextual(1)' flavour)",
        paper=f"{_ARTICLE}, RelativePositionEmbedding('contextual(1)')",
        year=2020,
        family="relative",
        position="relative",
        learnable=True,
        summary="q_i · W_r r[bucket(i-j)] added to q_i · k_j before the temperature.",
        reference=f"compute_bias of {_ARTICLE} re-evaluated independently in the test; fast == literal L×L×d form",
        aliases=("contextual1",),
    )

    def __init__(self, d_model: int, n_heads: int, head_dim: int, num_buckets: int = 32, max_distance: int = 128):
        super().__init__()
        for name, v in (("d_model", d_model), ("n_heads", n_heads), ("head_dim", head_dim)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {v!r}")
        self.num_buckets, self.max_distance = _check_buckets(num_buckets, max_distance)
        self.d_model, self.n_heads, self.head_dim = d_model, n_heads, head_dim
        self.embeddings = nn.Embedding(num_buckets, d_model)
        self.to_r = nn.Linear(d_model, n_heads * head_dim, bias=False)

    def cost(self, head_dim: int) -> Cost:
        # q_i · (W_r r_β)_h: 2·d per pair and head; W_r r for the num_buckets rows, 2·d_model·H·d each (parameters only)
        return Cost(
            pair=2.0 * head_dim,
            row=2.0 * self.d_model * self.n_heads * self.head_dim,
            rows=self.num_buckets,
            note="the projected bucket table once per call, q·row per pair (blocked kernel)",
        )

    def logits(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> Tensor:
        h, d = q.shape[1], q.shape[-1]
        if (h, d) != (self.n_heads, self.head_dim):
            raise ConfigError(
                f"{self.info.name} was built for n_heads={self.n_heads}, head_dim={self.head_dim}; got {h}, {d}"
            )
        index = self.index(ctx)
        if ctx.reference:
            r = self.to_r(self.embeddings(index)).to(q.dtype)  # [B|1, Lq, Lk, H*d], as the article
            r = r.unflatten(-1, (h, d)).expand(q.shape[0], -1, -1, -1, -1)
            return torch.einsum("bhmd,bmnhd->bhmn", q, r)
        table = self.to_r(self.embeddings.weight).unflatten(-1, (h, d))  # [num_buckets, H, d]
        return query_table_term(q, table, index)

    def relative_form(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> RelativeForm | None:
        """The query term over the offsets' buckets (:class:`~posenc.fused.Rows` of the projected table)."""
        if ctx.reference or not offset_rows(ctx) or (q.shape[1], q.shape[-1]) != (self.n_heads, self.head_dim):
            return None
        params = (self.embeddings.weight, self.to_r.weight)
        dims, dtype = (self.n_heads, self.head_dim), q.dtype
        table = self._kept(dtype, params, lambda: self.to_r(self.embeddings.weight).unflatten(-1, dims).to(dtype))
        return RelativeForm(q=q, k=k, query_terms=[(q, offset_table(table, self.offset_rows(ctx)))])


@register
class Contextual2(_Bucketed):
    r"""The article's ``contextual(2)``: bucket embeddings projected by the attention's own ``W_k`` and ``W_q``.

    .. math::
        A_{ij} = \frac{q_i \cdot k_j + q_i \cdot (W_k\, r_{\beta(i-j)})_h
                 + k_j \cdot (W_q\, r_{\beta(i-j)})_h}{\sqrt{d_h}}

    ``W_k``, ``W_q`` are the calling attention's ``k_proj`` / ``q_proj``
    (``ctx.attention``), used as the article uses ``to_k`` / ``to_q``: the whole linear
    layer, *including its bias* (``projection_bias=True``, the article's literal form). The
    bias adds ``q_i · b_k`` (constant over keys: no effect after the softmax) and
    ``k_j · b_q`` (a content-only term); ``projection_bias=False`` drops both.

    Args:
        d_model: width of the bucket embeddings (must be the attention's ``d_model``).
        num_buckets, max_distance: the bucketing (see :func:`seed_relative_position_bucket`).
        projection_bias: apply the projections' biases to ``r`` too (the article does).
    """

    info = Card(
        name="contextual-2",
        title="Contextual relative position (the 'contextual(2)' flavour)",
        paper=f"{_ARTICLE}, RelativePositionEmbedding('contextual(2)')",
        year=2020,
        family="relative",
        position="relative",
        learnable=True,
        summary="q_i · W_k r[bucket(i-j)] + k_j · W_q r[bucket(i-j)], reusing the attention's projections.",
        reference=f"compute_bias of {_ARTICLE} re-evaluated independently in the test; fast == literal L×L×d form",
        aliases=("contextual2",),
    )

    def __init__(self, d_model: int, num_buckets: int = 32, max_distance: int = 128, projection_bias: bool = True):
        super().__init__()
        if isinstance(d_model, bool) or not isinstance(d_model, int) or d_model <= 0:
            raise ConfigError(f"d_model must be a positive integer, got {d_model!r}")
        self.num_buckets, self.max_distance = _check_buckets(num_buckets, max_distance)
        self.d_model, self.projection_bias = d_model, bool(projection_bias)
        self.embeddings = nn.Embedding(num_buckets, d_model)

    def cost(self, head_dim: int) -> Cost:
        # q_i · (W_k r_β)_h + k_j · (W_q r_β)_h: 4·d per pair and head; W_k r and W_q r for the num_buckets rows,
        # 2 × 2·d_model·d_model each (the attention's projections: H·d = d_model)
        return Cost(
            pair=4.0 * head_dim,
            row=4.0 * self.d_model * self.d_model,
            rows=self.num_buckets,
            note="the two projected bucket tables once per call, a query and a key term per pair (blocked kernel)",
        )

    def _projections(self, ctx: AttentionContext) -> tuple[nn.Linear, nn.Linear]:
        att = ctx.attention
        q_proj, k_proj = getattr(att, "q_proj", None), getattr(att, "k_proj", None)
        if not isinstance(q_proj, nn.Linear) or not isinstance(k_proj, nn.Linear):
            raise ConfigError(
                f"{self.info.name} projects its bucket embeddings with the attention's own q_proj and k_proj "
                "(nn.Linear); call it from posenc.MultiHeadAttention (ctx.attention) with a key projection"
            )
        if q_proj.in_features != self.d_model or k_proj.in_features != self.d_model:
            raise ConfigError(
                f"{self.info.name} was built with d_model={self.d_model} but the attention's projections take "
                f"{q_proj.in_features}; build it with d_model={q_proj.in_features}"
            )
        return q_proj, k_proj

    def _project(self, r: Tensor, proj: nn.Linear) -> Tensor:
        return project(r, proj, bias=self.projection_bias)

    def logits(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> Tensor:
        q_proj, k_proj = self._projections(ctx)
        h, d = q.shape[1], q.shape[-1]
        index = self.index(ctx)
        if ctx.reference:
            r = self.embeddings(index)  # [B|1, Lq, Lk, d_model], as the article
            kr = self._project(r, k_proj).to(q.dtype).unflatten(-1, (h, d)).expand(q.shape[0], -1, -1, -1, -1)
            qr = self._project(r, q_proj).to(q.dtype).unflatten(-1, (h, d)).expand(q.shape[0], -1, -1, -1, -1)
            return torch.einsum("bhmd,bmnhd->bhmn", q, kr) + torch.einsum("bhnd,bmnhd->bhmn", k, qr)
        e = self.embeddings.weight
        kr = self._project(e, k_proj).unflatten(-1, (h, d))  # [num_buckets, H, d]
        qr = self._project(e, q_proj).unflatten(-1, (h, d))
        return query_table_term(q, kr, index) + key_table_term(k, qr, index)

    def relative_form(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> RelativeForm | None:
        """A query term and a key term over the offsets' buckets (:class:`~posenc.fused.Rows`)."""
        if ctx.reference or not offset_rows(ctx):
            return None
        q_proj, k_proj = self._projections(ctx)
        h, d = q.shape[1], q.shape[-1]
        e, dtype = self.embeddings.weight, q.dtype
        kr, qr = (
            # one table per projection (each layer's own), kept between decoding steps
            self._kept(
                (id(p), dtype), (e, p.weight, p.bias), lambda p=p: self._project(e, p).unflatten(-1, (h, d)).to(dtype)
            )
            for p in (k_proj, q_proj)
        )
        rows = self.offset_rows(ctx)
        return RelativeForm(
            q=q, k=k, query_terms=[(q, offset_table(kr, rows))], key_terms=[(k, offset_table(qr, rows))]
        )
