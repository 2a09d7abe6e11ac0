r"""CoPE, Contextual Position Encoding (Golovneva et al. 2024).

Positions are counted by the content: a gate decides, for every key, whether
it counts as one step back from the query,

.. math::
    g_{ij} = \sigma(q_i^\top k_j), \qquad p_{ij} = \sum_{t=j}^{i} g_{it}, \qquad
    e[p_{ij}] = (p_{ij} - \lfloor p_{ij} \rfloor)\, e[\lceil p_{ij} \rceil]
              + (1 - p_{ij} + \lfloor p_{ij} \rfloor)\, e[\lfloor p_{ij} \rfloor],

    a_{ij} = \mathrm{softmax}_j\big(q_i^\top k_j + q_i^\top e[p_{ij}]\big)

with learned embeddings ``e[0 .. npos_max - 1]`` (``p`` clamped to ``npos_max - 1``),
so a head can attend to "the 3rd sentence back" or "the last noun".

Where the authors' reference code (paper appendix) and the equation differ,
this follows the code:

* the gate is computed from the *scaled* logits, ``σ(q_i·k_j / √d)``
  (``gate_scale=True``; ``False`` gives the equation's ``σ(q_i·k_j)``);
* the position term ``q_i·e[p_ij]`` is added *after* the ``1/√d`` temperature,
  i.e. not scaled (the ``logits`` hook returns it divided by the temperature);
* ``p`` is a cumulative sum reversed along the keys, over the keys the causal
  mask leaves visible (``gates.flip(-1).cumsum(-1).flip(-1)`` with masked
  gates ``σ(-∞) = 0``).

The ``logits`` hook sees q, k and the positions but not the attention mask, so
causality is taken from the positions (``causal=True``: key t counts for query
i when ``pos(t) <= pos(i)``), the sum runs over key *indices* ``t >= j`` (keys
must be in position order, as with ``arange`` positions, a KV cache or memory),
and padded keys are not excluded (their gates count): mask padding on the
right, or left-pad and start positions after the padding. ``causal=False`` is
the reference code with no mask: ``p_ij = Σ_{t >= j} g_it`` over all keys.

Speed and memory: :meth:`CoPE.logits` builds the gates, their sums and the position term as ``[B, H, Lq, Lk]``
tensors (the reference path and the portable plan use it). On CPU the attention's plan instead takes
:meth:`CoPE.blocked_attention` (plan kernel ``own-blocked``), which runs :func:`cope_attention`: one block of
query rows at a time, forward and backward, never an ``[B, H, Lq, Lk]`` tensor, and the gates only on the keys
whose position is below ``npos_max - 1`` (past them every term is ``q·e[npos_max - 1]``). A decoding step (one
query) keeps the materialised kernel, which computes ``q·kᵀ`` once for the gates and the scores
(``logits_read_scores``): faster there than the blocked kernel, whose keys are reversed once per call.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from ..base import AttentionContext, Card, Cost, PositionalEncoding
from ..errors import ConfigError
from ..registry import register


@register
class CoPE(PositionalEncoding):
    r"""CoPE: gated, content-counted positions with interpolated learned embeddings.

    .. math::
        A_{ij} = \frac{q_i^\top k_j}{\sqrt d} + q_i^\top e[p_{ij}], \quad
        p_{ij} = \sum_{t=j}^{i} \sigma\Big(\frac{q_i^\top k_t}{\sqrt d}\Big)

    Args:
        head_dim: width of q (the embeddings ``e[p]`` live in the key space).
        npos_max: number of embeddings; positions are clamped to ``npos_max - 1``.
        causal: count only keys at or before the query's position (the paper's decoder use).
        gate_scale: gate from ``q·k/√d`` as the reference code (``False``: ``q·k``, the equation).
    """

    info = Card(
        name="cope",
        title="CoPE (contextual position encoding)",
        paper="Golovneva et al., Contextual Position Encoding: Learning to Count What's Important",
        year=2024,
        family="bias",
        position="relative",
        learnable=True,
        summary="p_ij = Σ_{t=j..i} σ(q_i·k_t): positions counted by gates; q_i·e[p_ij] interpolated and added.",
        reference="a naive loop of the paper's equations (reference-code choices); fast == literal",
        shortcoming="the gates need the q·k matrix: no O(L) form, and padding must be handled by positions",
    )
    shared_across_layers = False
    logits_read_scores = True  # the gates are σ(q·k): a decoding step computes q·kᵀ once (ctx.scores)

    def __init__(self, head_dim: int, npos_max: int = 64, causal: bool = True, gate_scale: bool = True):
        super().__init__()
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0:
            raise ConfigError(f"cope: head_dim must be a positive integer, got {head_dim!r}")
        if isinstance(npos_max, bool) or not isinstance(npos_max, int) or npos_max < 2:
            raise ConfigError(
                f"cope: npos_max (the number of position embeddings) must be an integer >= 2, got {npos_max!r}"
            )
        self.head_dim, self.npos_max = head_dim, npos_max
        self.causal, self.gate_scale = bool(causal), bool(gate_scale)
        # [head_dim, npos_max] as the reference code's pos_emb; zero at init as there
        self.pos_emb = nn.Parameter(torch.zeros(head_dim, npos_max))

    def cost(self, head_dim: int) -> Cost:
        # the gate σ(q·k/√d) reads the attention's own q·k (no second product); per pair and head: the sigmoid (~4),
        # the running sum over the keys (1), floor / fraction (2), the interpolation w·a + (1-w)·b (3) and the add (1);
        # per query and head: q·e[n] for the npos_max embeddings, 2·d·npos_max products, which the pairs gather
        return Cost(
            pair_elementwise=11.0,
            token=2.0 * head_dim * self.npos_max,
            note="gates share q·k; q·e[n] once per query and n, gathered per pair (own-blocked kernel)",
        )

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.pos_emb)

    # ---------------------------------------------------------------- parts
    def gates(self, q: Tensor, k: Tensor, ctx: AttentionContext, start: int = 0) -> Tensor:
        """``σ(q_i·k_t · s)``, zero for keys after the query when causal and for masked keys: ``[B, H, Lq, Lk - start]``
        for the keys from ``start`` on."""
        s = self.scale(ctx.head_dim) if self.gate_scale else 1.0
        qk = ctx.scores  # the attention's own q·kᵀ where it computed it first (materialised kernel)
        if qk is None or ctx.reference or qk.shape[-2:] != (q.shape[-2], k.shape[-2]):
            qk = torch.matmul(q, k[..., start:, :].transpose(-1, -2))
        else:
            qk = qk[..., start:]
        g = torch.sigmoid(qk * s)
        if self.causal:
            visible = ctx.k_pos[:, None, start:] <= ctx.q_pos[:, :, None]  # [B|1, Lq, Lk - start]
            g = g * visible[:, None].to(g.dtype)
        if ctx.mask is not None:  # padding and other documents' keys are not counted
            g = g * ctx.mask[..., start:].to(g.dtype)
        return g

    def contextual_positions(self, gates: Tensor, literal: bool) -> Tensor:
        """``p_ij = Σ_{t >= j} g_it``, clamped to ``npos_max - 1``."""
        if literal:
            lk = gates.shape[-1]
            t = torch.arange(lk, device=gates.device)
            later = (t[:, None] >= t[None, :]).to(gates.dtype)  # [t, j]: t >= j
            p = torch.matmul(gates, later)
        else:
            p = gates.flip(-1).cumsum(-1).flip(-1)
        return p.clamp(max=self.npos_max - 1)

    def _check(self, q: Tensor) -> None:
        if q.shape[-1] != self.head_dim:
            raise ConfigError(f"cope was built for head_dim={self.head_dim}, got q with last dimension {q.shape[-1]}")

    def _one_query_positions(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> tuple[Tensor, int]:
        """One query (a decoding step): the positions of the last ``w`` keys only, ``([B, H, 1, w], w)``.

        The gates are non-negative, so ``p_j`` grows as ``j`` moves away from the query: once the position of the
        window's first key is clamped at ``n - 1``, every key before it is clamped too, and its term is the one
        number ``q·e[n - 1]``. The window starts at ``2·npos_max + WINDOW_MARGIN`` keys (gates near 1/2 reach
        ``n - 1`` in about ``2n``) and grows by half until its first position is clamped (or it holds every key):
        the sigmoid, the running sum and the interpolation then cost ``O(n)`` per step, not ``O(C)`` for a cache of
        ``C`` keys. Exact, gradients included (a clamped position has none)."""
        lk = k.shape[-2]
        w = min(lk, 2 * self.npos_max + WINDOW_MARGIN)
        while True:
            p = self.contextual_positions(self.gates(q, k, ctx, start=lk - w), literal=False)
            if w == lk or bool((p[..., 0] >= self.npos_max - 1).all()):
                return p, w
            w = min(lk, w + max(w // 2, WINDOW_MARGIN))

    def logits(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> Tensor:
        self._check(q)
        lk = k.shape[-2]
        # a decoding step: the positions of a window of the last w keys (its growth is data-dependent: not while
        # tracing); the keys before it have the clamped position n - 1
        if not ctx.reference and q.shape[-2] == 1 and not torch.compiler.is_compiling():
            p, w = self._one_query_positions(q, k, ctx)
        else:
            p, w = self.contextual_positions(self.gates(q, k, ctx), literal=ctx.reference), lk
        lo = p.floor()
        frac = p - lo
        lo_i, hi_i = lo.long(), p.ceil().long()
        emb = self.pos_emb.to(q.dtype)
        if ctx.reference:
            # e[p_ij] materialised: [B, H, Lq, Lk, head_dim]
            table = emb.t()
            e = frac[..., None] * table[hi_i] + (1 - frac[..., None]) * table[lo_i]
            term = (q[..., :, None, :] * e).sum(-1)
        else:
            # q_i·e[n] for every integer n, then gather: [B, H, Lq, npos_max]
            per_position = torch.matmul(q, emb)
            term = per_position.gather(-1, hi_i) * frac + per_position.gather(-1, lo_i) * (1 - frac)
            if w < lk:  # the keys before the window: q·e[n - 1]
                far = per_position[..., self.npos_max - 1 :].expand(*term.shape[:-1], lk - w)
                term = torch.cat([far, term], dim=-1)
        # added after the temperature, as the reference code: A = s·q·k + q·e[p]
        return term / self.scale(ctx.head_dim)

    # ---------------------------------------------------------------- the blocked kernel
    def blocked_attention(self, ctx: AttentionContext) -> Callable[..., Tensor] | None:
        """This encoding's whole attention one block of query rows at a time, or ``None`` where it does not apply.

        Not a hook of the paper: an optional fast form of :meth:`logits` (the attention's plan kernel
        ``own-blocked``). Returns ``run(q, k, v, scale, causal, mask)`` -> ``[B, H, Lq, Dh]``, which
        :func:`cope_attention` computes without any ``[B, H, Lq, Lk]`` tensor (one custom op, which
        ``torch.compile`` keeps). ``None`` on the reference path, while compiling at positions that are not
        contiguous, and where the keys' positions are not in order (the sum runs over key *indices*, so
        with unordered keys the positions' causality is no prefix of them: :meth:`logits` then computes it).
        """
        compiling = torch.compiler.is_compiling()
        if ctx.reference or ctx.head_dim != self.head_dim or (compiling and not ctx.contiguous):
            return None
        gate_end = None
        if self.causal:  # key t counts for query i where pos(t) <= pos(i): a prefix of the keys when they are in order
            k_pos, q_pos = ctx.k_pos, ctx.q_pos
            # (keys at contiguous positions are in order: while compiling, no data-dependent check is traced)
            if not ctx.contiguous and k_pos.shape[1] > 1 and not bool((k_pos[:, 1:] >= k_pos[:, :-1]).all()):
                return None
            common = torch.promote_types(k_pos.dtype, q_pos.dtype)
            rows = max(k_pos.shape[0], q_pos.shape[0])
            gate_end = torch.searchsorted(
                k_pos.to(common).expand(rows, -1).contiguous(),
                q_pos.to(common).expand(rows, -1).contiguous(),
                right=True,
            )
        emb, npos, gate_scale, own = self.pos_emb, self.npos_max, self.gate_scale, self.scale(self.head_dim)

        def run(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, mask: Tensor | None) -> Tensor:
            self._check(q)
            # as logits(): gates from the encoding's own temperature, the position term added after the
            # attention's (a transformers model's ``scaling`` may differ from 1/√d: the term is then scaled by
            # scale / own, as logits() returning term / own is)
            table = emb.to(q.dtype) if scale == own else emb.to(q.dtype) * (scale / own)
            gs = own if gate_scale else 1.0
            return cope_attention(
                q, k, v, table, scale, npos_max=npos, gate_scale=gs, causal=causal, gate_end=gate_end, mask=mask
            )

        return run


# query rows per block of the blocked kernel (its tensors are [B, H, rows, Lk]): at most BLOCK_ROWS, fewer (down to
# 16) where B·H·rows·Lk would pass BLOCK_ELEMENTS (64 MB of float32 per tensor; a handful are alive at once)
BLOCK_ROWS = 128
BLOCK_ELEMENTS = 2**24
# a block's first window of gates: 2·npos_max + WINDOW_MARGIN keys (gates near 1/2 reach npos_max - 1 in about
# 2·npos_max), grown by half (at least WINDOW_MARGIN) until every row's position is clamped at its end
WINDOW_MARGIN = 64


def _rows(b: int, h: int, lq: int, lk: int) -> int:
    """Query rows per block for ``[B, H, Lq|Lk]``."""
    fit = BLOCK_ELEMENTS // max(1, b * h * lk)
    return max(1, min(lq, BLOCK_ROWS, max(16, fit // 16 * 16)))


class _Block:
    """One block of query rows ``r0 .. r1 - 1`` against its keys, in *reversed* key order.

    Column ``u`` of the block is key ``ke - 1 - u`` (``ke``: the keys the block may see), so the reverse
    cumulative sum of the gates is a forward ``cumsum`` and the keys' slice ``kr[..., Lk - ke:, :]`` of the
    reversed keys is a view. The masks (``True`` = excluded) are in the same order: ``square`` on the first
    ``r1 - r0`` columns (a causal block's diagonal square), ``gates_off`` and ``keys_off`` on all columns.
    """

    __slots__ = ("r0", "r1", "ke", "square", "gates_off", "keys_off")

    def __init__(self, meta: tuple, lq: int, lk: int, r0: int, r1: int, device: torch.device):
        _, _, _, causal, gate_end, mask = meta
        self.r0, self.r1 = r0, r1
        n = r1 - r0
        self.ke = ke = r1 + lk - lq if causal else lk
        # query r0 + i may see key j <= r0 + i + Lk - Lq: column u = ke - 1 - j, excluded where u < n - 1 - i
        self.square = torch.ones(n, n, dtype=torch.bool, device=device).triu_(1).flip(1) if causal else None
        rows = slice(r0, r1) if mask is not None and mask.shape[2] > 1 else slice(None)  # (or one row for all)
        self.keys_off = None if mask is None else ~mask[:, :, rows, :ke].flip(-1)
        gates_off = self.keys_off
        if gate_end is not None:
            # gates count for keys j < gate_end[i]: u >= ke - gate_end[i]
            cols = torch.arange(ke, device=device)
            later = (cols < (ke - gate_end[:, r0:r1, None]))[:, None]  # [B|1, 1, n, ke]
            gates_off = later if gates_off is None else gates_off | later
        if gates_off is not None:  # one mask row per query row, contiguous: its windows are strided views
            gates_off = gates_off.expand(*gates_off.shape[:2], n, ke).contiguous()
        self.gates_off = gates_off


def _window(t: Tensor, n: int, width: int, skew: bool) -> Tensor:
    """Columns ``0 .. width - 1`` of ``t [.., n, ke]``, or (``skew``) row ``i``'s columns from ``n - 1 - i`` on (its
    diagonal key first): a view, ``t`` row-contiguous."""
    if not skew:
        return t[..., :width]
    st = t.stride()
    if t.shape[-2] != n or st[-1] != 1 or st[-2] != t.shape[-1]:
        raise RuntimeError(f"a skewed window needs a row-contiguous [.., {n}, ke] tensor, got {tuple(t.shape)} {st}")
    return t.as_strided((*t.shape[:-1], width), (*st[:-2], st[-2] - 1, 1), t.storage_offset() + n - 1)


def _positions(s: Tensor, ga: float, blk: _Block, skew: bool) -> tuple[Tensor, Tensor]:
    """The gates ``σ(ga·s)`` of a window of the block (unmasked) and their cumulative sum (masked gates count 0):
    the positions ``p`` (unclamped), nearest key first."""
    sig = torch.mul(s, ga).sigmoid_()
    n, width = blk.r1 - blk.r0, s.shape[-1]
    g = sig
    square = blk.square is not None and not skew  # a skewed window starts at each row's diagonal: all visible
    if square or blk.gates_off is not None:
        g = sig.clone()
        if square:
            g[..., :n].masked_fill_(blk.square[:, :width], 0.0)
        if blk.gates_off is not None:
            g.masked_fill_(_window(blk.gates_off, n, width, skew), 0.0)
    return sig, torch.cumsum(g, dim=-1)


def _block_logits(qs: Tensor, qc: Tensor, kr: Tensor, table: Tensor, meta: tuple, blk: _Block) -> tuple:
    """The block's logits ``[B, H, n, ke]`` less ``q_i·e[top]`` on every row, and what the backward needs.

    ``qs`` is ``s·q``, ``qc`` is ``q``, ``top = npos_max - 1``. A row's positions only grow from its nearest key
    back, and past the column where every row's has reached ``top`` each position term is ``q_i·e[top]`` (clamped:
    no gradient to the gates either), a constant of the row that the softmax does not see. So the gates, their
    sum and the interpolation are computed on a window of columns only, each row's starting at its diagonal key
    where the block is causal (``skew``): the window is found by growing it from ``2·npos_max + WINDOW_MARGIN``
    columns until every row is clamped at its last one (the backward finds it again: the same search on the same
    numbers). Exact, not an approximation: the columns past it are the clamped ones. Its width depends on the
    gates (about ``2·npos_max`` where they are near ½, all the keys where they are near 0).
    """
    ga, top = meta[1] / meta[0], meta[2]  # the gates' multiplier of s·q·k
    lk = kr.shape[2]
    b, h = qs.shape[:2]
    n, ke = blk.r1 - blk.r0, blk.ke
    kb = kr[:, :, lk - ke :]
    a = torch.bmm(qs[:, :, blk.r0 : blk.r1].flatten(0, 1), kb.flatten(0, 1).transpose(1, 2)).view(b, h, n, ke)
    skew = blk.square is not None and ke - n + 1 > 0
    widest = ke - n + 1 if skew else ke
    width = min(widest, 2 * (top + 1) + WINDOW_MARGIN)
    while True:
        sig, c = _positions(_window(a, n, width, skew), ga, blk, skew)
        if bool((c[..., -1] >= top).all()) or (width == widest and not skew):
            break
        if width == widest:  # a skewed window cannot reach the last rows' last keys: all the columns
            skew, widest, width = False, ke, ke
        else:
            width = min(widest, width + max(1, WINDOW_MARGIN, width // 2))
    c.clamp_(max=top)
    lo = c.long()  # floor (p >= 0)
    w = c.sub_(lo)  # p - floor(p)
    z = torch.matmul(qc[:, :, blk.r0 : blk.r1], table)  # [B, H, n, npos]: q_i·e[m] for every m
    # e[m + 1] - e[m], 0 past the last: the clamped positions' slope (no gradient to the gates there)
    step = torch.nn.functional.pad(z[..., 1:] - z[..., :-1], (0, 1))
    dstep = step.gather(-1, lo)
    term = (z - z[..., top : top + 1]).gather(-1, lo).addcmul_(dstep, w)  # q·e[p] - q·e[top], interpolated
    _window(a, n, width, skew).add_(term)
    fill = torch.finfo(a.dtype).min
    if blk.square is not None:
        a[..., :n].masked_fill_(blk.square, fill)
    if blk.keys_off is not None:
        a.masked_fill_(blk.keys_off, fill)
    return a, (skew, width), sig, lo, w, dstep


def _reversed(t: Tensor) -> Tensor:
    """``t [B, H, L, Dh]`` with its keys in reverse order, contiguous (its blocks are then ``[B·H, ..]`` views)."""
    return t.flip(2).contiguous()


def _forward(meta: tuple, q: Tensor, k: Tensor, v: Tensor, table: Tensor) -> Tensor:
    """The forward of :func:`cope_attention`, block by block: ``[B, H, Lq, Dh]`` (contiguous)."""
    b, h, lq, dh = q.shape
    lk = k.shape[2]
    qc = q.contiguous()
    qs, kr, vr = qc * meta[0], _reversed(k), _reversed(v)
    out = torch.empty(b, h, lq, dh, dtype=q.dtype, device=q.device)
    rows = _rows(b, h, lq, lk)
    for r0 in range(0, lq, rows):
        blk = _Block(meta, lq, lk, r0, min(lq, r0 + rows), q.device)
        a = _block_logits(qs, qc, kr, table, meta, blk)[0]
        p = torch.softmax(a, dim=-1)
        del a
        ob = torch.bmm(p.flatten(0, 1), vr[:, :, lk - blk.ke :].flatten(0, 1))
        out[:, :, blk.r0 : blk.r1] = ob.view(b, h, blk.r1 - blk.r0, dh)
    return out


def _backward(
    meta: tuple, q: Tensor, k: Tensor, v: Tensor, table: Tensor, out: Tensor, dout: Tensor, want_table: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """``dq, dk, dv`` and (``want_table``) ``∂L/∂table``: each block recomputed, its window of gates found again
    (the same search on the same numbers as the forward's: the same window), its gradients by hand."""
    scale, ga, top = meta[0], meta[1] / meta[0], meta[2]
    b, h, lq, dh = q.shape
    lk = k.shape[2]
    qc = q.contiguous()
    qs, kr, vr = qc * scale, _reversed(k), _reversed(v)
    acc = torch.promote_types(q.dtype, torch.float32)
    delta = (dout * out).sum(-1, dtype=acc).to(q.dtype)[..., None]  # [B, H, Lq, 1]: rowsum(dO ∘ O)
    dout = dout.contiguous()
    dqs = torch.empty(b, h, lq, dh, dtype=q.dtype, device=q.device)  # through s·q
    dq = torch.empty_like(dqs)  # through the position term's q·e
    dkr, dvr = torch.zeros_like(kr), torch.zeros_like(vr)
    dtable = torch.zeros_like(table) if want_table else None
    rows = _rows(b, h, lq, lk)
    for r0 in range(0, lq, rows):
        blk = _Block(meta, lq, lk, r0, min(lq, r0 + rows), q.device)
        r1, ke = blk.r1, blk.ke
        n = r1 - r0
        a, (skew, width), sig, lo, w, dstep = _block_logits(qs, qc, kr, table, meta, blk)
        p = torch.softmax(a, dim=-1)
        del a
        kb, vb = kr[:, :, lk - ke :].flatten(0, 1), vr[:, :, lk - ke :].flatten(0, 1)
        dob = dout[:, :, r0:r1].flatten(0, 1)
        p3 = p.flatten(0, 1)
        dvr[:, :, lk - ke :].view(b * h, ke, dh).baddbmm_(p3.transpose(1, 2), dob)
        da = torch.bmm(dob, vb.transpose(1, 2)).view(b, h, n, ke)
        da.sub_(delta[:, :, r0:r1]).mul_(p)  # dA = P ∘ (dP − Δ)
        del p, p3
        # the position term (1 - w)·z[lo] + w·z[lo + 1] - z[top] on the window: its gradient to z by
        # position, then to q and e
        dap = _window(da, n, width, skew)
        upper = dap * w
        dz = q.new_zeros(b, h, n, top + 1)
        dz.scatter_add_(-1, lo, dap - upper)
        dz_next = torch.zeros_like(dz)  # [m]: what goes to z[m + 1] (nothing from m = top: w = 0 there)
        dz_next.scatter_add_(-1, lo, upper)
        del upper
        dz[..., 1:] += dz_next[..., :-1]
        dz[..., top] -= dap.sum(-1)
        dq[:, :, r0:r1] = torch.matmul(dz, table.t())
        if dtable is not None:
            dtable += torch.matmul(qc[:, :, r0:r1].transpose(-1, -2), dz).sum((0, 1))
        # to the positions (w; the clamped ones have slope 0), through their cumulative sum (a reversed one)
        # and the gates σ(ga·s·q·k)
        dg = (dap * dstep).flip(-1).cumsum(-1).flip(-1)
        dgate = torch.ops.aten.sigmoid_backward(dg, sig)
        del dg, sig
        if blk.square is not None and not skew:
            dgate[..., :n].masked_fill_(blk.square[:, :width], 0.0)
        if blk.gates_off is not None:
            dgate.masked_fill_(_window(blk.gates_off, n, width, skew), 0.0)
        dap.add_(dgate, alpha=ga)  # the gates read s·q·k too
        da3 = da.flatten(0, 1)
        dqs[:, :, r0:r1] = torch.bmm(da3, kb).view(b, h, n, dh)
        dkr[:, :, lk - ke :].view(b * h, ke, dh).baddbmm_(da3.transpose(1, 2), qs[:, :, r0:r1].flatten(0, 1))
    dq.add_(dqs, alpha=scale)
    return dq, dkr.flip(2), dvr.flip(2), dtable


# one custom op (and its backward another), so that torch.compile keeps the blocked kernel as one node for any
# length instead of the materialised logits
@torch.library.custom_op("posenc::cope_attention", mutates_args=())
def _op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    table: Tensor,
    gate_end: Tensor | None,
    mask: Tensor | None,
    scale: float,
    gate_scale: float,
    top: int,
    causal: bool,
) -> Tensor:
    return _forward((scale, gate_scale, top, causal, gate_end, mask), q, k, v, table)


