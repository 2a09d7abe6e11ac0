r"""Stick-breaking attention (Tan, Shen, Yang, Courville and Panda 2025, "Scaling Stick-Breaking Attention: An
Efficient Implementation and In-depth Study").

No softmax and no position encoding: each key ``j`` before query ``i`` takes a share ``β_ij = σ(z_ij)`` of what is
left of a stick of length one, breaking it from the nearest key backwards (the paper's equation 1),

.. math::
    z_{ij} = \frac{q_i^\top k_j}{\sqrt d}, \qquad
    A_{ij} = \beta_{ij} \prod_{j < t < i} (1 - \beta_{it}), \qquad
    o_i = \sum_{j < i} A_{ij}\, v_j \;\big(+\, (1 - \textstyle\sum_j A_{ij})\, v_i\big)

so a key far back gets only what the nearer ones left: order (and a recency prior) without positions.
``attend_current`` lets the query's own key break the stick first (``j <= i``, the authors' kernels' option);
``remainder`` gives what is left after the last key to the query's own value (their training code's
``sb_remainder``), so that every row's weights sum to one (the first token otherwise attends to nothing).

**Without a causal mask** (an encoder) the paper has no order to break the stick in; here the keys are taken by
distance from the query, the earlier of two at the same distance first (``i - 1, i + 1, i - 2, i + 2, ...``): the
causal order where there are no later keys. Keys the mask hides (padding, other documents) take nothing.

**Kernels.** :func:`stick_breaking_weights` gives the ``[B, H, Lq, Lk]`` weights (the reference path: the
attention's ``probabilities`` hook, which the ``materialised`` kernel calls with the masked logits): a call of more
keys than :data:`MAX_KEYS`, or more query-key pairs than :data:`MAX_PAIRS` over the batch and heads, is refused there
with the limit named. A causal call (training, prefill, a decoding step; padding or documents beside it) takes
:func:`stick_breaking_attention` instead (the plan's ``own-blocked`` kernel, a custom op ``torch.compile`` keeps),
blocked and in log space as the authors' kernels are (their recurrence, written again here for PyTorch's CPU ops):
with the keys taken nearest first, ``log A_ij = z_ij - Σ_{t nearer than j, t included} softplus(z_it)`` (``log σ(z)
- log(1 - σ(z)) = z``), one running sum along a block of query rows; only ``q, k, v`` and the output are kept for
the backward, which recomputes each block and takes

.. math::
    w_{ij} = A_{ij}\,\partial L/\partial A_{ij}, \qquad
    \partial L/\partial z_{it} = w_{it} - \beta_{it} \big(w_{it} + \textstyle\sum_{j\ \text{beyond}\ t} w_{ij}\big)

No ``[B, H, Lq, Lk]`` tensor: a block of rows holds about :data:`BLOCK_BYTES` of scores. A key the call's mask hides
takes nothing and leaves the stick as it is, as on the reference path. An encoder (no causal mask) and attention
dropout keep the reference path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from ..base import AttentionContext, Card, Cost, PositionalEncoding
from ..errors import ConfigError
from ..offset_bias import check_inputs
from ..registry import register

#: the most keys one call may have: the weights are materialised
MAX_KEYS = 4096
#: the most (query, key) pairs over batch and heads one call may have (a few float tensors of this many numbers)
MAX_PAIRS = 2**28


def check_fits(what: str, b: int, h: int, lq: int, lk: int) -> None:
    """Refuse a call too long for a materialised reference path, naming its length and the limit."""
    if lk > MAX_KEYS:
        raise ConfigError(
            f"{what} is a reference implementation that materialises its [B, H, Lq, Lk] weights: a call of {lk} keys "
            f"is more than its limit of {MAX_KEYS}; use shorter sequences (or a smaller KV cache)"
        )
    if b * h * lq * lk > MAX_PAIRS:
        raise ConfigError(
            f"{what} is a reference implementation that materialises its [B, H, Lq, Lk] weights: batch {b} x "
            f"{h} heads x {lq} queries x {lk} keys = {b * h * lq * lk} pairs is more than its limit of {MAX_PAIRS}; "
            "use a smaller batch or shorter sequences"
        )


def break_order(lq: int, lk: int, device: torch.device | None = None) -> Tensor:
    """The order in which each query's keys break the stick: ``[Lq, Lk]`` ranks, 0 the query's own key (its index
    ``i + Lk - Lq``), then ``i - 1`` (1), ``i + 1`` (2), ``i - 2`` (3), ``i + 2`` (4) ..."""
    own = torch.arange(lq, device=device)[:, None] + (lk - lq)
    d = torch.arange(lk, device=device)[None, :] - own
    return 2 * d.abs() - (d < 0).long()


def stick_breaking_weights(logits: Tensor, attend_current: bool = False, remainder: bool = True) -> Tensor:
    r"""``A_ij = σ(z_ij) Π_{t before j} (1 - σ(z_it))`` (keys in :func:`break_order`), in log space: ``[..., Lq, Lk]``.

    ``logits`` ``[..., Lq, Lk]``: ``z``, with the keys a query may not see at a very negative value (``σ = 0``:
    they take nothing and leave the stick as it is). ``attend_current``: the query's own key breaks first, else
    it takes nothing; ``remainder``: ``1 - Σ_j A_ij`` is added to the query's own key."""
    lq, lk = logits.shape[-2:]
    order = break_order(lq, lk, logits.device).expand(logits.shape)
    own = torch.arange(lq, device=logits.device) + (lk - lq)
    log_beta = F.logsigmoid(logits)
    log_rest = F.logsigmoid(-logits)  # log(1 - β)
    if not attend_current:
        is_own = order == 0
        log_beta = log_beta.masked_fill(is_own, float("-inf"))
        log_rest = log_rest.masked_fill(is_own, 0.0)
    # Σ log(1 - β) over the keys that break before j: an exclusive running sum in breaking order
    by_rank = torch.zeros(*logits.shape[:-1], 2 * lk + 1, dtype=logits.dtype, device=logits.device)
    by_rank = by_rank.scatter(-1, order, log_rest)
    before = (by_rank.cumsum(-1) - by_rank).gather(-1, order)
    weights = (log_beta + before).exp()
    if remainder:
        left = 1.0 - weights.sum(-1, keepdim=True)
        index = own.view(*([1] * (logits.dim() - 2)), lq, 1).expand(*logits.shape[:-1], 1)
        weights = weights.scatter_add(-1, index, left)
    return weights


