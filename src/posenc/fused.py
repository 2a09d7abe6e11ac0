r"""Row-blocked attention for relative encodings: no ``[B, H, L, L]`` tensor, no ``L × L × d`` tensor.

A relative encoding whose extra logits depend on the offset ``j - i`` through a table of vectors can
describe itself as a :class:`RelativeForm`:

.. math::
    A_{ij} = s\Big(\tilde q_i \cdot \tilde k_j
        + \sum_{(a, T) \in \text{query terms}} a_i \cdot T_{t(i,j)}
        + \sum_{(c, U) \in \text{key terms}} c_j \cdot U_{t(i,j)}
        + e_{i, [\text{seg}_i \ne \text{seg}_j]}\Big), \qquad
    z_i = \sum_j \operatorname{softmax}_j(A_{ij}) \,\big(v_j + V_{t(i,j)}\big)

with ``t(i, j) = j - i + L_q - 1`` indexing the ``P = L_q + L_k - 1`` offsets of positions made with
``arange`` (every table is given per *offset*, ``[P, H|1, d]``; a clipped or bucketed table is expanded
to its offsets by the encoding, which costs ``P · d``). This covers Shaw (keys and values), NEZHA, BERT
``relative_key`` / ``relative_key_query``, Transformer-XL, XLNet (segments included), TENER and
DeBERTa's c2p + p2c.

:func:`relative_attention` computes ``z`` one block of query rows at a time, flash-attention style: the
block's content scores, its position scores (one ``[b, d] × [d, L_k + b - 1]`` product per query term,
skewed into place through a strided *view*: the block needs only ``L_k + b - 1`` offsets, about half the
``2L - 1`` an unblocked skew multiplies), the softmax, and ``P v`` (plus ``P V`` for a value table,
un-skewed into a ``[b, L_k + b - 1]`` buffer whose gaps stay zero). Only the row log-sum-exp is kept for
the backward, which recomputes each block and forms every gradient by hand. A key term
(``c_j · U_{t(i,j)}``) is one ``[L_k, d] × [d, P]`` product per head whose strided view is the
``[L_q, L_k]`` term. Nothing of size ``L_q · L_k`` outlives one block, so the peak memory is that of
flash attention plus ``O(L·d)``.

The same numbers as the materialised formula (float64: 1e-12; tests/test_fused.py) for every mask,
offset and shape; :class:`~posenc.attention.MultiHeadAttention` uses it on CPU when an encoding returns
a form (fast path, no dropout, not while ``torch.compile`` traces) and keeps its other paths otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

# bytes of one [b, Lk] block of scores (about an L2 cache): sets the block height
BLOCK_BYTES = 2 * 2**20
# key chunk width of a key term, as a fraction of the block height (tiles of c × (c + b - 1) per product)
CHUNK_RATIO = 0.25


@dataclass
class RelativeForm:
    """An encoding's logits in the offset-table form :func:`relative_attention` computes blockwise.

    Attributes:
        q: content query ``q̃`` ``[B, H, Lq, d]`` (Transformer-XL: ``q + u``).
        k: content key ``k̃`` ``[B, H, Lk, d]``.
        query_terms: ``(a [B, H, Lq, d], T [P, H|1, d])`` pairs, each adding ``a_i · T[j - i + Lq - 1]``.
        key_terms: ``(c [B, H, Lk, d], U [P, H|1, d])`` pairs, each adding ``c_j · U[j - i + Lq - 1]``.
        value_table: ``V [P, H|1, d]``: ``z_i`` gains ``Σ_j p_ij V[j - i + Lq - 1]`` (Shaw's ``a^V``).
        segment: ``(e [B, H, Lq, 2], same [B|1, Lq, Lk] bool)``: adds ``e[i, 0]`` where ``same[i, j]``
            else ``e[i, 1]`` (XLNet's relative segment term).
    All terms are *logits*: the attention's temperature multiplies them with ``q̃ · k̃``.
    """

    q: Tensor
    k: Tensor
    query_terms: list[tuple[Tensor, Tensor]] = field(default_factory=list)
    key_terms: list[tuple[Tensor, Tensor]] = field(default_factory=list)
    value_table: Tensor | None = None
    segment: tuple[Tensor, Tensor] | None = None


def _block_rows(lq: int, lk: int, itemsize: int) -> int:
    return max(16, min(lq, BLOCK_BYTES // max(1, lk * itemsize)))


def _heads(table: Tensor) -> Tensor:
    """``[P, H|1, d]`` -> ``[H|1, P, d]`` contiguous."""
    return table.permute(1, 0, 2).contiguous()


class _Plan:
    """Shapes and per-block views shared by the forward and the backward."""

    def __init__(self, q: Tensor, k: Tensor) -> None:
        self.b, self.h, self.lq, self.d = q.shape
        self.lk = k.shape[2]
        self.p = self.lq + self.lk - 1
        self.rows = _block_rows(self.lq, self.lk, q.element_size())
        self.blocks = [(r0, min(self.lq, r0 + self.rows)) for r0 in range(0, self.lq, self.rows)]
        self.chunk = max(16, int(self.rows * CHUNK_RATIO))  # key chunk width of a key term's tiles
        self._bufs: dict[int, Tensor] = {}
        self.dtype, self.device = q.dtype, q.device

    def window(self, r0: int, r1: int) -> tuple[int, int]:
        """Offsets rows ``[s0, s0 + W)`` that query rows ``[r0, r1)`` use, ``W = Lk + b - 1``."""
        return self.lq - r1, self.lk + (r1 - r0) - 1

    @staticmethod
    def skew(raw: Tensor, lk: int) -> Tensor:
        """``[b, W]`` per-offset scores -> the ``[b, Lk]`` view ``out[i, j] = raw[i, j - i + b - 1]``."""
        b, w = raw.shape
        return raw.as_strided((b, lk), (w - 1, 1), raw.storage_offset() + b - 1)

    def buffer(self, key: object, w: int) -> Tensor:
        """A zeroed ``[rows, W]`` buffer per shape; skewed writes never touch its gaps, so they stay 0."""
        buf = self._bufs.get(key)
        if buf is None:
            rows = key if isinstance(key, int) else key[0]  # type: ignore[index]
            buf = torch.zeros(rows, w, dtype=self.dtype, device=self.device)
            self._bufs[key] = buf
        return buf

    def key_tiles(self, r0: int, r1: int) -> list[tuple[int, int, int, int]]:
        """Key chunks ``[j0, j1)`` of a row block and the rows ``[lo, hi)`` of the *reversed* table they use.

        Chunk ``j0 .. j1`` against rows ``r0 .. r1`` needs the offsets ``t = j - i + Lq - 1`` in
        ``[j0 + s0, j0 + s0 + W')`` with ``W' = (j1 - j0) + b - 1``: a band, so a key term costs one
        ``[c, d] × [d, c + b - 1]`` product per tile instead of a ``[Lk, d] × [d, P]`` one per head.
        """
        s0 = self.lq - r1
        out = []
        for j0 in range(0, self.lk, self.chunk):
            j1 = min(self.lk, j0 + self.chunk)
            w = (j1 - j0) + (r1 - r0) - 1
            out.append((j0, j1, self.p - j0 - s0 - w, self.p - j0 - s0))
        return out

    @staticmethod
    def key_tile(raw: Tensor, b: int) -> Tensor:
        """``raw [c, W']`` (``raw[jj, u'] = c_jj · Ur[lo + u']``) -> the ``[b, c]`` view of the tile's key term."""
        c, w = raw.shape
        return raw.as_strided((b, c), (1, w - 1), raw.storage_offset() + c - 1)


class _RelativeAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, meta, q, k, v, allowed, same, e, vt, *terms):  # type: ignore[override]
        scale, nq, nk = meta
        q_ops, q_tabs = terms[:nq], [_heads(t) for t in terms[nq : 2 * nq]]
        k_ops, k_tabs = terms[2 * nq : 2 * nq + nk], [_heads(t).flip(1) for t in terms[2 * nq + nk :]]
        vtab = _heads(vt) if vt is not None else None
        plan = _Plan(q, k)
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:3], dtype=q.dtype, device=q.device)
        for bi in range(plan.b):
            for hi in range(plan.h):
                for r0, r1 in plan.blocks:
                    s = _scores(plan, bi, hi, r0, r1, scale, q, k, allowed, same, e, q_ops, q_tabs, k_ops, k_tabs)
                    m = s.amax(-1, keepdim=True)
                    s.sub_(m).exp_()
                    total = s.sum(-1, keepdim=True)
                    s.div_(total)
                    lse[bi, hi, r0:r1] = (m + total.log()).squeeze(-1)
                    o = out[bi, hi, r0:r1]
                    torch.mm(s, v[bi, hi], out=o)
                    if vtab is not None:
                        s0, w = plan.window(r0, r1)
                        buf = plan.buffer(r1 - r0, w)
                        plan.skew(buf, plan.lk).copy_(s)
                        o.addmm_(buf, vtab[hi if vtab.shape[0] > 1 else 0, s0 : s0 + w])
        ctx.meta = meta
        ctx.save_for_backward(q, k, v, allowed, same, e, vt, out, lse, *terms)
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        scale, nq, nk = ctx.meta
        q, k, v, allowed, same, e, vt, out, lse, *terms = ctx.saved_tensors
        q_ops, q_tabs = terms[:nq], [_heads(t) for t in terms[nq : 2 * nq]]
        k_ops, k_tabs = terms[2 * nq : 2 * nq + nk], [_heads(t).flip(1) for t in terms[2 * nq + nk :]]
        vtab = _heads(vt) if vt is not None else None
        plan = _Plan(q, k)
        dout = dout.contiguous()
        delta = (dout * out).sum(-1)  # rowsum(dO ∘ O), the softmax backward's Δ
        dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        d_qops = [torch.empty_like(a) for a in q_ops]
        d_qtabs = [torch.zeros_like(t) for t in q_tabs]
        d_kops = [torch.zeros_like(c) for c in k_ops]
        d_ktabs = [torch.zeros_like(u) for u in k_tabs]
        dvtab = torch.zeros_like(vtab) if vtab is not None else None
        de = torch.empty_like(e) if e is not None else None
        for bi in range(plan.b):
            for hi in range(plan.h):
                for r0, r1 in plan.blocks:
                    b_rows = r1 - r0
                    s0, w = plan.window(r0, r1)
                    p = _scores(plan, bi, hi, r0, r1, scale, q, k, allowed, same, e, q_ops, q_tabs, k_ops, k_tabs)
                    p.sub_(lse[bi, hi, r0:r1, None]).exp_()
                    do = dout[bi, hi, r0:r1]
                    dv[bi, hi].addmm_(p.t(), do)
                    dp = torch.mm(do, v[bi, hi].t())
                    if vtab is not None and dvtab is not None:
                        vh = 0 if vtab.shape[0] == 1 else hi
                        buf = plan.buffer(b_rows, w)
                        plan.skew(buf, plan.lk).copy_(p)
                        dvtab[vh, s0 : s0 + w].addmm_(buf.t(), do)
                        dp.add_(plan.skew(torch.mm(do, vtab[vh, s0 : s0 + w].t()), plan.lk))
                    dz = dp.sub_(delta[bi, hi, r0:r1, None]).mul_(p).mul_(scale)  # ∂L/∂(unscaled logits)
                    torch.mm(dz, k[bi, hi], out=dq[bi, hi, r0:r1])
                    dk[bi, hi].addmm_(dz.t(), q[bi, hi, r0:r1])
                    if q_ops:
                        buf = plan.buffer(b_rows, w)
                        plan.skew(buf, plan.lk).copy_(dz)
                        for a, t, da, dt in zip(q_ops, q_tabs, d_qops, d_qtabs):
                            th = 0 if t.shape[0] == 1 else hi
                            torch.mm(buf, t[th, s0 : s0 + w], out=da[bi, hi, r0:r1])
                            dt[th, s0 : s0 + w].addmm_(buf.t(), a[bi, hi, r0:r1])
                    for c, u, dc, du in zip(k_ops, k_tabs, d_kops, d_ktabs):
                        uh = 0 if u.shape[0] == 1 else hi
                        for j0, j1, lo, hi_ in plan.key_tiles(r0, r1):
                            buf = plan.buffer((j1 - j0, b_rows), hi_ - lo)
                            plan.key_tile(buf, b_rows).copy_(dz[:, j0:j1])
                            dc[bi, hi, j0:j1].addmm_(buf, u[uh, lo:hi_])
                            du[uh, lo:hi_].addmm_(buf.t(), c[bi, hi, j0:j1])
                    if de is not None:
                        same_rows = same[bi if same.shape[0] > 1 else 0, r0:r1]
                        d_same = (dz * same_rows).sum(-1)
                        de[bi, hi, r0:r1, 0] = d_same
                        de[bi, hi, r0:r1, 1] = dz.sum(-1) - d_same
        grads_terms = (
            list(d_qops)
            + [t.permute(1, 0, 2) for t in d_qtabs]
            + list(d_kops)
            + [u.flip(1).permute(1, 0, 2) for u in d_ktabs]
        )
        dvt = dvtab.permute(1, 0, 2) if dvtab is not None else None
        return (None, dq, dk, dv, None, None, de, dvt, *grads_terms)


def _scores(plan, bi, hi, r0, r1, scale, q, k, allowed, same, e, q_ops, q_tabs, k_ops, k_tabs) -> Tensor:
    """The scaled, masked logits of query rows ``[r0, r1)`` of head ``(bi, hi)``: ``[b, Lk]`` (a new tensor)."""
    s = torch.mm(q[bi, hi, r0:r1], k[bi, hi].t())
    if q_ops:
        s0, w = plan.window(r0, r1)
        for a, t in zip(q_ops, q_tabs):
            raw = torch.mm(a[bi, hi, r0:r1], t[0 if t.shape[0] == 1 else hi, s0 : s0 + w].t())
            s.add_(plan.skew(raw, plan.lk))
    for c, u in zip(k_ops, k_tabs):
        uh = 0 if u.shape[0] == 1 else hi
        for j0, j1, lo, hi_ in plan.key_tiles(r0, r1):
            raw = torch.mm(c[bi, hi, j0:j1], u[uh, lo:hi_].t())  # [c, W'] against the reversed table band
            s[:, j0:j1].add_(plan.key_tile(raw, r1 - r0))
    if e is not None:
        same_rows = same[bi if same.shape[0] > 1 else 0, r0:r1]
        eb = e[bi, hi, r0:r1]
        s.add_(torch.where(same_rows, eb[:, :1], eb[:, 1:]))
    s.mul_(scale)
    if allowed is not None:
        m = allowed[bi if allowed.shape[0] > 1 else 0, hi if allowed.shape[1] > 1 else 0]
        m = m[r0:r1] if m.shape[0] > 1 else m  # a key-padding mask is [.., 1, Lk]
        s.masked_fill_(~m, torch.finfo(s.dtype).min)
    return s


def relative_attention(form: RelativeForm, v: Tensor, scale: float, allowed: Tensor | None = None) -> Tensor:
    """``softmax(scale · logits(form) + mask) (v + V)``: ``[B, H, Lq, d]``, computed blockwise (see the module).

    ``allowed``: a boolean ``[B|1, H|1, Lq|1, Lk]`` mask (``True`` = may attend) or ``None``.
    """
    q, k = form.q, form.k
    b, h, lq, d = q.shape
    lk = k.shape[2]
    p = lq + lk - 1
    if k.shape != (b, h, lk, d) or v.shape[:3] != (b, h, lk) or v.shape[-1] != d:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} do not match")
    for what, pairs, length in (("query", form.query_terms, lq), ("key", form.key_terms, lk)):
        for op, table in pairs:
            if op.shape != (b, h, length, d) or table.dim() != 3 or table.shape[0] != p or table.shape[2] != d:
                raise ValueError(
                    f"a {what} term needs an operand [{b}, {h}, {length}, {d}] and a table [{p}, {h}|1, {d}], got "
                    f"{tuple(op.shape)} and {tuple(table.shape)}"
                )
    vt = form.value_table
    if vt is not None and (vt.dim() != 3 or vt.shape[0] != p or vt.shape[2] != d):
        raise ValueError(f"the value table must be [{p}, {h}|1, {d}], got {tuple(vt.shape)}")
    same, e = (None, None) if form.segment is None else (form.segment[1], form.segment[0])
    if allowed is not None and allowed.dim() != 4:
        raise ValueError(f"allowed must be [B|1, H|1, Lq|1, Lk], got {tuple(allowed.shape)}")

    def c(x: Tensor) -> Tensor:
        return x.contiguous()

    tensors = [c(a) for a, _ in form.query_terms] + [t for _, t in form.query_terms]
    tensors += [c(x) for x, _ in form.key_terms] + [u for _, u in form.key_terms]
    meta = (float(scale), len(form.query_terms), len(form.key_terms))
    return _RelativeAttention.apply(meta, c(q), c(k), c(v), allowed, same, None if e is None else c(e), vt, *tensors)


__all__ = ["RelativeForm", "relative_attention", "BLOCK_BYTES", "CHUNK_RATIO"]