@torch.library.custom_op("posenc::cope_attention_backward", mutates_args=())
def _backward_op(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    table: Tensor,
    out: Tensor,
    gate_end: Tensor | None,
    mask: Tensor | None,
    scale: float,
    gate_scale: float,
    top: int,
    causal: bool,
    want_table: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``dq, dk, dv, ∂L/∂table`` (an empty tensor where the table's is not wanted)."""
    meta = (scale, gate_scale, top, causal, gate_end, mask)
    dq, dk, dv, dtable = _backward(meta, q, k, v, table, out, dout, want_table)
    return dq, dk, dv, table.new_empty(0) if dtable is None else dtable


@_op.register_fake
def _(q, k, v, table, gate_end, mask, scale, gate_scale, top, causal):
    return q.new_empty(q.shape)


@_backward_op.register_fake
def _(dout, q, k, v, table, out, gate_end, mask, scale, gate_scale, top, causal, want_table):
    dtable = table.new_empty(table.shape if want_table else 0)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dtable


def _setup(ctx, inputs, output) -> None:
    q, k, v, table, gate_end, mask, scale, gate_scale, top, causal = inputs
    ctx.save_for_backward(q, k, v, table, output, gate_end, mask)  # (None where there is none)
    ctx.numbers = (scale, gate_scale, top, causal)


def _grad(ctx, dout: Tensor):
    q, k, v, table, out, gate_end, mask = ctx.saved_tensors
    want = ctx.needs_input_grad[3]
    dq, dk, dv, dtable = _backward_op(dout, q, k, v, table, out, gate_end, mask, *ctx.numbers, want)
    return dq, dk, dv, dtable if want else None, None, None, None, None, None, None


_op.register_autograd(_grad, setup_context=_setup)


def cope_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    emb: Tensor,
    scale: float,
    *,
    npos_max: int,
    gate_scale: float,
    causal: bool = False,
    gate_end: Tensor | None = None,
    mask: Tensor | None = None,
) -> Tensor:
    r"""CoPE attention one block of query rows at a time: ``[B, H, Lq, Dh]``, no ``[B, H, Lq, Lk]`` tensor.

    .. math::
        z_i = \sum_j \operatorname{softmax}_j\big(s\, q_i \cdot k_j + q_i \cdot e[p_{ij}]\big)\, v_j, \quad
        p_{ij} = \min\Big(\sum_{t \ge j} \sigma(s_g\, q_i \cdot k_t)\, m_{it},\; n - 1\Big)

    with ``e[p]`` interpolated between ``e[⌊p⌋]`` and ``e[⌈p⌉]`` and ``m_it`` whether key ``t``'s gate counts for
    query ``i``. For each block of query rows (at most :data:`BLOCK_ROWS`): ``s·q·kᵀ`` against the keys the block
    may see, taken in reversed order (the keys are reversed once per call) so that the reverse cumulative sum of
    the gates is a ``cumsum``; the gates, their sum and the interpolated ``q_i·e[p]`` (a gather from the row's
    ``q_i·e[m]`` for the ``n`` embeddings, not a ``[.., Lk, Dh]`` tensor) on a window of keys from each row's
    diagonal, past which every position is clamped (see :func:`_block_logits`); an exact softmax over the block's
    keys and the values. The backward recomputes each block and gives q, k, v and ``e`` their gradients by hand
    (the positions' gradient, summed back along the keys, is the gates'). Memory: a few ``[B, H, rows, Lk]``
    tensors at a time. A decoding step (one query) is one block: one pass over the keys and one over the values.

    Args:
        q, k, v: ``[B, H, Lq|Lk, Dh]``, float.
        emb: ``[Dh, n]``, the position embeddings (``CoPE.pos_emb``); its gradient flows back.
        scale: the temperature ``s`` of ``q·k`` (the position term is added after it).
        npos_max: ``n``; positions are clamped to ``n - 1``.
        gate_scale: ``s_g``, the gates are ``σ(s_g q·k)``.
        causal: query ``i`` sees keys ``j <= i + Lk - Lq`` only (bottom-right aligned; needs ``Lk >= Lq``), and
            only their gates count.
        gate_end: ``[B|1, Lq]`` integers: the gates of keys ``j >= gate_end[b, i]`` do not count (CoPE's causality
            from positions); ``None``: every key the query sees counts.
        mask: ``[B|1, 1|H, Lq|1, Lk]`` booleans, ``True`` where query ``i`` may attend key ``j`` (its gate counts
            only there too); ``None``: no mask beyond ``causal``. A row with no key gets the uniform average of
            its keys' values, as the materialised formula's (the attention zeroes it).
    """
    if not all(isinstance(t, Tensor) and t.dim() == 4 and t.is_floating_point() for t in (q, k, v)):
        raise ConfigError("cope_attention: q, k and v must be float tensors [B, H, L, Dh]")
    b, h, lq, d = q.shape
    lk = k.shape[2]
    if k.shape != (b, h, lk, d) or v.shape != k.shape or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ConfigError(
            f"cope_attention: q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)} {k.dtype} and v {tuple(v.shape)} "
            f"{v.dtype} must be [B, H, Lq|Lk, Dh] of one dtype"
        )
    if causal and lk < lq:
        raise ConfigError(f"cope_attention: causal needs at least as many keys as queries, got Lk={lk} < Lq={lq}")
    if isinstance(npos_max, bool) or not isinstance(npos_max, int) or npos_max < 2:
        raise ConfigError(f"cope_attention: npos_max must be an integer >= 2, got {npos_max!r}")
    if not isinstance(emb, Tensor) or emb.shape != (d, npos_max):
        shape = tuple(emb.shape) if isinstance(emb, Tensor) else type(emb).__name__
        raise ConfigError(f"cope_attention: emb must be [head_dim={d}, npos_max={npos_max}], got {shape}")
    if gate_end is not None:
        if gate_end.dim() != 2 or gate_end.shape[0] not in (1, b) or gate_end.shape[1] != lq:
            raise ConfigError(f"cope_attention: gate_end must be [{b}|1, Lq={lq}], got {tuple(gate_end.shape)}")
        if gate_end.is_floating_point() or gate_end.dtype == torch.bool:
            raise ConfigError(f"cope_attention: gate_end must hold integers (key indices), got {gate_end.dtype}")
        if (
            causal
            and not torch.compiler.is_compiling()  # (a data-dependent branch: kept while tracing, exact either way)
            and bool((gate_end == torch.arange(lk - lq + 1, lk + 1, device=gate_end.device)).all())
        ):
            gate_end = None  # the causal mask itself (positions in arange order): each block's diagonal square
    if mask is not None:
        if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[0] not in (1, b) or mask.shape[1] not in (1, h):
            raise ConfigError(
                f"cope_attention: mask must be booleans [{b}|1, {h}|1, {lq}|1, {lk}], got {mask.dtype} "
                f"{tuple(mask.shape)}"
            )
        if mask.shape[2] not in (1, lq) or mask.shape[3] != lk:
            raise ConfigError(f"cope_attention: mask must be [{b}|1, {h}|1, {lq}|1, {lk}], got {tuple(mask.shape)}")
    return _op(q, k, v, emb.to(q.dtype), gate_end, mask, float(scale), float(gate_scale), npos_max - 1, bool(causal))