# ------------------------------------------------------------------------------------------------ the blocked kernel
#: bytes of one block of scores (rows x keys, about a core's L2 cache): sets the rows of a block
BLOCK_BYTES = 2**20
#: the fewest query rows a block has, whatever the number of keys
MIN_ROWS = 16
# the logit of a key hidden from a query: softplus(_HIDDEN) = 0 exactly, so a hidden key leaves the stick as it is
# (its weight is set to 0 after the exp)
_HIDDEN = -1e30
#: log-weights below this are taken at it before the exp (e^-80 = 1.8e-35, below any float32 or float64 output's
#: resolution): the exp of a number under about -87 (a subnormal result, or 0) takes the CPU's slow path, ten to
#: thirty times the time (measured, 2026-12-07), and most of a long row's weights are that small
LOG_FLOOR = -80.0
# softplus(z) = z past this (torch's default, 20, drops e^-20 = 2e-9: float64's digits; e^-40 is below them)
_SOFTPLUS_LINEAR = 40.0


def _hidden_corner(n: int, attend_current: bool, device: torch.device) -> Tensor:
    """``[n, n]``: ``True`` where a block row's first columns are keys it may not see. The keys of a block
    of rows ``r0 .. r0 + n - 1`` run nearest first from the last row's own key, so row ``m``'s own key is column
    ``n - 1 - m``; the keys after it (and the own key unless ``attend_current``) are the columns before."""
    m = torch.arange(n, device=device)[:, None]
    col = torch.arange(n, device=device)[None, :]
    return col < (n - 1 - m) if attend_current else col < (n - m)


