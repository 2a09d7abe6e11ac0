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

:func:`relative_attention` computes ``z`` one block of query rows of one sequence at a time, all heads together
(``[H, b, L_k]`` scores, batched products; a table shared by the heads is broadcast), flash-attention style: the
block's content scores, its position scores (one ``[b, d] × [d, L_k + b - 1]`` product per head and query term,
skewed into place through a strided *view*: the block needs only ``L_k + b - 1`` offsets, about half the
``2L - 1`` an unblocked skew multiplies), the softmax, and ``P v`` (plus ``P V`` for a value table,
un-skewed into a ``[b, L_k + b - 1]`` buffer with zeroed gaps). A key term (``c_j · U_{t(i,j)}``) is
computed in ``[c, d] × [d, c + b - 1]`` tiles, each a band of the reversed table seen through a strided view.
No ``L × L × d`` tensor is ever made. Causal, a block's products stop at the diagonal's offset (the ``b - 1``
offsets past it reach only masked pairs). A compact table (:class:`Rows`) whose index starts or ends in a long run
of one row (a clip, DeBERTa's last bucket) costs one number per query (or key) where a whole block sits in the run.

The backward forms every gradient by hand; it reuses the probabilities the forward kept within a budget per call
(``SAVE_RATIO`` × the bytes of ``q``, or ``SAVE_BYTES``: ``O(L·d)``, like the model's activations; keeping every
block took the benchmark model at L = 2048 to 1.9-2.05× the memory of ``none``) and recomputes the other blocks.

The same numbers as the materialised formula (float64: 1e-12; tests/test_fused.py) for every mask, offset and shape.
While ``torch.compile`` traces, the kernel is one custom op, ``posenc::relative_attention`` (and its ``_backward``),
kept by the compiled graph for every length; that forward keeps no probabilities.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Union

import torch
from torch import Tensor

# bytes of one head's [b, Lk] block of scores (about an L2 cache) and at most BLOCK_ROWS rows: set the block height
# (the heads of a block go together, [H, b, Lk]; 128 rows keep the products and the key tiles large enough)
BLOCK_BYTES = 2 * 2**20
BLOCK_ROWS = 128
# key chunk width of a key term, as a fraction of the block height (tiles of c × (c + b - 1) per product)
CHUNK_RATIO = 0.5
# the budget of kept probabilities per call: SAVE_BYTES, or where None, SAVE_RATIO × the bytes of q (O(L·d))
SAVE_BYTES: int | None = None
SAVE_RATIO = 4.0
# a compact table's leading / trailing run of one row at least this long is added by broadcasting (see _Table)
MIN_RUN = 16


class Rows(NamedTuple):
    """A table given by its distinct rows: offset ``t`` uses ``table[index[t]]`` (``index``: ``[P]``).

    A clipped table (Shaw, NEZHA: ``2k + 1`` rows) or a bucketed one (DeBERTa: ``2k`` rows) is far smaller than
    its ``P = Lq + Lk - 1`` offsets: the kernel then multiplies by the ``R`` rows once and gathers the offsets'
    scores, and sums the gradient of the offsets that share a row.
    """

    table: Tensor  # [R, H|1, d]
    index: Tensor  # [P] long


Table = Union[Tensor, Rows]  # noqa: UP007 (a runtime alias)


@dataclass
class RelativeForm:
    """An encoding's logits in the offset-table form :func:`relative_attention` computes blockwise.

    Attributes:
        q: content query ``q̃`` ``[B, H, Lq, d]`` (Transformer-XL: ``q + u``).
        k: content key ``k̃`` ``[B, H, Lk, d]``.
        query_terms: ``(a [B, H, Lq, d], T)`` pairs, each adding ``a_i · T[j - i + Lq - 1]``.
        key_terms: ``(c [B, H, Lk, d], U)`` pairs, each adding ``c_j · U[j - i + Lq - 1]``.
        value_table: ``V``: ``z_i`` gains ``Σ_j p_ij V[j - i + Lq - 1]`` (Shaw's ``a^V``).
        segment: ``(e [B, H, Lq, 2], same [B|1, Lq, Lk] bool)``: adds ``e[i, 0]`` where ``same[i, j]``
            else ``e[i, 1]`` (XLNet's relative segment term).
    Every table is ``[P, H|1, d]`` over the ``P = Lq + Lk - 1`` offsets, or :class:`Rows`. All terms are
    *logits*: the attention's temperature multiplies them with ``q̃ · k̃``.
    """

    q: Tensor
    k: Tensor
    query_terms: list[tuple[Tensor, Table]] = field(default_factory=list)
    key_terms: list[tuple[Tensor, Table]] = field(default_factory=list)
    value_table: Table | None = None
    segment: tuple[Tensor, Tensor] | None = None


def _block_rows(lq: int, lk: int, itemsize: int) -> int:
    return max(16, min(lq, BLOCK_ROWS, BLOCK_BYTES // max(1, lk * itemsize)))


class _Table:
    """One table of a term, all heads at once, in its expanded (``[H|1, P, d]``) or compact (``[H|1, R, d]`` + index)
    form; a shared table (``[1, ...]``) meets the ``H`` heads by broadcasting (:func:`_bmm`, :func:`_acc`).

    ``reverse``: reversed offset order (key terms read their bands backwards, ``key_tile``). A compact table whose
    index starts or ends with a long run of one row (a clip; DeBERTa's last bucket) adds, where a whole block is in
    the run, one number per query (or key) by broadcasting, not through a skewed buffer."""

    def __init__(self, table: Tensor, index: Tensor | None, reverse: bool) -> None:
        # compact with R > P/2 rows (the compiled op's input: offset_table keeps one form for every length): expanded,
        # as offset_table does eagerly (a key term's per-row gradient [H, R, Lk] would be O(L²)); see table_grad()
        self.given: tuple[Tensor, int] | None = None
        if index is not None and 2 * table.shape[0] > index.shape[0]:
            self.given = (index, table.shape[0])
            table, index = table.index_select(0, index), None
        self.reverse = reverse
        t = table.permute(1, 0, 2).contiguous()
        self.t = t.flip(1) if reverse and index is None else t
        self.idx = index if not reverse or index is None else index.flip(0)
        self._grad: Tensor | None = None
        # offsets [0, lead) use row lead_row, [trail, P) row trail_row (runs shorter than MIN_RUN left out)
        self.lead, self.lead_row, self.trail, self.trail_row = (0, 0, 0, 0) if index is None else _end_runs(self.idx)

    def band(self, lo: int, hi: int) -> Tensor:
        """The table at offsets ``[lo, hi)``: ``[H|1, hi - lo, d]`` (a view, or the compact rows gathered)."""
        return self.t[:, lo:hi] if self.idx is None else self.t.index_select(1, self.idx[lo:hi])

    @property
    def grad(self) -> Tensor:
        if self._grad is None:  # allocated on first use (the backward only)
            self._grad = torch.zeros_like(self.t)
        return self._grad

    def table_grad(self) -> Tensor:
        """The table's gradient in the layout it was given, ``[P|R, H|1, d]`` (an expanded compact table's summed),
        contiguous however it was made, as the op's fake kernel (:func:`_table_grad`) promises (a permuted view
        failed Inductor's stride check: compiled DeBERTa). The copy is of a table, ``R × H × d``."""
        g = (self.grad.flip(1) if self.reverse and self.idx is None else self.grad).permute(1, 0, 2)
        if self.given is not None:
            return g.new_zeros(self.given[1], *g.shape[1:]).index_add_(0, self.given[0], g)
        return g.contiguous()

    def cols(self, plan: _Plan, r0: int, r1: int, ke: int) -> tuple[int, int]:
        """A query term's key columns ``[jl, jr)`` of rows ``[r0, r1)`` that need the skewed product: every query of
        the block has the offsets of keys ``[0, jl)`` in the leading run, and of keys ``[jr, ke)`` in the trailing
        one (``t = j - i + Lq - 1``)."""
        if self.idx is None:
            return 0, ke
        jl = min(max(self.lead + r0 - plan.lq + 1, 0), ke)
        return jl, min(max(self.trail + r1 - plan.lq, jl), ke)

    def key_cols(self, plan: _Plan, r0: int, r1: int, ke: int) -> tuple[int, int]:
        """A key term's (reversed table, ``t' = Lk - 1 - j + i``) keys ``[k0, k1)`` that need tiles: keys
        ``[0, k0)`` are in the trailing run for every query of the block, keys ``[k1, ke)`` in the leading one."""
        if self.idx is None:
            return 0, ke
        k0 = min(max(plan.lk + r0 - self.trail, 0), ke)
        return k0, min(max(plan.lk + r1 - 1 - self.lead, k0), ke)

    def add_scores(self, s: Tensor, x: Tensor, r0: int, r1: int, plan: _Plan) -> None:
        """``s[h, u, j] += x[h, u] · table[h, j - (r0 + u) + Lq - 1]`` for the block's ``[H, b, ke]`` scores."""
        ke = s.shape[2]
        jl, jr = self.cols(plan, r0, r1, ke)
        lo, hi = jl - r1 + plan.lq, jr - r0 + plan.lq - 1
        if self.idx is None:
            end = plan.cut(lo, hi)
            raw = plan.scratch("raw", (x.shape[0], x.shape[1], hi - lo))
            raw[:, :, end - lo :].zero_()  # causal: the columns past ``end`` only reach pairs the mask drops
            _bmm(x, self.t[:, lo:end].transpose(1, 2), out=raw[:, :, : end - lo])
        else:
            if jl or jr < ke:
                rows = _bmm(x, self.t[:, [self.lead_row, self.trail_row]].mT)  # [H, b, 2]
                s[:, :, :jl].add_(rows[:, :, :1])
                s[:, :, jr:].add_(rows[:, :, 1:])
            if jr == jl:
                return
            # the band of rows gathered (W·d copies), not the scores (b·W gathered numbers)
            raw = _bmm(x, self.band(lo, hi).mT, out=plan.scratch("raw", (*x.shape[:2], hi - lo)))
        s[:, :, jl:jr].add_(plan.skew(raw, jr - jl))

    def _skewed(self, g: Tensor, r0: int, r1: int, plan: _Plan, jl: int, jr: int) -> tuple[Tensor, int, int]:
        """``g [H, b, ke]``'s columns ``[jl, jr)`` written per offset into a zero-gapped buffer: ``(buf, lo, hi)``, the
        buffer's columns cut to the offsets ``[lo, hi)`` that pairs the causal mask keeps may use (``g`` is zero on
        the others: a probability, or a gradient through one)."""
        lo, hi = jl - r1 + plan.lq, jr - r0 + plan.lq - 1
        buf = plan.scratch("skew", (g.shape[0], g.shape[1], hi - lo))
        buf[:, :, : g.shape[1] - 1].zero_()  # the gaps: row u leaves columns [0, b - 1 - u) and past b - 1 - u + W
        buf[:, :, jr - jl :].zero_()
        plan.skew(buf, jr - jl).copy_(g[:, :, jl:jr])
        end = plan.cut(lo, hi)
        return buf[:, :, : end - lo], lo, end

    def bucket(self, g: Tensor, r0: int, r1: int, plan: _Plan) -> Tensor:
        """Compact form: the block's ``[H, b, ke]`` per-pair ``g`` summed per row of the table: ``[H, R, b]``."""
        ke = g.shape[2]
        jl, jr = self.cols(plan, r0, r1, ke)
        out = g.new_zeros(g.shape[0], self.t.shape[1], g.shape[1])
        if jr > jl:
            buf, lo, hi = self._skewed(g, r0, r1, plan, jl, jr)
            out.index_add_(1, self.idx[lo:hi], buf.transpose(1, 2).contiguous())
        if jl:
            out[:, self.lead_row].add_(g[:, :, :jl].sum(2))
        if jr < ke:
            out[:, self.trail_row].add_(g[:, :, jr:].sum(2))
        return out

    def query_grad(self, g: Tensor, x: Tensor, r0: int, r1: int, plan: _Plan, dx: Tensor) -> None:
        """Given ``g = ∂L/∂s`` of :meth:`add_scores`: write ``∂L/∂x`` into ``dx`` and add to the table's gradient."""
        if self.idx is None:
            buf, lo, hi = self._skewed(g, r0, r1, plan, 0, g.shape[2])
            _bmm(buf, self.t[:, lo:hi], out=dx)
            _acc(self.grad[:, lo:hi], buf.transpose(1, 2), x)
        else:
            gr = self.bucket(g, r0, r1, plan)  # [H, R, b]
            _bmm(gr.transpose(1, 2), self.t, out=dx)
            _acc(self.grad, gr, x)

    def values(self, p: Tensor, r0: int, r1: int, plan: _Plan) -> Tensor:
        """``Σ_j p[h, u, j] · table[h, j - (r0 + u) + Lq - 1]`` for the block's ``[H, b, ke]`` ``p``: ``[H, b, d]``."""
        if self.idx is None:
            buf, lo, hi = self._skewed(p, r0, r1, plan, 0, p.shape[2])
            return _bmm(buf, self.t[:, lo:hi])
        return _bmm(self.bucket(p, r0, r1, plan).transpose(1, 2), self.t)

    def value_grad(self, p: Tensor, do: Tensor, r0: int, r1: int, plan: _Plan, dp: Tensor) -> None:
        """Add ``∂L/∂table`` of :meth:`values` to the table's gradient and its ``∂L/∂p`` to ``dp``."""
        if self.idx is None:
            buf, lo, hi = self._skewed(p, r0, r1, plan, 0, p.shape[2])
            _acc(self.grad[:, lo:hi], buf.transpose(1, 2), do)
        else:
            _acc(self.grad, self.bucket(p, r0, r1, plan), do)
        self.add_scores(dp, do, r0, r1, plan)


def _bmm(x: Tensor, y: Tensor, out: Tensor | None = None) -> Tensor:
    """``x [H, n, m] @ y [H|1, m, p]``: a shared ``y`` broadcast to the heads (a stride-0 batch, no copy)."""
    return torch.bmm(x, y.expand(x.shape[0], -1, -1), out=out)


def _acc(dst: Tensor, x: Tensor, y: Tensor) -> None:
    """``dst [H|1, n, p] += x [H, n, m] @ y [H, m, p]``, summed over the heads where ``dst`` is shared (one mm)."""
    h, n, m = x.shape
    if dst.shape[0] == h:
        dst.baddbmm_(x, y)
    else:
        dst[0].addmm_(x.permute(1, 0, 2).reshape(n, h * m), y.reshape(h * m, -1))


def _end_runs(idx: Tensor) -> tuple[int, int, int, int]:
    """``(a, first, z, last)``: ``idx[:a]`` all equal ``first``, ``idx[z:]`` all equal ``last`` (``a <= z``); a run
    shorter than :data:`MIN_RUN` counts as none (``a = 0`` / ``z = P``)."""
    p = idx.shape[0]
    first, last = int(idx[0]), int(idx[-1])
    a = _run_length(idx, first)
    z = p - _run_length(idx.flip(0), last)
    a = a if a >= MIN_RUN else 0
    z = z if p - z >= MIN_RUN else p
    return a, first, max(z, a), last


def _run_length(idx: Tensor, value: int) -> int:
    other = idx != value
    return int(other.to(torch.uint8).argmax()) if bool(other.any()) else idx.shape[0]


class _Plan:
    """Shapes and per-block views shared by the forward and the backward."""

    def __init__(self, q: Tensor, k: Tensor, causal: bool = False) -> None:
        self.b, self.h, self.lq, self.d = q.shape
        self.lk = k.shape[2]
        self.causal = causal
        self.p = self.lq + self.lk - 1
        self.rows = _block_rows(self.lq, self.lk, q.element_size())
        self.chunk = max(16, int(self.rows * CHUNK_RATIO))  # key chunk width of a key term's tiles
        self.blocks = [(r0, min(self.lq, r0 + self.rows)) for r0 in range(0, self.lq, self.rows)]
        self._bufs: dict[tuple, Tensor] = {}
        self._flat: dict[str, Tensor] = {}
        self.dtype, self.device = q.dtype, q.device

    def kend(self, r1: int) -> int:
        """The keys ``[0, kend)`` that query rows ``[.., r1)`` may see: all, or up to the causal diagonal
        (bottom-right aligned: query ``i`` sees ``j <= i + Lk - Lq``), so a causal block skips the keys it cannot see.
        """
        return min(self.lk, r1 + self.lk - self.lq) if self.causal else self.lk

    @staticmethod
    def skew(raw: Tensor, lk: int) -> Tensor:
        """``[H, b, W]`` per-offset scores -> the ``[H, b, Lk]`` view ``out[h, i, j] = raw[h, i, j - i + b - 1]``."""
        h, b, w = raw.shape
        return raw.as_strided((h, b, lk), (raw.stride(0), w - 1, 1), raw.storage_offset() + b - 1)

    def upper(self, n: int) -> Tensor:
        """``[n, n]``, ``True`` above the diagonal (reused per size)."""
        m = self._bufs.get(("upper", n))
        if m is None:
            m = torch.ones(n, n, dtype=torch.bool, device=self.device).triu_(1)
            self._bufs[("upper", n)] = m
        return m

    def scratch(self, tag: str, shape: tuple[int, ...]) -> Tensor:
        """An uninitialised tensor of ``shape`` on one storage per ``tag``, reused block after block: a new tensor
        of a block's size (MBs) would be mapped and page-faulted afresh each time (about as long as its product)."""
        n = math.prod(shape)
        buf = self._flat.get(tag)
        if buf is None or buf.numel() < n:
            buf = torch.empty(max(n, self.h * self.rows * (self.lk + self.rows)), dtype=self.dtype, device=self.device)
            self._flat[tag] = buf
        return buf[:n].view(shape)

    def buffer(self, shape: tuple[int, int, int], tag: str = "") -> Tensor:
        """A zeroed ``[H, rows, W]`` buffer per shape (and ``tag``), reused: every skewed write (query rows or a key
        tile) of one shape touches the same positions, so the gaps stay zero."""
        buf = self._bufs.get((*shape, tag))
        if buf is None:
            buf = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self._bufs[(*shape, tag)] = buf
        return buf

    def cut(self, lo: int, hi: int) -> int:
        """The end of the offsets ``[lo, hi)`` some pair may use: causal, no offset past ``Lk - 1`` (a block's window
        reaches ``b - 1`` further, for the pairs above the diagonal only)."""
        return max(lo, min(hi, self.lk)) if self.causal else hi

    def key_tiles(self, r0: int, r1: int, k0: int, k1: int) -> list[tuple[int, int, int, int]]:
        """Key chunks ``[j0, j1)`` of the keys ``[k0, k1)`` of a row block and the rows ``[lo, hi)`` of the *reversed*
        table they use.

        Chunk ``j0 .. j1`` against rows ``r0 .. r1`` needs the offsets ``t = j - i + Lq - 1`` in
        ``[j0 + s0, j0 + s0 + W')`` with ``W' = (j1 - j0) + b - 1``: a band, so a key term costs one
        ``[c, d] × [d, c + b - 1]`` product per tile instead of a ``[Lk, d] × [d, P]`` one per head.
        """
        s0 = self.lq - r1
        out = []
        for j0 in range(k0, k1, self.chunk):
            j1 = min(k1, j0 + self.chunk)
            w = (j1 - j0) + (r1 - r0) - 1
            out.append((j0, j1, self.p - j0 - s0 - w, self.p - j0 - s0))
        return out

    @staticmethod
    def key_tile(raw: Tensor, b: int) -> Tensor:
        """``raw [H, c, W']`` (``raw[h, jj, u'] = c_jj · Ur[lo + u']``) -> the ``[H, b, c]`` view of its key term."""
        h, c, w = raw.shape
        return raw.as_strided((h, b, c), (raw.stride(0), 1, w - 1), raw.storage_offset() + c - 1)


class _Work:
    """Everything one call needs, rebuilt from the saved inputs in the backward. Its methods work on one sequence
    ``bi`` and one block of query rows ``[r0, r1)``, all heads at once (``[H, b, kend]`` scores)."""

    def __init__(self, meta, q, k, v, allowed, same, e, bias, vt, vt_idx, terms) -> None:
        self.scale, nq, nk, self.p_drop, self.seed, causal = meta
        self.q, self.k, self.v, self.allowed, self.same, self.e = q, k, v, allowed, same, e
        self.bias = bias
        ops, tabs, idxs = terms[: nq + nk], terms[nq + nk : 2 * (nq + nk)], terms[2 * (nq + nk) :]
        self.q_ops, self.k_ops = ops[:nq], ops[nq:]
        self.q_tabs = [_Table(t, i, False) for t, i in zip(tabs[:nq], idxs[:nq])]
        self.k_tabs = [_Table(t, i, True) for t, i in zip(tabs[nq:], idxs[nq:])]
        self.vtab = _Table(vt, vt_idx, False) if vt is not None else None
        self.plan = _Plan(q, k, causal)

    def key_rows(self, bi: int) -> list[Tensor | None]:
        """Per key term, ``c · rows`` of a compact table's trailing and leading run rows (``[H, Lk, 2]``), else None."""
        runs = [None if u.idx is None else u.t[:, [u.trail_row, u.lead_row]] for u in self.k_tabs]
        return [None if r is None else _bmm(c[bi], r.mT) for c, r in zip(self.k_ops, runs)]

    def scores(self, bi: int, r0: int, r1: int, key_rows: list[Tensor | None], out: Tensor | None) -> Tensor:
        """The scaled, masked logits of query rows ``[r0, r1)`` of sequence ``bi`` against the keys they may see,
        ``[0, kend)``: ``[H, b, kend]``, in ``out`` (or a new tensor)."""
        plan = self.plan
        ke, b = plan.kend(r1), r1 - r0
        s = torch.bmm(self.q[bi, :, r0:r1], self.k[bi, :, :ke].transpose(1, 2), out=out)
        for a, t in zip(self.q_ops, self.q_tabs):
            t.add_scores(s, a[bi, :, r0:r1], r0, r1, plan)
        for c, u, rows in zip(self.k_ops, self.k_tabs, key_rows):
            k0, k1 = u.key_cols(plan, r0, r1, ke)
            if rows is not None:  # keys in a run of one row: one number per key
                if k0:
                    s[:, :, :k0].add_(rows[:, None, :k0, 0])
                if k1 < ke:
                    s[:, :, k1:].add_(rows[:, None, k1:ke, 1])
            for j0, j1, lo, hi in plan.key_tiles(r0, r1, k0, k1):  # [H, c, W'] against the reversed table's band
                raw = _bmm(c[bi, :, j0:j1], u.band(lo, hi).mT)
                s[:, :, j0:j1].add_(plan.key_tile(raw, b))
        if self.e is not None:
            same_rows = self.same[bi if self.same.shape[0] > 1 else 0, r0:r1, :ke]
            eb = self.e[bi, :, r0:r1]
            s.add_(torch.where(same_rows, eb[..., :1], eb[..., 1:]))
        s.mul_(self.scale)
        if self.bias is not None:
            bb = self.bias[bi if self.bias.shape[0] > 1 else 0]
            s.add_(bb[:, r0:r1, :ke] if bb.shape[1] > 1 else bb[:, :, :ke])
        blocked = self.blocked(bi, r0, r1)
        if blocked is not None:
            s.masked_fill_(blocked, torch.finfo(s.dtype).min)
        if plan.causal:  # the block's diagonal square: query r0 + u sees keys up to r0 + u + Lk - Lq
            s[:, :, r0 + plan.lk - plan.lq :].masked_fill_(plan.upper(b), torch.finfo(s.dtype).min)
        return s

    def keeps(self, bi: int, r0: int, r1: int) -> Tensor | None:
        """The dropout masks of all heads (:meth:`keep`) for query rows ``[r0, r1)``: ``[H, b, kend]``."""
        if not self.p_drop:
            return None
        out = self.plan.scratch("keep", (self.plan.h, r1 - r0, self.plan.kend(r1)))
        return torch.stack([self.keep(bi, hi, r0, r1) for hi in range(self.plan.h)], out=out)

    def keep(self, bi: int, hi: int, r0: int, r1: int) -> Tensor:
        """Attention dropout of query rows ``[r0, r1)`` of a head: ``1/(1 - p)`` where kept, 0 where dropped; drawn
        from a generator seeded by the call's seed and the block, so the backward draws it again instead of keeping
        it (no ``[B, H, Lq, Lk]`` mask is ever held)."""
        plan = self.plan
        g = torch.Generator(device=self.q.device)
        g.manual_seed((self.seed + (bi * plan.h + hi) * plan.lq + r0) % (1 << 63))
        mask = torch.empty(r1 - r0, plan.kend(r1), dtype=self.q.dtype, device=self.q.device)
        return mask.bernoulli_(1.0 - self.p_drop, generator=g).div_(1.0 - self.p_drop)

    def blocked(self, bi: int, r0: int, r1: int) -> Tensor | None:
        """``True`` where query ``r0 .. r1`` may not see a key: ``[H|1, b|1, kend]``, or ``None`` without a mask."""
        if self.allowed is None:
            return None
        m = self.allowed[bi if self.allowed.shape[0] > 1 else 0]
        ke = self.plan.kend(r1)
        return ~(m[:, r0:r1, :ke] if m.shape[1] > 1 else m[:, :, :ke])  # a key-padding mask is [.., 1, Lk]


def _softmax_(s: Tensor) -> Tensor:
    """``softmax(s, -1)`` in place (the CPU kernel reads each row before it writes it): no new block of MBs."""
    return torch.ops.aten._softmax.out(s, -1, False, out=s)


def _attend(w_: _Work, budget: int) -> tuple[Tensor, list[Tensor | None]]:
    """The forward of one call: ``out`` and the probabilities of each sequence and block of rows (all heads), kept in
    order while their bytes fit in ``budget`` (``None`` for a block past it; an empty list where none is kept)."""
    v = w_.v
    plan = w_.plan
    out = torch.empty_like(w_.q)
    # one tensor per sequence and block of rows rather than one [B, H, Lq, Lk]: the allocator reuses such pieces
    # between steps, where one large block would be mapped (and page-faulted) afresh every time
    probs: list[Tensor | None] = []
    kept = 0
    for bi in range(plan.b):
        key_rows = w_.key_rows(bi)
        for r0, r1 in plan.blocks:
            ke = plan.kend(r1)
            # softmax, not exp(s - max): its exp is ~10x faster where scores underflow (masked keys, far ALiBi terms)
            keep_p = kept + (size := plan.h * (r1 - r0) * ke * v.element_size()) <= budget
            kept += size if keep_p else 0
            s = _softmax_(w_.scores(bi, r0, r1, key_rows, None if keep_p else plan.scratch("s", (plan.h, r1 - r0, ke))))
            probs.append(s if keep_p else None)
            keep_ = w_.keeps(bi, r0, r1)
            if keep_ is not None:  # dropout acts on the probabilities that weigh the values
                s = keep_.mul_(s)
            o = out[bi, :, r0:r1]
            torch.bmm(s, v[bi, :, :ke], out=o)
            if w_.vtab is not None:
                o.add_(w_.vtab.values(s, r0, r1, plan))
    return out, probs if kept else []


def _attend_backward(w_: _Work, dout: Tensor, out: Tensor, probs: Sequence[Tensor | None], want_dbias: bool) -> tuple:
    """The backward of one call (the probabilities read from ``probs``, recomputed where it has none):
    ``dq, dk, dv, de, dbias, dvt`` (``None`` where the input is) and the lists of the terms' operand and table
    gradients."""
    q, k, v, e, bias, same = w_.q, w_.k, w_.v, w_.e, w_.bias, w_.same
    plan, scale = w_.plan, w_.scale
    dout = dout.contiguous()
    delta = (dout * out).sum(-1)  # rowsum(dO ∘ O), the softmax backward's Δ
    dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
    d_qops = [torch.empty_like(a) for a in w_.q_ops]
    d_kops = [torch.zeros_like(c) for c in w_.k_ops]
    de = torch.empty_like(e) if e is not None else None
    dbias = torch.zeros_like(bias) if want_dbias else None
    n_blocks = len(plan.blocks)
    for bi in range(plan.b):
        key_rows = None  # made on the sequence's first block to recompute
        # compact key terms: the gradient of c · rows, transposed ([H, R, Lk]: row adds are contiguous)
        d_rows = [None if u.idx is None else q.new_zeros(plan.h, u.t.shape[1], plan.lk) for u in w_.k_tabs]
        for blk, (r0, r1) in enumerate(plan.blocks):
            b_rows = r1 - r0
            ke = plan.kend(r1)
            p = probs[bi * n_blocks + blk] if probs else None
            if p is None:
                key_rows = w_.key_rows(bi) if key_rows is None else key_rows
                p = _softmax_(w_.scores(bi, r0, r1, key_rows, plan.scratch("s", (plan.h, b_rows, ke))))
            do = dout[bi, :, r0:r1]
            keep_ = w_.keeps(bi, r0, r1)  # the forward's dropout mask, drawn again
            pd = p if keep_ is None else torch.mul(keep_, p, out=plan.scratch("pd", p.shape))  # what weighed v
            dv[bi, :, :ke].baddbmm_(pd.transpose(1, 2), do)
            dp = torch.bmm(do, v[bi, :, :ke].transpose(1, 2), out=plan.scratch("dp", (plan.h, b_rows, ke)))
            if w_.vtab is not None:
                w_.vtab.value_grad(pd, do, r0, r1, plan, dp)
            if keep_ is not None:
                dp.mul_(keep_)  # ∂L/∂p through the mask; Δ = rowsum(dO ∘ O) holds with dropout too
            ds = dp.sub_(delta[bi, :, r0:r1, None]).mul_(p)  # ∂L/∂(scaled logits) = ∂L/∂bias
            blocked = w_.blocked(bi, r0, r1)
            if blocked is not None:  # a query that sees no key has uniform p, but no gradient (past the diagonal too)
                ds.masked_fill_(blocked, 0.0)
                if plan.causal:
                    ds[:, :, r0 + plan.lk - plan.lq :].masked_fill_(plan.upper(b_rows), 0.0)
            if dbias is not None:
                bb = dbias[bi if dbias.shape[0] > 1 else 0]
                g = ds.sum(0, keepdim=True) if bb.shape[0] == 1 else ds
                if bb.shape[1] > 1:
                    bb[:, r0:r1, :ke].add_(g)
                else:
                    bb[:, :, :ke].add_(g.sum(1, keepdim=True))
            dz = ds.mul_(scale)  # ∂L/∂(unscaled logits)
            torch.bmm(dz, k[bi, :, :ke], out=dq[bi, :, r0:r1])
            dk[bi, :, :ke].baddbmm_(dz.transpose(1, 2), q[bi, :, r0:r1])
            for a, t, da in zip(w_.q_ops, w_.q_tabs, d_qops):
                t.query_grad(dz, a[bi, :, r0:r1], r0, r1, plan, da[bi, :, r0:r1])
            for c, u, dc, dr in zip(w_.k_ops, w_.k_tabs, d_kops, d_rows):
                k0, k1 = u.key_cols(plan, r0, r1, ke)
                if dr is not None:  # keys in a run of one row (see scores)
                    if k0:
                        dr[:, u.trail_row, :k0].add_(dz[:, :, :k0].sum(1))
                    if k1 < ke:
                        dr[:, u.lead_row, k1:ke].add_(dz[:, :, k1:ke].sum(1))
                # the tiles' dzᵀ once (a blocked transpose): each tile below then copies whole rows, not columns
                dzt = plan.scratch("dzt", (plan.h, k1 - k0, b_rows))
                dzt.copy_(dz[:, :, k0:k1].transpose(1, 2))
                for j0, j1, lo, hi in plan.key_tiles(r0, r1, k0, k1):
                    buf = plan.buffer((plan.h, j1 - j0, hi - lo))
                    plan.key_tile(buf, b_rows).transpose(1, 2).copy_(dzt[:, j0 - k0 : j1 - k0])
                    if dr is None:
                        dc[bi, :, j0:j1].add_(_bmm(buf, u.t[:, lo:hi]))  # (baddbmm_ into a view: a loop of mm)
                        _acc(u.grad[:, lo:hi], buf.transpose(1, 2), c[bi, :, j0:j1])
                    else:
                        dr[:, :, j0:j1].index_add_(1, u.idx[lo:hi], buf.transpose(1, 2).contiguous())
            if de is not None:
                same_rows = same[bi if same.shape[0] > 1 else 0, r0:r1, :ke]
                d_same = (dz * same_rows).sum(-1)
                de[bi, :, r0:r1, 0] = d_same
                de[bi, :, r0:r1, 1] = dz.sum(-1) - d_same
        for c, u, dc, dr in zip(w_.k_ops, w_.k_tabs, d_kops, d_rows):
            if dr is not None:
                dc[bi].baddbmm_(dr.transpose(1, 2), u.t.expand(plan.h, -1, -1))
                _acc(u.grad, dr, c[bi])
    d_tabs = [t.table_grad() for t in (*w_.q_tabs, *w_.k_tabs)]
    dvt = w_.vtab.table_grad() if w_.vtab is not None else None
    return dq, dk, dv, de, dbias, dvt, d_qops + d_kops, d_tabs


class _RelativeAttention(torch.autograd.Function):
    """The eager entry: keeps blocks' probabilities for the backward while they fit in the budget (``SAVE_BYTES``,
    ``SAVE_RATIO``)."""

    @staticmethod
    def forward(ctx, meta, q, k, v, allowed, same, e, bias, vt, vt_idx, *terms):  # type: ignore[override]
        w_ = _Work(meta, q, k, v, allowed, same, e, bias, vt, vt_idx, terms)
        budget = SAVE_BYTES if SAVE_BYTES is not None else int(SAVE_RATIO * q.numel() * q.element_size())
        out, probs = _attend(w_, budget)
        ctx.meta = meta
        ctx.n_probs = len(probs)
        ctx.save_for_backward(q, k, v, allowed, same, e, bias, vt, vt_idx, out, *probs, *terms)
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, allowed, same, e, bias, vt, vt_idx, out, *rest = ctx.saved_tensors
        probs, terms = rest[: ctx.n_probs], rest[ctx.n_probs :]
        w_ = _Work(ctx.meta, q, k, v, allowed, same, e, bias, vt, vt_idx, terms)
        grads = _attend_backward(w_, dout, out, probs, bias is not None and ctx.needs_input_grad[7])
        dq, dk, dv, de, dbias, dvt, d_ops, d_tabs = grads
        tabs = terms[len(d_ops) : 2 * len(d_ops)]
        assert all(g.shape == t.shape for g, t in zip(d_tabs, tabs)), "table gradient layout"
        return (None, dq, dk, dv, None, None, de, dbias, dvt, None, *d_ops, *d_tabs, *([None] * len(d_ops)))


# ---------------------------------------------------------------- the custom ops (what torch.compile keeps)
# The terms travel as lists of tensors and the form's shape as numbers: ``nq`` query terms, then key terms. The
# compiled forward keeps no probabilities (their number of pieces would follow the length): its backward recomputes
# them, flash-attention style. The seed of the dropout masks is a tensor, drawn in the graph.
_ARGS = (
    "Tensor q, Tensor k, Tensor v, Tensor? allowed, Tensor? same, Tensor? e, Tensor? bias, Tensor? vt, "
    "Tensor? vt_idx, Tensor[] ops, Tensor[] tabs, Tensor?[] idxs, Tensor seed, float scale, int nq, float dropout, "
    "bool causal"
)


def _work(q, k, v, allowed, same, e, bias, vt, vt_idx, ops, tabs, idxs, seed, scale, nq, dropout, causal) -> _Work:
    """The :class:`_Work` of the ops' arguments (``_ARGS``)."""
    meta = (scale, nq, len(ops) - nq, dropout, int(seed), causal)
    return _Work(meta, q, k, v, allowed, same, e, bias, vt, vt_idx, (*ops, *tabs, *idxs))


def _run(*args) -> Tensor:
    return _attend(_work(*args), 0)[0]


def _run_backward(dout: Tensor, out: Tensor, *args) -> tuple:
    """``dq, dk, dv, de, dbias, dvt`` (an empty tensor for an input that is ``None``, or a bias that needs no
    gradient: the last argument says whether it does), the operands' and the tables' gradients."""
    *args, want_dbias = args
    w_ = _work(*args)
    dq, dk, dv, de, dbias, dvt, d_ops, d_tabs = _attend_backward(w_, dout, out, (), want_dbias and w_.bias is not None)
    q = w_.q
    return dq, dk, dv, _or_empty(de, q), _or_empty(dbias, q), _or_empty(dvt, q), d_ops, d_tabs


_op = torch.library.custom_op("posenc::relative_attention", _run, mutates_args=(), schema=f"({_ARGS}) -> Tensor")
_backward_op = torch.library.custom_op(
    "posenc::relative_attention_backward",
    _run_backward,
    mutates_args=(),
    schema=f"(Tensor dout, Tensor out, {_ARGS}, bool want_dbias) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, "
    "Tensor[], Tensor[])",
)


def _or_empty(t: Tensor | None, like: Tensor) -> Tensor:
    """``t``, or a new empty tensor in its place (an op returns tensors, each its own)."""
    return like.new_empty(0) if t is None else t


def _table_grad(t: Tensor) -> Tensor:
    """A table's gradient as :func:`_attend_backward` returns it: the table's shape, contiguous (``table_grad``)."""
    return t.new_empty(t.shape)


@_op.register_fake
def _(q, k, v, *rest):
    return torch.empty_like(q)


@_backward_op.register_fake
def _(dout, out, q, k, v, allowed, same, e, bias, vt, vt_idx, ops, tabs, idxs, seed, scale, nq, dropout, causal, want):
    de = torch.empty_like(e) if e is not None else q.new_empty(0)
    dbias = torch.empty_like(bias) if bias is not None and want else q.new_empty(0)
    dvt = _table_grad(vt) if vt is not None else q.new_empty(0)
    d_qkv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    return (*d_qkv, de, dbias, dvt, [torch.empty_like(a) for a in ops], [_table_grad(t) for t in tabs])


def _setup(ctx, inputs, output) -> None:
    *tensors, ops, tabs, idxs, seed, scale, nq, dropout, causal = inputs  # tensors: q, k, v, allowed ... vt_idx
    ctx.numbers = (len(ops), scale, nq, dropout, causal)
    # autograd sees a list of Nones only as one None (and an empty list as a list): the idxs' gradient is shaped so
    ctx.idxs_none = bool(idxs) and all(i is None for i in idxs)
    ctx.want_dbias = tensors[6] is not None and tensors[6].requires_grad
    ctx.save_for_backward(output, seed, *tensors, *ops, *tabs, *idxs)


def _grad(ctx, dout: Tensor):
    n, *numbers = ctx.numbers
    out, seed, *rest = ctx.saved_tensors
    tensors, ops, tabs, idxs = rest[:9], rest[9 : 9 + n], rest[9 + n : 9 + 2 * n], rest[9 + 2 * n :]
    grads = _backward_op(dout, out, *tensors, ops, tabs, idxs, seed, *numbers, ctx.want_dbias)
    dq, dk, dv, de, dbias, dvt, d_ops, d_tabs = grads
    e, vt = tensors[5], tensors[7]
    de, dvt = (de if e is not None else None), (dvt if vt is not None else None)
    dbias = dbias if ctx.want_dbias else None
    d_idxs = None if ctx.idxs_none else [None] * n
    return dq, dk, dv, None, None, de, dbias, dvt, None, d_ops, d_tabs, d_idxs, None, None, None, None, None


_op.register_autograd(_grad, setup_context=_setup)


def offset_table(table: Tensor, index: Tensor) -> Table:
    """The table ``[R, H|1, d]`` at the offsets' rows ``index [P]``: :class:`Rows` when ``R`` is small (``R ≤ P/2``),
    else expanded to ``[P, H|1, d]`` (one product with ``P`` rows is then cheaper than a product and a gather).
    While ``torch.compile`` traces, always :class:`Rows`: one graph for all lengths, not one each side of ``P = 2R``."""
    if torch.compiler.is_compiling() or 2 * table.shape[0] <= index.shape[0]:
        return Rows(table, index)
    return table.index_select(0, index)


def _split(table: Table) -> tuple[Tensor, Tensor | None]:
    return (table.table, table.index) if isinstance(table, Rows) else (table, None)


def relative_attention(
    form: RelativeForm,
    v: Tensor,
    scale: float,
    allowed: Tensor | None = None,
    *,
    bias: Tensor | None = None,
    dropout: float = 0.0,
    causal: bool = False,
) -> Tensor:
    """``dropout(softmax(scale · logits(form) + bias + mask)) (v + V)``: ``[B, H, Lq, d]``, computed blockwise.

    Args:
        form: the logits (a form with no terms is plain ``q̃ · k̃`` attention).
        v: values ``[B, H, Lk, d]``.
        scale: the temperature multiplying the logits.
        allowed: a boolean ``[B|1, H|1, Lq|1, Lk]`` mask (``True`` = may attend) or ``None``.
        bias: a float ``[B|1, H|1, Lq|1, Lk]`` term added *after* the temperature (T5, ALiBi, ...), with its
            gradient when it needs one.
        dropout: attention dropout on the probabilities (inverted: kept ones are divided by ``1 - p``). The masks
            are drawn from the global generator's stream (one seed per call, so ``torch.manual_seed`` makes a run
            repeatable) and drawn again in the backward rather than stored.
        causal: query ``i`` sees only keys ``j <= i + Lk - Lq`` (on top of ``allowed``); each block of query rows
            then computes only the keys it may see (about half the work of a full mask). Needs ``Lk >= Lq``.
    """
    q, k = form.q, form.k
    b, h, lq, d = q.shape
    lk = k.shape[2]
    p = lq + lk - 1
    if k.shape != (b, h, lk, d) or v.shape[:3] != (b, h, lk) or v.shape[-1] != d:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} do not match")

    def check(table: Table, what: str) -> tuple[Tensor, Tensor | None]:
        t, idx = _split(table)
        rows = p if idx is None else t.shape[0]
        if t.dim() != 3 or t.shape[0] != rows or t.shape[1] not in (1, h) or t.shape[2] != d:
            raise ValueError(f"{what} must be [{rows}, {h}|1, {d}], got {tuple(t.shape)}")
        if idx is not None and (idx.shape != (p,) or idx.dtype != torch.long):
            raise ValueError(f"the row index of {what} must be [{p}] (a long per offset), got {tuple(idx.shape)}")
        return t, idx

    ops, tabs, idxs = [], [], []
    for what, pairs, length in (("query", form.query_terms, lq), ("key", form.key_terms, lk)):
        for op, table in pairs:
            if op.shape != (b, h, length, d):
                raise ValueError(f"a {what} term needs an operand [{b}, {h}, {length}, {d}], got {tuple(op.shape)}")
            t, idx = check(table, f"the table of a {what} term")
            ops.append(op)
            tabs.append(t)
            idxs.append(idx)
    vt, vt_idx = check(form.value_table, "the value table") if form.value_table is not None else (None, None)
    same, e = (None, None) if form.segment is None else (form.segment[1], form.segment[0].contiguous())
    if allowed is not None and allowed.dim() != 4:
        raise ValueError(f"allowed must be [B|1, H|1, Lq|1, Lk], got {tuple(allowed.shape)}")
    if bias is not None and (bias.dim() != 4 or bias.shape[-1] != lk or bias.shape[-2] not in (1, lq)):
        raise ValueError(f"bias must be [B|1, H|1, {lq}|1, {lk}], got {tuple(bias.shape)}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}")
    if causal and lk < lq:
        raise ValueError(f"causal needs at least as many keys as queries, got Lk={lk} < Lq={lq}; pass a mask")
    if bias is not None:
        bias = bias.to(q.dtype)
    nq = len(form.query_terms)
    if torch.compiler.is_compiling():  # one custom op, which the compiled graph keeps as it is
        seed_t = torch.randint(0, 1 << 62, (1,)) if dropout else torch.zeros(1, dtype=torch.long)
        args = (q, k, v, allowed, same, e, bias, vt, vt_idx, ops, tabs, idxs, seed_t)
        return _op(*args, float(scale), nq, float(dropout), bool(causal))
    seed = int(torch.randint(0, 1 << 62, (1,))) if dropout else 0
    meta = (float(scale), nq, len(form.key_terms), float(dropout), seed, bool(causal))
    return _RelativeAttention.apply(meta, q, k, v, allowed, same, e, bias, vt, vt_idx, *ops, *tabs, *idxs)


__all__ = ["RelativeForm", "Rows", "offset_table", "relative_attention", "BLOCK_BYTES", "CHUNK_RATIO"]
