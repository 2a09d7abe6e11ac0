"""Shared helpers for table-based relative encodings (Shaw, NEZHA, BERT relative_key, contextual).

These encodings look up a vector ``a_{ij} = table[idx(i, j)]`` for every query
``i`` and key ``j``, where ``idx`` is a small integer index (a clipped offset, a
shifted distance, a log bucket) into a table of ``R`` rows. Written literally
they materialise ``[Lq, Lk, d]`` tensors. The fast forms here never do:

* content·position term ``q_i · a_{ij}``: ``S = q Tᵀ`` (``[B, H, Lq, R]``), then
  ``out[i, j] = S[i, idx(i, j)]`` -- a gather (:func:`gather_query_scores`);
* position·content term ``k_j · a_{ij}``: ``S = k Tᵀ`` (``[B, H, Lk, R]``), then
  ``out[i, j] = S[j, idx(i, j)]`` (:func:`gather_key_scores`);
* value term ``Σ_j p_{ij} a_{ij}``: sum the probabilities falling in each row,
  ``P[i, r] = Σ_{j: idx(i,j) = r} p_{ij}`` (a scatter-add, ``[B, H, Lq, R]``),
  then ``P T`` (:func:`bucket_probabilities`).

Every helper takes explicit indices ``[B|1, Lq, Lk]`` computed from the
explicit positions of the :class:`~posenc.base.AttentionContext`, so offsets,
KV caches (``Lq != Lk``), left padding and per-sequence positions need nothing
special. :func:`used_rows` narrows the table to the rows the indices actually
touch (at most ``Lq + Lk - 1`` of them for an offset-based index), which keeps
``R`` small when the table is large (BERT's ``2 · max_len - 1`` rows) and the
sequence short.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from .. import native
from ..base import AttentionContext
from ..errors import PositionError


def integer_positions(ctx: AttentionContext, name: str) -> tuple[Tensor, Tensor]:
    """``ctx.q_pos`` and ``ctx.k_pos``, checked to be integers (table rows need whole offsets)."""
    for what, pos in (("query", ctx.q_pos), ("key", ctx.k_pos)):
        if pos.is_floating_point() or pos.is_complex():
            raise PositionError(
                f"{name} looks up a table by the integer offset between positions, but the {what} "
                f"positions have dtype {pos.dtype}; pass integer (torch.long) positions"
            )
    return ctx.q_pos, ctx.k_pos


def cached_index(ctx: AttentionContext, key: Any, build: Callable[[Tensor, Tensor], Tensor], name: str) -> Tensor:
    """``build(q_pos, k_pos)`` (an index ``[B|1, Lq, Lk]``), computed once per forward and positions."""
    q_pos, k_pos = integer_positions(ctx, name)
    got = ctx.cache.get(key)
    if got is not None and got[0] is q_pos and got[1] is k_pos:
        return got[2]
    index = build(q_pos, k_pos)
    ctx.cache[key] = (q_pos, k_pos, index)
    return index


def used_rows(index: Tensor, n_rows: int) -> tuple[int, int]:
    """The half-open range ``[lo, hi)`` of table rows that ``index`` uses (all rows if empty)."""
    if index.numel() == 0 or torch.compiler.is_compiling():
        return 0, n_rows
    return int(index.min()), int(index.max()) + 1


def _expand(index: Tensor, b: int, h: int) -> Tensor:
    """``[B|1, M, N]`` -> ``[b, h, M, N]`` without copying."""
    return index[:, None].expand(b, h, index.shape[-2], index.shape[-1])


def gather_query_scores(scores: Tensor, index: Tensor) -> Tensor:
    """``out[b, h, i, j] = scores[b, h, i, index[b, i, j]]``.

    ``scores``: ``[B, H, Lq, R]`` (``q · table_rᵀ``); ``index``: ``[B|1, Lq, Lk]``.
    """
    b, h = scores.shape[:2]
    return torch.gather(scores, -1, _expand(index, b, h))


def gather_key_scores(scores: Tensor, index: Tensor) -> Tensor:
    """``out[b, h, i, j] = scores[b, h, j, index[b, i, j]]``.

    ``scores``: ``[B, H, Lk, R]`` (``k · table_rᵀ``); ``index``: ``[B|1, Lq, Lk]``.
    """
    b, h = scores.shape[:2]
    return torch.gather(scores, -1, _expand(index.transpose(-1, -2), b, h)).transpose(-1, -2)


def bucket_probabilities(probs: Tensor, index: Tensor, n_rows: int) -> Tensor:
    """``P[b, h, i, r] = Σ_{j : index[b, i, j] = r} probs[b, h, i, j]``: ``[B, H, Lq, n_rows]``."""
    b, h, lq, _ = probs.shape
    out = probs.new_zeros(b, h, lq, n_rows)
    return out.scatter_add(-1, _expand(index, b, h), probs)


def query_table_term(q: Tensor, table: Tensor, index: Tensor) -> Tensor:
    """``Σ_d q[b,h,i,d] · table[index[b,i,j], d]`` without an ``[Lq, Lk, d]`` tensor.

    ``table`` is ``[R, Dh]`` (shared by the heads) or ``[R, H, Dh]`` (one row per head).
    """
    lo, hi = used_rows(index, table.shape[0])
    t = table[lo:hi].to(q.dtype)
    scores = torch.einsum("bhid,rd->bhir", q, t) if t.dim() == 2 else torch.einsum("bhid,rhd->bhir", q, t)
    return gather_query_scores(scores, index - lo if lo else index)


# the most elements of a gathered ``[Lq, Lk, H·d]`` table a key term may make for a few queries (decoding)
DIRECT_KEY_TERM_ELEMENTS = 1 << 23


def key_table_term(k: Tensor, table: Tensor, index: Tensor) -> Tensor:
    """``Σ_d k[b,h,j,d] · table[index[b,i,j], d]`` without an ``[Lq, Lk, d]`` tensor (except a small one).

    ``k`` against every used row is ``Lk · R`` dot products; for a few queries (decoding one token against ``Lk``
    cached keys, where ``R ≈ Lk``) gathering each pair's row is ``Lq · Lk`` of them, so that form is taken while
    ``8 Lq <= min(Lk, R)`` and the gathered rows stay under :data:`DIRECT_KEY_TERM_ELEMENTS`.
    """
    lo, hi = used_rows(index, table.shape[0])
    lq, lk = index.shape[-2], index.shape[-1]
    heads = k.shape[1] if table.dim() == 3 else 1
    if lq == 1 and index.shape[0] == 1 and 8 <= min(lk, hi - lo) and not torch.compiler.is_compiling():
        return key_rows_dot(k, table.to(k.dtype), index[0, 0])[:, :, None]
    if (
        8 * lq <= min(lk, hi - lo)  # a few queries against many keys (never an L × L × d tensor)
        and index.shape[0] * lq * lk * heads * k.shape[-1] <= DIRECT_KEY_TERM_ELEMENTS
        and not torch.compiler.is_compiling()
    ):
        rows = table.to(k.dtype)[index]  # [B|1, Lq, Lk, (H,) d]
        if table.dim() == 2:
            return torch.einsum("bhjd,bijd->bhij", k, rows.expand(k.shape[0], -1, -1, -1))
        return torch.einsum("bhjd,bijhd->bhij", k, rows.expand(k.shape[0], -1, -1, -1, -1))
    t = table[lo:hi].to(k.dtype)
    scores = torch.einsum("bhjd,rd->bhjr", k, t) if t.dim() == 2 else torch.einsum("bhjd,rhd->bhjr", k, t)
    return gather_key_scores(scores, index - lo if lo else index)


def _run_length(index: Tensor, value: int) -> int:
    """How many leading entries of the 1-D ``index`` equal ``value``."""
    other = index != value
    return int(other.to(torch.uint8).argmax()) if bool(other.any()) else index.numel()


def key_rows_dot(k: Tensor, table: Tensor, index: Tensor) -> Tensor:
    """``out[b, h, j] = Σ_d k[b,h,j,d] · table[index[j], (h,) d]`` for one query: ``[B, H, Lk]``.

    ``table`` is ``[R, Dh]`` or ``[R, H, Dh]``, ``index`` ``[Lk]`` and monotone (a decoding step's distances). The
    runs of one row at either end (the distances a clip or the last bucket maps to one row) are one matrix-vector
    product each; the rows between are gathered and multiplied element-wise (not a batched product of ``Lk``
    one-by-one matrices, which einsum makes of it). With the native kernels (:func:`posenc.native.rows_dot`) all of
    it is one pass over ``k`` and the rows, with no temporary.
    """
    fast = native.rows_dot(k, table, index)
    if fast is not None:
        return fast
    lk = index.shape[0]
    first, last = (int(v) for v in index[[0, -1]].tolist())
    a = _run_length(index, first)
    z = lk - a if a == lk else _run_length(index.flip(0), last)
    out = k.new_empty(k.shape[:3])

    def ends(sl: slice, row: int) -> None:
        r = table[row]  # [Dh] or [H, Dh]
        if r.dim() == 1:
            out[:, :, sl] = torch.matmul(k[:, :, sl], r)
        else:
            out[:, :, sl] = torch.einsum("bhjd,hd->bhj", k[:, :, sl], r)

    if a:
        ends(slice(0, a), first)
    if z:
        ends(slice(lk - z, lk), last)
    if a + z < lk:
        rows = table[index[a : lk - z]]  # [M, Dh] or [M, H, Dh]
        if rows.dim() == 3:
            rows = rows.transpose(0, 1)
        out[:, :, a : lk - z] = (k[:, :, a : lk - z] * rows).sum(-1)
    return out


def value_table_term(probs: Tensor, table: Tensor, index: Tensor) -> Tensor:
    """``Σ_j probs[b,h,i,j] · table[index[b,i,j]]``: ``[B, H, Lq, Dh]`` without an ``[Lq, Lk, d]`` tensor."""
    lo, hi = used_rows(index, table.shape[0])
    t = table[lo:hi].to(probs.dtype)
    p = bucket_probabilities(probs, index - lo if lo else index, hi - lo)
    return torch.einsum("bhir,rd->bhid", p, t) if t.dim() == 2 else torch.einsum("bhir,rhd->bhid", p, t)


def materialise(table: Tensor, index: Tensor) -> Tensor:
    """The literal ``a_{ij} = table[index[i, j]]``: ``[B|1, Lq, Lk, ...]`` (reference paths only)."""
    return table[index]


# ----------------------------------------------------------------- Toeplitz (offset-only) biases
def arange_rows(ctx: AttentionContext) -> bool:
    """Whether ``j - i`` is one Toeplitz pattern for every row (``ctx.contiguous``, decided once per forward).

    Then ``j - i`` runs through ``k_pos[0] - q_pos[-1] .. k_pos[-1] - q_pos[0]`` of row 0 (``Lq + Lk - 1``
    values, the same in every row) and a term that depends only on ``j - i`` is a Toeplitz matrix (see
    :func:`toeplitz`).
    """
    return ctx.contiguous and not torch.compiler.is_compiling()


def offset_rows(ctx: AttentionContext) -> bool:
    """Whether an encoding may hand its terms to the kernels per offset (``bias_offsets``, ``relative_form``):
    ``ctx.contiguous``. Unlike :func:`arange_rows` it holds while ``torch.compile`` traces, because the kernels
    that read the offsets (offset-bias, blocked) are custom ops the compiler keeps whole (:mod:`posenc.ops`)."""
    return ctx.contiguous


def offsets(ctx: AttentionContext) -> Tensor:
    """The ``Lq + Lk - 1`` offsets ``j - i`` of :func:`arange_rows` positions (row 0), ascending: ``[P]``."""
    lq, lk = ctx.q_pos.shape[-1], ctx.k_pos.shape[-1]
    low = ctx.k_pos[0, :1] - ctx.q_pos[0, -1:]
    return low + torch.arange(lq + lk - 1, device=ctx.q_pos.device, dtype=ctx.q_pos.dtype)


class _Toeplitz(torch.autograd.Function):
    """``out[h, i, j] = vals[h, j - i + Lq - 1]``; the backward sums ``grad`` along each diagonal."""

    @staticmethod
    def forward(ctx, vals: Tensor, lq: int, lk: int) -> Tensor:  # type: ignore[override]
        h, p = vals.shape
        vals = vals.contiguous()
        ctx.lq, ctx.lk = lq, lk
        # row r of the strided view is vals[r : r + Lk], i.e. query i = Lq - 1 - r; flip puts the rows in order
        rows = torch.arange(lq - 1, -1, -1, device=vals.device)
        return torch.index_select(vals.as_strided((h, lq, lk), (p, 1, 1)), 1, rows)  # contiguous, one pass

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        lq, lk = ctx.lq, ctx.lk
        h, p = grad.shape[0], lq + lk - 1
        # rows of width P + 1: (i, j) placed at i·(P + 1) + (j - i + Lq - 1) = i·P + j + Lq - 1 puts every
        # diagonal j - i in one column; one head at a time through one zeroed buffer (the gaps stay zero)
        buf = grad.new_zeros(lq * (p + 1))
        place = buf.as_strided((lq, lk), (p, 1), lq - 1)
        out = grad.new_empty(h, p)
        for hi in range(h):
            place.copy_(grad[hi])
            torch.sum(buf.view(lq, p + 1)[:, :p], dim=0, out=out[hi])
        return out, None, None


def kept_offset_table(
    owner: Any, name: str, n: int, of_distance: Callable[[Tensor], Tensor], params: list[Tensor], like: Tensor
) -> Tensor:
    """``of_distance(|o|)`` at the offsets ``o = -N .. N`` (``N >= n``; offset 0 in the middle of the last dimension),
    kept in ``owner.__dict__[name]`` between calls while ``params`` do not change (their ids, version counters, dtypes
    and devices): a decoding step's offsets are one run, so it reads a slice. Rebuilt a half larger when an offset
    falls outside; the distances in ``like``'s dtype and device. For calls without autograd (the caller's check): the
    table is built from the parameters' values, not recorded."""
    key = tuple((id(t), t._version, t.dtype, t.device) for t in params)
    memo = owner.__dict__.get(name)
    if memo is None or memo[0] != key or memo[1].shape[-1] < 2 * n + 1:
        size = max(64, n + n // 2, memo[1].shape[-1] // 2 if memo is not None and memo[0] == key else 0)
        d = torch.arange(-size, size + 1, dtype=like.dtype, device=like.device).abs()
        memo = (key, of_distance(d), list(params))  # params kept: their ids stay theirs
        owner.__dict__[name] = memo
    return memo[1]


def toeplitz(vals: Tensor, lq: int, lk: int) -> Tensor:
    """``[1, H, Lq, Lk]`` with ``out[0, h, i, j] = vals[h, j - i + Lq - 1]`` from ``vals [H, Lq + Lk - 1]``.

    One write of the ``H·Lq·Lk`` output and, in the backward, one diagonal sum: the bias of an offset-only
    encoding (T5, KERPLE, ALiBi ...) then costs ``Lq + Lk - 1`` evaluations instead of ``Lq·Lk``.
    """
    if vals.shape[-1] != lq + lk - 1:
        raise ValueError(f"toeplitz needs Lq + Lk - 1 = {lq + lk - 1} offsets, got {vals.shape[-1]}")
    return _Toeplitz.apply(vals, lq, lk)[None]


def project(x: Tensor, proj: nn.Module, bias: bool = True) -> Tensor:
    """``proj(x)`` for an ``nn.Linear`` (its bias only where ``bias``) computed in ``x``'s dtype: a position table
    (float32 where posenc computes in float32) projected with a calling attention's own ``q_proj`` / ``k_proj``,
    which are bfloat16 or float16 in a half-precision transformers model, patched in that dtype or cast after
    patching (``F.linear`` refuses mixed dtypes). Any other module is called as it is."""
    if not isinstance(proj, nn.Linear):
        return proj(x)
    w = proj.weight.to(x.dtype)
    b = proj.bias.to(x.dtype) if bias and proj.bias is not None else None
    return F.linear(x, w, b)