def _block_rows(lq: int, lk: int, itemsize: int) -> int:
    """Query rows a block of one (sequence, head) pair holds against ``lk`` keys."""
    return max(MIN_ROWS, min(lq, BLOCK_BYTES // max(1, lk * itemsize)))


def _weights(z: Tensor, corner: Tensor, hidden: Tensor | None) -> Tensor:
    """The weights of a block from its scores ``z`` ``[G, n, ke]``, its keys nearest first (the hidden ones, the
    later keys of the ``corner`` and those of the call's mask, ``hidden``, set to ``_HIDDEN`` in place):
    ``A = exp(z - cumsum(softplus(z)))``, at least ``e^LOG_FLOOR``, 0 for the hidden keys."""
    n = z.shape[1]
    z[:, :, :n].masked_fill_(corner, _HIDDEN)
    if hidden is not None:
        z.masked_fill_(hidden, _HIDDEN)
    a = torch.sub(z, F.softplus(z, threshold=_SOFTPLUS_LINEAR).cumsum_(-1)).clamp_min_(LOG_FLOOR).exp_()
    a[:, :, :n].masked_fill_(corner, 0.0)
    if hidden is not None:
        a.masked_fill_(hidden, 0.0)
    return a


def _scores(qs: Tensor, kf: Tensor, keys: slice) -> Tensor:
    """``qs kᵀ`` of a block (``qs``: its queries times the temperature, ``[G, n, d]``) against its keys nearest first
    (``kf``: the keys in reversed order, ``[G, Lk, d]``)."""
    return torch.matmul(qs, kf[:, keys].transpose(1, 2))


def _groups(t: Tensor) -> Tensor:
    return t.reshape(-1, *t.shape[2:])


def _blocks(
    q: Tensor, lk: int, attend_current: bool, allowed: Tensor | None
) -> Iterator[tuple[slice, slice, slice, slice, Tensor, Tensor | None]]:
    """The blocks of a call: ``(groups, rows, own, keys, corner, hidden)`` per block: the (sequence, head) pairs (a
    slice of ``B·H``), its query rows, those rows' own keys, its keys in reversed order (a slice of ``Lk``), its
    ``_hidden_corner`` and the keys the call's mask ``allowed`` (``[B|1, H|1, Lq|1, Lk]``) hides from its rows,
    ``[G, n, ke]`` nearest first (``None`` without a mask). All pairs at once where they fit in one block (a
    decoding step), else one by one."""
    b, h, lq, _ = q.shape
    mask = allowed.expand(b, h, lq, lk) if allowed is not None else None  # a view: no [B, H, Lq, Lk] copy
    off = lk - lq
    together = b * h * lq * lk * q.element_size() <= BLOCK_BYTES
    spans = [slice(0, b * h)] if together else [slice(g, g + 1) for g in range(b * h)]
    n = lq if together else _block_rows(lq, lk, q.element_size())
    corners: dict[int, Tensor] = {}
    for gs in spans:
        for r0 in range(0, lq, n):
            r1 = min(lq, r0 + n)
            if r1 - r0 not in corners:
                corners[r1 - r0] = _hidden_corner(r1 - r0, attend_current, q.device)
            hidden = None
            if mask is not None:
                ke = r1 + off
                if together:
                    seen = mask[:, :, r0:r1, :ke].reshape(b * h, r1 - r0, ke)
                else:
                    seen = mask[gs.start // h, gs.start % h, r0:r1, :ke][None]
                hidden = seen.logical_not().flip(-1)
            yield gs, slice(r0, r1), slice(off + r0, off + r1), slice(lk - r1 - off, lk), corners[r1 - r0], hidden


def _sb_forward(
    q: Tensor, k: Tensor, v: Tensor, allowed: Tensor | None, scale: float, attend_current: bool, remainder: bool
) -> Tensor:
    """The forward of :func:`stick_breaking_attention`, a block of query rows at a time (see the module's
    docstring and :func:`_blocks`)."""
    b, h, lq, d = q.shape
    lk = k.shape[2]
    qg, kg, vg = _groups(q) * scale, _groups(k), _groups(v)
    # few queries (a decoding step): the rows of scores are reversed (Lq·Lk numbers), not the keys and values (Lk·d)
    rows_reversed = lq < d
    kf, vf = (kg, vg) if rows_reversed else (kg.flip(1), vg.flip(1))
    out = torch.empty(b * h, lq, d, dtype=q.dtype, device=q.device)
    for gs, rows, own, keys, corner, hidden in _blocks(q, lk, attend_current, allowed):
        if rows_reversed:
            ke = keys.stop - keys.start
            a = _weights(_scores(qg[gs, rows], kg[gs], slice(0, ke)).flip(-1), corner, hidden).flip(-1)
            o = torch.matmul(a, vg[gs, :ke])
        else:
            a = _weights(_scores(qg[gs, rows], kf[gs], keys), corner, hidden)
            o = torch.matmul(a, vf[gs, keys])
        if remainder:  # what is left of the stick goes to the query's own value
            o.addcmul_(1 - a.sum(-1, keepdim=True), vg[gs, own])
        out[gs, rows] = o
    return out.view(b, h, lq, d)


def _sb_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    allowed: Tensor | None,
    scale: float,
    attend_current: bool,
    remainder: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """``dq, dk, dv``: each block's weights recomputed from ``q, k`` (see the module's docstring for ``∂L/∂z``)."""
    lk = k.shape[2]
    qg, kf, vf, vg = _groups(q), _groups(k).flip(1), _groups(v).flip(1), _groups(v)
    qs = qg * scale
    dog = _groups(dout.contiguous())
    dq = torch.empty_like(qg)
    dkf, dvf = torch.zeros_like(kf), torch.zeros_like(vf)
    dv_own = torch.zeros_like(vg) if remainder else None
    for gs, rows, own, keys, corner, hidden in _blocks(q, lk, attend_current, allowed):
        z = _scores(qs[gs, rows], kf[gs], keys)
        a = _weights(z, corner, hidden)
        do = dog[gs, rows]
        w = torch.matmul(do, vf[gs, keys].transpose(1, 2))  # ∂L/∂A_ij = dO_i · v_j ...
        if dv_own is not None:  # ... - dO_i · v_i: the remainder 1 - Σ_j A_ij goes to v_i
            w.sub_((do * vg[gs, own]).sum(-1, keepdim=True))
            dv_own[gs, own] += (1 - a.sum(-1, keepdim=True)) * do
        dvf[gs, keys].baddbmm_(a.transpose(1, 2), do)
        w.mul_(a)  # w_ij = A_ij ∂L/∂A_ij
        # Σ over the keys farther than t, plus w_t itself: the row total minus the running sum before t
        beyond = w.cumsum(-1).sub_(w).neg_().add_(w.sum(-1, keepdim=True))
        dz = w.sub_(beyond.mul_(torch.sigmoid_(z)))
        dq[gs, rows] = torch.matmul(dz, kf[gs, keys]).mul_(scale)
        dkf[gs, keys].baddbmm_(dz.transpose(1, 2), qs[gs, rows])
    dk, dv = dkf.flip(1), dvf.flip(1)
    if dv_own is not None:
        dv = dv + dv_own
    return dq.view(q.shape), dk.view(k.shape), dv.view(v.shape)


@torch.library.custom_op("posenc::stick_breaking_attention", mutates_args=())
def _op(
    q: Tensor, k: Tensor, v: Tensor, allowed: Tensor | None, scale: float, attend_current: bool, remainder: bool
) -> Tensor:
    return _sb_forward(q, k, v, allowed, scale, attend_current, remainder)


@torch.library.custom_op("posenc::stick_breaking_attention_backward", mutates_args=())
def _op_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, allowed: Tensor | None, scale: float, attend_current: bool,
    remainder: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    return _sb_backward(dout, q, k, v, allowed, scale, attend_current, remainder)


@_op.register_fake
def _(q, k, v, allowed, scale, attend_current, remainder):  # the schema is the op's
    return torch.empty_like(q)


@_op_backward.register_fake
def _(dout, q, k, v, allowed, scale, attend_current, remainder):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output) -> None:
    q, k, v, allowed, scale, attend_current, remainder = inputs
    ctx.save_for_backward(q, k, v, allowed)
    ctx.flags = (scale, attend_current, remainder)


def _grad(ctx, dout: Tensor):
    q, k, v, allowed = ctx.saved_tensors
    dq, dk, dv = _op_backward(dout, q, k, v, allowed, *ctx.flags)
    return dq, dk, dv, None, None, None, None


_op.register_autograd(_grad, setup_context=_setup)


def stick_breaking_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    attend_current: bool = False,
    remainder: bool = True,
    allowed: Tensor | None = None,
) -> Tensor:
    r"""Causal stick-breaking attention, blocked and in log space, without any ``[B, H, Lq, Lk]`` tensor:
    ``o_i = Σ_{j<i} A_ij v_j (+ (1 - Σ_j A_ij) v_i)``, ``[B, H, Lq, d]``.

    Args:
        q, k, v: ``[B, H, Lq|Lk, d]``, CPU, float32 or float64, one key head per query head; the queries are the
            last ``Lq`` of the ``Lk`` tokens (a KV cache's keys first).
        scale: the temperature of ``q·k`` (the paper's ``1/√d``).
        attend_current, remainder: as :class:`StickBreaking`'s.
        allowed: a boolean ``[B|1, H|1, Lq|1, Lk]`` mask beside the causal one (``True``: may attend; padding,
            documents); a hidden key takes nothing and leaves the stick as it is, as on the reference path.
    """
    check_inputs(q, k, v, True, "stick_breaking_attention", cpu=False)
    b, h, lq, lk = *q.shape[:3], k.shape[2]
    if q.dtype not in (torch.float32, torch.float64) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ConfigError(
            f"stick_breaking_attention takes float32 or float64 q, k and v of one dtype, got {q.dtype}, {k.dtype}, "
            f"{v.dtype}"
        )
    if allowed is not None:
        ok = allowed.dim() == 4 and allowed.shape[-1] == lk and allowed.shape[2] in (1, lq)
        if not (ok and allowed.shape[0] in (1, b) and allowed.shape[1] in (1, h)):
            raise ConfigError(
                f"stick_breaking_attention: allowed must be a boolean mask [B|1, H|1, Lq|1, Lk] = "
                f"[{b}|1, {h}|1, {lq}|1, {lk}], got {tuple(allowed.shape)}"
            )
        allowed = allowed.to(torch.bool)
    return _op(q, k, v, allowed, float(scale), bool(attend_current), bool(remainder))


@register
class StickBreaking(PositionalEncoding):
    r"""Stick-breaking attention: ``A_ij = σ(z_ij) Π_{j<t<i} (1 - σ(z_it))`` instead of softmax, no positions.

    Args:
        attend_current: the query's own key breaks the stick first (``j <= i``); default ``j < i``, the paper's.
        remainder: what is left of the stick after the last key goes to the query's own value.
    """

    info = Card(
        name="stick-breaking",
        title="Stick-breaking attention",
        paper="Tan, Shen, Yang, Courville, Panda, Scaling Stick-Breaking Attention: An Efficient Implementation "
        "and In-depth Study",
        year=2025,
        family="bias",
        position="relative",
        learnable=False,
        summary="weights σ(z_ij) Π (1 - σ(z_it)) over the nearer keys instead of softmax: order without positions "
        "(causal calls: a blocked kernel in log space; encoders: materialised, up to 4096 keys)",
        reference="the paper's product written out in loops, float64: max diff 3.3e-16 (and the cumulative form in log "
        "space); the blocked kernel == those weights, gradients included (float64, random shapes); KV cache == none",
        shortcoming="an encoder and attention dropout take the materialised weights (O(L²) memory); "
        "an encoder breaks the stick by distance, posenc's extension",
    )
    claims = {"relative_only": True, "decay": True, "params_constant": True}
    fused_min_pairs = 64 * 64  # the blocked kernel pays off early: no [B, H, Lq, Lk] tensor

    def __init__(self, attend_current: bool = False, remainder: bool = True):
        super().__init__()
        self.attend_current = bool(attend_current)
        self.remainder = bool(remainder)

    def cost(self, head_dim: int) -> Cost:
        # per pair and head: log σ(z) (~4, a sigmoid as CoPE counts it), log(1 - σ(z)) = log σ(z) - z (1), the
        # running sum in breaking order (1) with its scatter and gather (2), the add (1), the exp (1) and the
        # remainder's share of a row sum (1): elementwise, beside q·k and p·v
        return Cost(
            pair_elementwise=11.0,
            memory="a block of query rows' scores (BLOCK_BYTES) for a causal call; the [B, H, Lq, Lk] weights for "
            "an encoder",
            note="the stick's running sum per pair in log space, blocked (causal) or materialised",
        )

    def scale(self, head_dim: int) -> float:
        """The paper's inverse temperature of the logits ``z = q·k / √d`` (the standard one, stated: the sigmoid's
        logits are scaled as softmax's would be)."""
        return head_dim**-0.5

    def probabilities(self, logits: Tensor, ctx: AttentionContext) -> Tensor:
        b, h, lq, lk = logits.shape
        check_fits("stick-breaking attention", b, h, lq, lk)
        if lk < lq:
            raise ConfigError(
                f"stick-breaking attention: a call has {lk} keys for {lq} queries; the queries must be among the "
                "keys (self-attention), the last Lq of them"
            )
        return stick_breaking_weights(logits, self.attend_current, self.remainder)

    #: a decoding step (one query of a causal call) runs in :meth:`blocked_attention` too, at any cache length
    decodes_itself = True
    #: an encoder (no causal mask, the keys broken by distance) takes the reference weights: the materialised kernel
    blocks_causal_only = True

    def blocked_attention(self, ctx: AttentionContext) -> Callable[..., Tensor] | None:
        """The causal fast form (the plan's ``own-blocked`` kernel, for causal calls only: ``blocks_causal_only``):
        :func:`stick_breaking_attention`, with the call's mask beside the causal one (padding, documents)."""
        if ctx.reference:
            return None

        def run(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, mask: Tensor | None) -> Tensor:
            return stick_breaking_attention(q, k, v, scale, self.attend_current, self.remainder, mask)

        return run
