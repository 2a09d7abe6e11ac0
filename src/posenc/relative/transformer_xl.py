r"""Transformer-XL relative attention (Dai et al. 2019), and the helpers XLNet and TENER share.

With content ``q_i = W_q h_i``, ``k_j = W_{k,E} h_j`` and the sinusoid ``R_{i-j}``
of the *signed* distance between query position i and key position j
(Wu (2022), section "Transformer-XL"; paper eq. in section 3.3):

.. math::
    A_{ij} = \underbrace{q_i^\top k_j}_{(a)}
           + \underbrace{q_i^\top W_{k,R} R_{i-j}}_{(b)}
           + \underbrace{u^\top k_j}_{(c)}
           + \underbrace{v^\top W_{k,R} R_{i-j}}_{(d)}

Term (a) is the attention's own ``q·k``; terms (b), (c), (d) come through the
``logits`` hook, so the attention's temperature ``1/sqrt(d_head)`` multiplies
all four, as in the paper and in HF's ``RelPartialLearnableMultiHeadAttn``.

Two ways to compute (b) + (d) give the same numbers:

* reference (``ctx.reference``): ``R_{i-j}`` is materialised for every pair
  (i, j) -- a ``[Lq, Lk, d_model]`` tensor -- projected, and dotted with
  ``q_i + v``, literally as written;
* fast: when query and key positions are each contiguous (``p, p+1, ...``,
  the usual case, memory and KV caches included) the distances of all pairs
  are the ``Lq + Lk - 1`` consecutive integers ``max .. min``; ``q + v`` is
  dotted with the projected R of those distances only (``[B, H, Lq, Lq+Lk-1]``)
  and each row is shifted into place (Transformer-XL's ``_rel_shift``, in a
  pad-and-reshape form that also covers the negative distances of a
  bidirectional encoder). Other positions (packed documents, arbitrary ids)
  fall back to a gather over the distinct distances. No ``Lq × Lk × d``
  tensor is built on the fast path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..base import AttentionContext, Card, Cost, PositionalEncoding, is_arange_rows
from ..errors import ConfigError
from ..fused import RelativeForm, Rows
from ..registry import register
from ._sizes import head_dim_of
from ._skew import offset_rows, offsets

# ------------------------------------------------------------------ helpers

# sinusoid tables by (dim, base, interleaved, clamp, dtype, device): rows for distances -N .. N (see sinusoid_rows)
_SINUSOID_TABLES: dict[tuple, tuple[int, Tensor]] = {}
# the table covers distances up to this; farther ones are computed for the distances in use (no table of 2N rows)
SINUSOID_TABLE_LIMIT = 1 << 16


def sinusoid_inverse_frequencies(dim: int, base: float = 10000.0) -> Tensor:
    r"""``1 / base^{2i/dim}`` for ``i = 0 .. dim/2 - 1``, in float64."""
    return 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)


def relative_sinusoid(
    distances: Tensor, dim: int, *, base: float = 10000.0, interleaved: bool = False, clamp: float | None = None
) -> Tensor:
    r"""The sinusoid of (signed) distances: ``[..., dim]`` in float64.

    ``interleaved=False`` is Transformer-XL's / XLNet's layout ``[sin(dω) | cos(dω)]``;
    ``interleaved=True`` is TENER's ``[..., sin(dω_i), cos(dω_i), ...]``.
    ``clamp`` limits ``|d|`` first (Transformer-XL's ``clamp_len``).
    """
    d = distances.double()
    if clamp is not None:
        d = d.clamp(-clamp, clamp)
    angles = d[..., None] * sinusoid_inverse_frequencies(dim, base).to(d.device)
    if interleaved:
        return torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(-2)
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


def relative_shift(raw: Tensor, lk: int) -> Tensor:
    """Shift ``raw[..., i, t]`` (t indexing the distances ``max, max-1, ..., min``) into ``[..., i, j]``.

    ``out[..., i, j] = raw[..., i, Lq - 1 - i + j]`` for ``raw`` of width ``Lq + Lk - 1``:
    pad one column, flatten the rows, drop ``Lq - 1`` entries and re-fold with one
    column less per row (Transformer-XL's ``_rel_shift``, generalised to ``Lq != Lk``
    and to negative distances). Only views, a pad and a slice: no gather.
    """
    lq, p = raw.shape[-2], raw.shape[-1]
    if p != lq + lk - 1:
        raise ConfigError(f"relative_shift needs Lq + Lk - 1 = {lq + lk - 1} distances, got {p}")
    flat = F.pad(raw, (0, 1)).flatten(-2)  # [..., Lq * (Lq + Lk)]
    flat = flat[..., lq - 1 : lq - 1 + lq * p]
    return flat.unflatten(-1, (lq, p))[..., :lk]


def sinusoid_rows(
    distances: Tensor,
    dim: int,
    dtype: torch.dtype,
    *,
    base: float = 10000.0,
    interleaved: bool = False,
    clamp: float | None = None,
) -> Tensor:
    """:func:`relative_sinusoid` of integer ``distances`` cast to ``dtype``, looked up in a shared table.

    The table (float64 values cast once, so the numbers are exactly those of :func:`relative_sinusoid`) covers
    ``-N .. N`` and doubles when a distance falls outside; every layer and step reuses it, so decoding one token
    against ``L`` cached keys costs a lookup of ``L`` rows, not ``L · dim`` sines and cosines. Float distances and
    ``torch.compile`` tracing compute the sinusoid directly.
    """
    far = distances.numel() and not distances.is_floating_point() and not torch.compiler.is_compiling()
    need = int(distances.abs().max()) if far else 0
    if not far or need > SINUSOID_TABLE_LIMIT:
        return relative_sinusoid(distances, dim, base=base, interleaved=interleaved, clamp=clamp).to(dtype)
    n, table = _sinusoid_table(need, dim, dtype, distances.device, base, interleaved, clamp)
    if clamp is not None:
        distances = distances.clamp(-n, n)
    return table[distances + n]


def sinusoid_span(
    lo: int,
    hi: int,
    dim: int,
    dtype: torch.dtype,
    device: torch.device,
    *,
    base: float = 10000.0,
    interleaved: bool = False,
    clamp: float | None = None,
) -> Tensor:
    """The rows of distances ``lo, lo + 1, .., hi`` (:func:`sinusoid_rows`) as a *view* of the shared table (no copy;
    ``clamp`` needs the copying :func:`sinusoid_rows`)."""
    assert clamp is None, "sinusoid_span does not clamp"
    if max(abs(lo), abs(hi)) > SINUSOID_TABLE_LIMIT:  # far: the rows in use only (a new tensor)
        steps = torch.arange(lo, hi + 1, device=device)
        return relative_sinusoid(steps, dim, base=base, interleaved=interleaved).to(dtype)
    n, table = _sinusoid_table(max(abs(lo), abs(hi)), dim, dtype, device, base, interleaved, None)
    return table[lo + n : hi + n + 1]


def _sinusoid_table(
    need: int,
    dim: int,
    dtype: torch.dtype,
    device: torch.device,
    base: float,
    interleaved: bool,
    clamp: float | None,
) -> tuple[int, Tensor]:
    """``(N, rows of -N .. N)`` with ``N >= need``, grown by doubling."""
    key = (dim, float(base), interleaved, clamp, dtype, device)
    got = _SINUSOID_TABLES.get(key)
    if got is None or got[0] < need:
        n = max(64, 1 << need.bit_length())
        if clamp is not None:
            n = min(n, max(int(clamp), need))
        steps = torch.arange(-n, n + 1, device=device)
        got = (n, relative_sinusoid(steps, dim, base=base, interleaved=interleaved, clamp=clamp).to(dtype))
        _SINUSOID_TABLES[key] = got
    return got


class RelativeTerms:
    """Distances between ``ctx.q_pos`` and ``ctx.k_pos`` in the two forms the fast path uses.

    ``mode == "shift"``: ``distances`` is ``[B', Lq + Lk - 1]`` (max down to min) and
    :func:`relative_shift` puts scores in place; ``mode == "gather"``: ``distances``
    is ``[U]`` (the distinct ones) and ``index`` ``[B', Lq, Lk]`` picks them.
    """

    def __init__(self, ctx: AttentionContext):
        q_pos, k_pos = ctx.q_pos, ctx.k_pos
        self.lq, self.lk = q_pos.shape[-1], k_pos.shape[-1]
        self.index: Tensor | None = None
        # every row start + arange (the shift form handles a different start per row): decided once per forward
        if ctx.contiguous or (is_arange_rows(q_pos, ctx.cache) and is_arange_rows(k_pos, ctx.cache)):
            self.mode = "shift"
            top = q_pos[:, -1:] - k_pos[:, :1]  # [B', 1] the largest distance i - j
            steps = torch.arange(self.lq + self.lk - 1, device=q_pos.device, dtype=top.dtype)
            self.distances = top - steps  # [B', P]
        elif torch.compiler.is_compiling():
            # traced with positions of unknown spacing: torch.unique has a data-dependent size, so gather from
            # every (i, j) pair's own distance instead (O(Lq·Lk·d) work; the same numbers)
            self.mode = "pairs"
            self.distances = (q_pos[:, :, None] - k_pos[:, None, :]).reshape(-1)  # [B' · Lq · Lk]
        else:
            self.mode = "gather"
            rel = q_pos[:, :, None] - k_pos[:, None, :]  # [B', Lq, Lk], i - j
            self.distances, self.index = torch.unique(rel, return_inverse=True)

    @staticmethod
    def get(ctx: AttentionContext) -> RelativeTerms:
        """One per forward and pair of position tensors (cached in ``ctx.cache``)."""
        key = "relative-terms(i-j)"
        got = ctx.cache.get(key)
        if got is None or got[0] is not ctx.q_pos or got[1] is not ctx.k_pos:
            got = (ctx.q_pos, ctx.k_pos, RelativeTerms(ctx))
            ctx.cache[key] = got
        return got[2]

    def scores(self, query: Tensor, rel_keys: Tensor) -> Tensor:
        """``query_i · rel_keys(i - j)`` for every (i, j): ``[B, H, Lq, Lk]``.

        ``query`` is ``[B, H, Lq, Dh]``; ``rel_keys`` the keys of ``self.distances``:
        ``[B', P, H, Dh]`` (shift), ``[U, H, Dh]`` (gather) or ``[B' · Lq · Lk, H, Dh]`` (pairs: only while
        ``torch.compile`` traces positions whose spacing it cannot know).
        """
        if self.mode == "shift":
            if rel_keys.shape[0] == 1:
                raw = torch.einsum("bhid,phd->bhip", query, rel_keys[0])
            else:
                raw = torch.einsum("bhid,bphd->bhip", query, rel_keys)
            return relative_shift(raw, self.lk)
        if self.mode == "pairs":
            per_pair = rel_keys.reshape(-1, self.lq, self.lk, *rel_keys.shape[-2:])  # [B', Lq, Lk, H, Dh]
            return torch.einsum("bhid,bijhd->bhij", query, per_pair.expand(query.shape[0], -1, -1, -1, -1))
        assert self.index is not None
        return self._gather(torch.einsum("bhid,uhd->bhiu", query, rel_keys))  # [B, H, Lq, U]

    def _gather(self, raw: Tensor) -> Tensor:
        assert self.index is not None
        b, h = raw.shape[0], raw.shape[1]
        return torch.gather(raw, -1, self.index[:, None].expand(b, h, self.lq, self.lk))

    def scores_sinusoid(self, query: Tensor, rows: Tensor) -> Tensor:
        """``query_i · rows(i - j)`` with rows shared by the heads: ``[B, H, Lq, Lk]``.

        ``query`` is ``[B, H, Lq, m]``; ``rows`` the ``[B', P, m]`` (shift) or ``[U, m]`` (gather) rows of
        ``self.distances``."""
        if self.mode == "shift":
            if rows.shape[0] == 1:
                raw = torch.matmul(query, rows[0].t())
            else:
                raw = torch.matmul(query, rows[:, None].transpose(-1, -2))
            return relative_shift(raw, self.lk)
        return self._gather(torch.matmul(query, rows.t()))


def check_heads(name: str, q: Tensor, n_heads: int, head_dim: int) -> None:
    if q.shape[1] != n_heads or q.shape[-1] != head_dim:
        raise ConfigError(
            f"{name} was built for n_heads={n_heads}, head_dim={head_dim} but the attention has "
            f"n_heads={q.shape[1]}, head_dim={q.shape[-1]}; build it with the attention's sizes"
        )


# ------------------------------------------------------------ the encoding


@register
class TransformerXL(PositionalEncoding):
    r"""Transformer-XL relative position encoding (Dai et al. 2019, section 3.3).

    .. math::
        A_{ij} = q_i^\top k_j + q_i^\top W_{k,R} R_{i-j} + u^\top k_j + v^\top W_{k,R} R_{i-j},
        \qquad R_{d} = [\sin(d\,\omega_0), \dots, \sin(d\,\omega_{D/2-1}) \,|\,
                        \cos(d\,\omega_0), \dots, \cos(d\,\omega_{D/2-1})]

    with ``ω_k = 1/10000^{2k/D}``, ``D = d_model`` (the layout and frequencies of the
    authors' code and of HF's ``PositionalEmbedding``), ``d = i - j`` the signed
    distance between the *explicit* positions ``ctx.q_pos[i]`` and ``ctx.k_pos[j]``
    (with recurrence memory the queries continue after the memory), ``W_{k,R}``
    a learned ``d_model -> n_heads·head_dim`` projection per layer, and ``u``,
    ``v`` learned ``[n_heads, head_dim]`` biases (HF's ``r_w_bias`` and
    ``r_r_bias``).

    ``untie_r=True`` (HF's default, ``TransfoXLConfig.untie_r``) gives every layer
    its own ``u`` and ``v``; ``untie_r=False`` shares one pair across layers (the
    authors' original default) while ``W_{k,R}`` stays per layer.
    ``clamp_len`` clamps ``|i - j|`` (HF's ``clamp_len``; ``None`` = no clamp).

    Segment-level recurrence lives in the core: ``Transformer(..., encoding=
    "transformer-xl")(tokens, memory=..., return_memory=True)`` prepends each
    layer's detached memory to its keys and values.
    """

    info = Card(
        name="transformer-xl",
        title="Transformer-XL relative attention",
        paper="Dai et al., Transformer-XL: Attentive Language Models Beyond a Fixed-Length Context",
        year=2019,
        family="relative",
        position="relative",
        learnable=True,
        summary="q·k + q·W_kR R_{i-j} + u·k + v·W_kR R_{i-j}; sinusoid R, learned u, v, W_kR; segment memory.",
        reference="HF transformers 4.57 RelPartialLearnableMultiHeadAttn (golden fixture); naive R_{i-j} loop",
        aliases=("txl", "transfo-xl"),
    )
    shared_across_layers = False  # W_kR (and u, v unless untie_r=False) per layer

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        head_dim: int | None = None,
        clamp_len: int | None = None,
        untie_r: bool = True,
        base: float = 10000.0,
    ):
        super().__init__()
        if not isinstance(d_model, int) or d_model <= 0 or d_model % 2:
            raise ConfigError(
                f"{self.info.name} builds R_(i-j) as [sin | cos] halves of width d_model, so d_model must be "
                f"a positive even integer, got {d_model!r}"
            )
        if not isinstance(n_heads, int) or n_heads <= 0:
            raise ConfigError(f"n_heads must be a positive integer, got {n_heads!r}")
        head_dim = head_dim_of(d_model, n_heads, head_dim)
        if clamp_len is not None and (not isinstance(clamp_len, int) or clamp_len <= 0):
            raise ConfigError(f"clamp_len must be a positive integer or None, got {clamp_len!r}")
        if base <= 1:
            raise ConfigError(f"base must be > 1, got {base}")
        self.d_model, self.n_heads, self.head_dim = d_model, n_heads, head_dim
        self.clamp_len, self.untie_r, self.base = clamp_len, untie_r, base
        self.W_kR = nn.Linear(d_model, n_heads * head_dim, bias=False)
        self.u = nn.Parameter(torch.empty(n_heads, head_dim))
        self.v = nn.Parameter(torch.empty(n_heads, head_dim))
        self._init_biases()

    def cost(self, head_dim: int) -> Cost:
        # (q_i + v) · W_kR R_{i-j}: 2·d per pair and head; u · k_j folds into the query, (q_i + u) · k_j (the adds
        # q + u, q + v: 2·d per token); W_kR R_d once per offset, 2·d_model·H·d (parameters only: kept while decoding)
        return Cost(
            pair=2.0 * head_dim,
            token_elementwise=2.0 * head_dim,
            row=2.0 * self.d_model * self.n_heads * self.head_dim,
            note="W_kR R per offset (kept between decoding steps), (q+v)·row per pair, u folded (blocked kernel)",
        )

    def _init_biases(self) -> None:
        nn.init.normal_(self.u, std=0.02)
        nn.init.normal_(self.v, std=0.02)

    def reset_parameters(self) -> None:
        self.W_kR.reset_parameters()
        self._init_biases()

    def fresh_copy(self) -> PositionalEncoding:
        new = super().fresh_copy()
        if not self.untie_r:  # one u, v for every layer
            new.u, new.v = self.u, self.v
        return new

    # ------------------------------------------------------------ pieces
    def R(self, distances: Tensor) -> Tensor:
        """The sinusoid ``R_d`` of distances ``d``: ``[..., d_model]`` (float64)."""
        return relative_sinusoid(distances, self.d_model, base=self.base, clamp=self.clamp_len)

    def R_rows(self, distances: Tensor, dtype: torch.dtype) -> Tensor:
        """``R_d`` in ``dtype`` from the shared table (:func:`sinusoid_rows`; the same numbers as :meth:`R`)."""
        return sinusoid_rows(distances, self.d_model, dtype, base=self.base, clamp=self.clamp_len)

    def projected_R(self, distances: Tensor, dtype: torch.dtype) -> Tensor:
        """``W_{k,R} R_d``: ``[..., n_heads, head_dim]``."""
        return self.W_kR(self.R_rows(distances, dtype)).unflatten(-1, (self.n_heads, self.head_dim))

    def _projected_span(self, lo: int, hi: int, dtype: torch.dtype, device: torch.device) -> Tensor | None:
        """``W_{k,R} R_d`` for the distances ``d = lo .. hi`` as ``[H, hi - lo + 1, Dh]``: a view of a table this
        module keeps between calls without autograd (decoding), rebuilt (a half larger) when a distance falls
        outside it or ``W_{k,R}`` changed (its version counter); ``None`` with autograd, in training or with
        ``clamp_len`` (the caller then projects per call)."""
        if torch.is_grad_enabled() or self.training or self.clamp_len is not None:
            return None
        w = self.W_kR.weight
        key = (id(w), w._version, dtype, device)
        memo = self.__dict__.get("_projected_memo")
        if memo is None or memo[0] != key or lo < memo[1] or hi >= memo[1] + memo[2].shape[1]:
            pad = max(64, (hi - lo + 1) // 2)
            new_lo, new_hi = (lo if lo >= 0 else lo - pad), hi + pad
            if memo is not None and memo[0] == key:
                new_lo, new_hi = min(new_lo, memo[1]), max(new_hi, memo[1] + memo[2].shape[1] - 1)
            d = torch.arange(new_lo, new_hi + 1, device=device)
            table = self.projected_R(d, dtype).permute(1, 0, 2).contiguous()  # [H, N, Dh]
            memo = (key, new_lo, table, w)  # w kept alive: its id stays its own
            self.__dict__["_projected_memo"] = memo
        return memo[2][:, lo - memo[1] : hi - memo[1] + 1]

    def position_terms(self, q: Tensor, ctx: AttentionContext) -> Tensor:
        """Terms (b) + (d): ``(q_i + v) · W_{k,R} R_{i-j}``, ``[B, H, Lq, Lk]``.

        With few queries (decoding: ``Lq < head_dim``) the product is taken the other way round,
        ``((q_i + v) W_{k,R}) · R_{i-j}``: ``Lq · d_model`` per head and distance instead of projecting every one of
        the ``Lq + Lk - 1`` distances (``d_model · H · Dh`` each), the same numbers up to rounding.
        """
        qv = q + self.v[:, None, :].to(q.dtype)
        if not ctx.reference and q.shape[2] < self.head_dim:
            terms = RelativeTerms.get(ctx)
            if terms.mode == "shift" and terms.distances.shape[0] == 1 and not torch.compiler.is_compiling():
                hi, lo = int(terms.distances[0, 0]), int(terms.distances[0, -1])
                kept = self._projected_span(lo, hi, q.dtype, q.device)
                if kept is not None:  # decoding: W_{k,R} R_d kept between steps, Dh products per head and distance
                    return relative_shift(torch.matmul(qv, kept.transpose(-1, -2)).flip(-1), terms.lk)
            if terms.mode in ("shift", "gather"):
                w = self.W_kR.weight.to(q.dtype).view(self.n_heads, self.head_dim, self.d_model)
                qw = torch.einsum("bhid,hdm->bhim", qv, w)  # [B, H, Lq, d_model]
                if (
                    terms.mode == "shift"
                    and terms.distances.shape[0] == 1
                    and self.clamp_len is None
                    and not torch.compiler.is_compiling()
                ):
                    # the distances run down by one: a view of the table's rows (ascending), the scores reversed
                    hi, lo = int(terms.distances[0, 0]), int(terms.distances[0, -1])
                    rows = sinusoid_span(lo, hi, self.d_model, q.dtype, q.device, base=self.base)
                    return relative_shift(torch.matmul(qw, rows.t()).flip(-1), terms.lk)
                return terms.scores_sinusoid(qw, self.R_rows(terms.distances, q.dtype))
        if ctx.reference:
            rel = ctx.q_pos[:, :, None] - ctx.k_pos[:, None, :]  # [B', Lq, Lk], i - j
            wr = self.projected_R(rel, q.dtype)  # [B', Lq, Lk, H, Dh]: R_{i-j} for every pair
            if wr.shape[0] == 1:
                return torch.einsum("bhid,ijhd->bhij", qv, wr[0])
            return torch.einsum("bhid,bijhd->bhij", qv, wr)
        terms = RelativeTerms.get(ctx)
        return terms.scores(qv, self.projected_R(terms.distances, q.dtype))

    def content_bias(self, k: Tensor) -> Tensor:
        """Term (c): ``u · k_j``, ``[B, H, 1, Lk]``."""
        return torch.einsum("hd,bhjd->bhj", self.u.to(k.dtype), k)[:, :, None, :]

    def logits(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> Tensor:
        check_heads(self.info.name, q, self.n_heads, self.head_dim)
        out = self.position_terms(q, ctx)
        return out if ctx.content_folded else out + self.content_bias(k)

    def content_query(self, q: Tensor, ctx: AttentionContext) -> Tensor | None:
        """(a) + (c) as ``(q + u) · k_j``: the attention's kernel then reads the keys once (see the base class)."""
        if ctx.reference:
            return None
        check_heads(self.info.name, q, self.n_heads, self.head_dim)
        return q + self.u[:, None, :].to(q.dtype)

    def relative_form(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> RelativeForm | None:
        """(a) + (c) as ``(q + u) · k``, (b) + (d) as ``(q + v) · W_{k,R} R`` over the offsets (:mod:`posenc.fused`)."""
        if ctx.reference or not offset_rows(ctx):
            return None
        check_heads(self.info.name, q, self.n_heads, self.head_dim)
        qu = q + self.u[:, None, :].to(q.dtype)
        qv = q + self.v[:, None, :].to(q.dtype)
        distances = -offsets(ctx)  # i - j = -(j - i), descending
        if q.shape[2] == 1 and not torch.compiler.is_compiling():
            # one query (decoding): rows of the W_{k,R} R table kept between no-grad steps, not P projections
            lo, hi = int(distances[-1]), int(distances[0])
            kept = self._projected_span(lo, hi, q.dtype, q.device)  # [H, hi - lo + 1, Dh], ascending distances
            if kept is not None:
                return RelativeForm(q=qu, k=k, query_terms=[(qv, Rows(kept.transpose(0, 1), distances - lo))])
        rel_keys = self.projected_R(distances, q.dtype)  # [P, H, Dh] at distances i - j = -(j - i)
        return RelativeForm(q=qu, k=k, query_terms=[(qv, rel_keys)])


__all__ = ["TransformerXL", "RelativeTerms", "relative_shift", "relative_sinusoid", "check_heads"]
