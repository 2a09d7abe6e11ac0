r"""FoX, the Forgetting Transformer (Lin, Nikishin, He and Courville 2025, "Forgetting Transformer: Softmax Attention
with a Forget Gate").

A data-dependent ALiBi: every token ``t`` has, per head, a forget gate ``σ(f_t) ∈ (0, 1)``, and the logit between
query ``i`` and key ``j <= i`` is decayed by the gates of the tokens between them (the paper's equations 5-6):

.. math::
    f_t = w_f^\top x_t + b_f, \qquad
    D_{ij} = \sum_{t=j+1}^{i} \log \sigma(f_t), \qquad
    o_i = \sum_{j \le i} \operatorname{softmax}_j\Big(\frac{q_i^\top k_j}{\sqrt d} + D_{ij}\Big)\, v_j

With ``c_t = Σ_{s<=t} log σ(f_s)`` (the cumulative log-gates), ``D_ij = c_i - c_j``: one number per token and head.

**Where the gates come from.** The paper computes ``f_t`` from the layer's input ``x_t``; posenc's attention hooks
see ``q`` and ``k`` (after the projections), not ``x``. Here ``f_t = W_f k_t + b_f`` with ``k_t`` the token's key
of every head (``[n_heads · head_dim]``), ``W_f`` ``[n_heads, n_heads · head_dim]``: with ``k_t = W_k x_t + b_k``
this is ``(W_f W_k) x_t + (W_f b_k + b_f)``, an affine function of ``x_t`` as the paper's, and every affine function
of ``x_t`` is one of these where ``W_k`` is invertible (``n_heads · head_dim = d_model``, as in the models; a random
``W_k`` is). The function class is the paper's; the parameterisation (hence the gradient steps) differs. Taking
the keys also makes the gates work wherever posenc puts an encoding (its own attention, a patched transformers
model) without the layer's input.

**Without a causal mask** (an encoder) the paper has no formula. ``causal=False`` (what the models pass an
encoder's encoding) gives the keys after the query a second gate of their own, FoX of the reversed sequence:
``D_ij = Σ_{t=i..j-1} log σ(g_t)`` for ``j > i``, ``g_t = W_g k_t + b_g``, so that before and after differ (as a
bidirectional LSTM's two directions). ``causal=True`` used without a mask extends the paper's formula
symmetrically, ``D_ij = -|c_i - c_j|`` (the forward gates between ``i`` and ``j``).

**Kernels.** :meth:`FoX.logits` gives ``D / scale`` as a ``[B, H, Lq, Lk]`` term (the reference path, short calls,
masks beyond the causal one, encoders). A causal call of many pairs on CPU takes :func:`fox_attention` (the plan's
``own-blocked`` kernel, one custom op that ``torch.compile`` keeps): no ``[B, H, Lq, Lk]`` tensor. ``D_ij = c_i -
c_j`` is a per-key term ``-c_j`` up to a per-query constant, which softmax ignores, so each block of query rows
runs the CPU flash kernel with the *row vector* ``c_r - c_j`` as its mask (a stride-0 view: nothing materialised),
``r`` the block's middle query. Precision: ``c_t`` falls without bound (``-0.7`` a token at ``σ(f) = 1/2``:
``-2800`` at ``L = 4096``), and one float32 row ``-c_j`` for all queries would carry errors of ``ulp(|c|) ≈ 2.4e-4``
into every logit (measured: ``1.7e-3`` off float64 in a fast-forgetting head at ``L = 4096``). Relative to the
block's own query the values that matter stay within the block's decay, so the kernel picks the block height (256
down to 16 rows) such that no block decays by more than :data:`MAX_BLOCK_DECAY` nats: the logits then carry
``ulp(32 + a few)`` errors, the float32 floor of any bias of that size. The cumulative sums are float64 throughout.

**KV cache.** A decoding step needs ``c`` of the last cached token (``c_new = c_last + log σ(f_new)``: a running
sum, no gate recomputed). The ``rotate`` hook gives ``c`` of the new keys, float64, as ``ctx.key_state``, which a KV
cache stores beside the keys in storage of its own (``key_state_channels``; the keys stay contiguous for the
kernels), and the next step reads the last one from ``ctx.past_key_state`` (its one new key's gate in a handful of
ops, :meth:`FoX._step_state`). A decoding step takes the row ``c_i - c_j`` from it in one pass
(:meth:`FoX.decode_row`), adds the scores ``q·k_j`` into it in place and takes one softmax (:meth:`FoX._decode`;
SDPA with the row as its mask under autograd or ``torch.compile``). Without a cache
(training, a patched transformers model, which hands the hook every key each call) the hook sets ``ctx.key_state``
the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..base import AttentionContext, Card, Cost, PositionalEncoding
from ..errors import ConfigError
from ..offset_bias import check_inputs
from ..ops import attention_op, extra_grad
from ..registry import register

#: query rows per block of the forward's flash calls
FORWARD_ROWS = 256
# bytes of one block of scores in the backward (about an L2 cache): sets its block height
_BACKWARD_BYTES = 2 * 2**20
# the reference path lists the gates between every pair up to this many (query, key, gate) triples
_LITERAL_MAX = 2**25

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


# ------------------------------------------------------------------------------------------------ the kernel
def _square(c: Tensor, p: int, ke: int, dtype: torch.dtype) -> Tensor:
    """``c_i - c_j`` over the block's diagonal square (keys and queries ``p .. ke - 1``), ``j > i`` at ``-inf``:
    ``[..., m, m]`` (the differences in float64, then rounded: the float32 floor of a bias of their size)."""
    cs = c[..., p:ke]
    out = (cs[..., :, None] - cs[..., None, :]).to(dtype)
    m = ke - p
    return out.masked_fill_(torch.ones(m, m, dtype=torch.bool, device=c.device).triu_(1), float("-inf"))


def _prefix_row(c: Tensor, p: int) -> Tensor:
    """``c_{p-1} - c_j`` for the keys ``j < p`` before a block's square: ``[..., p]`` float64, all ``<= 0``."""
    return c[..., p - 1 : p] - c[..., :p]


def _fox_forward(q: Tensor, k: Tensor, v: Tensor, c: Tensor, scale: float, causal: bool) -> Tensor:
    """The forward of :func:`fox_attention`, one block of query rows at a time (see the module's docstring)."""
    b, h, lq, _ = q.shape
    lk = k.shape[2]
    off = lk - lq
    out = torch.empty_like(q)
    for r0 in range(0, lq, FORWARD_ROWS):
        r1 = min(lq, r0 + FORWARD_ROWS)
        m, ke, p = r1 - r0, r1 + off, r0 + off  # rows, keys seen, keys before the block's diagonal square
        qb = q[:, :, r0:r1]
        # the square: its bias c_i - c_j per row (m x m numbers), flash's own causal mask (top-left = the block's)
        o2, l2 = _flash(qb, k[:, :, p:ke], v[:, :, p:ke], 0.0, True, attn_mask=_square(c, p, ke, q.dtype), scale=scale)
        if p == 0:
            out[:, :, r0:r1] = o2
            continue
        # the keys before it: one row c_{p-1} - c_j for every query (a stride-0 view), whose per-query remainder
        # c_i - c_{p-1} goes into the log-sum-exp in float64 (see the module's docstring: precision)
        row = _prefix_row(c, p).to(q.dtype)[:, :, None, :].expand(b, h, m, p)
        o1, l1 = _flash(qb, k[:, :, :p], v[:, :, :p], 0.0, False, attn_mask=row, scale=scale)
        l1 = l1.double() + (c[..., p:ke] - c[..., p - 1 : p])
        lse = torch.logaddexp(l1, l2.double())
        w1, w2 = (l1 - lse).exp_().to(q.dtype), (l2.double() - lse).exp_().to(q.dtype)
        out[:, :, r0:r1] = o1.mul_(w1[..., None]).addcmul_(o2, w2[..., None])
    return out


def _fox_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, c: Tensor, out: Tensor, scale: float, causal: bool, dc: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``dq, dk, dv`` and ``∂L/∂c`` (empty unless ``dc``), each block's probabilities recomputed (per sequence and
    head, a block of rows small enough to stay in cache); ``D_ij = c_i - c_j`` gives ``∂L/∂c_j = -colsum(dS)_j``."""
    b, h, lq, d = q.shape
    lk = k.shape[2]
    off = lk - lq
    n = max(16, min(lq, _BACKWARD_BYTES // max(1, lk * q.element_size())))
    acc = torch.promote_types(q.dtype, torch.float32)
    delta = (dout * out).sum(-1, dtype=acc).to(q.dtype)  # [B, H, Lq]: rowsum(dO ∘ O)
    dout = dout.contiguous()
    dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
    d_c = extra_grad(c, dc)
    blocks = []  # per block of rows: (r0, r1, ke, p, the prefix's row and column)
    for r0 in range(0, lq, n):
        r1 = min(lq, r0 + n)
        ke, p = r1 + off, r0 + off
        row = _prefix_row(c, p).to(q.dtype) if p else None  # c_{p-1} - c_j
        col = (c[..., p:ke] - c[..., p - 1 : p]).to(q.dtype)[..., None] if p else None  # c_i - c_{p-1}
        blocks.append((r0, r1, ke, p, row, col))
    for bi in range(b):
        for hi in range(h):
            qh, kh, doh = q[bi, hi], k[bi, hi], dout[bi, hi]
            kt, vt = kh.t(), v[bi, hi].t()
            dkh, dvh = dk[bi, hi], dv[bi, hi]
            for r0, r1, ke, p, row, col in blocks:
                qr, dor = qh[r0:r1], doh[r0:r1]
                s = torch.empty(r1 - r0, ke, dtype=q.dtype, device=q.device)
                square = _square(c[bi, hi], p, ke, q.dtype)  # [m, m]: made here, one at a time
                torch.addmm(square, qr, kt[:, p:ke], alpha=scale, out=s[:, p:])
                if p:  # c_{p-1} - c_j plus c_i - c_{p-1}: each small wherever the pair's weight is not
                    torch.addmm(row[bi, hi].expand(r1 - r0, p), qr, kt[:, :p], alpha=scale, out=s[:, :p])
                    s[:, :p] += col[bi, hi]
                pr = torch.softmax(s, dim=-1)
                dvh[:ke].addmm_(pr.t(), dor)
                ds = torch.mm(dor, vt[:, :ke])
                ds.sub_(delta[bi, hi, r0:r1, None]).mul_(pr)  # dS = P ∘ (dP − Δ)
                torch.mm(ds, kh[:ke], out=dq[bi, hi, r0:r1]).mul_(scale)
                dkh[:ke].addmm_(ds.t(), qr, alpha=scale)
                if dc:  # c_i's share, rowsum(dS), is 0: Σ_j P_ij (dP_ij − Δ_i) = Δ_i − Δ_i (softmax ignores c_i)
                    d_c[bi, hi, :ke] -= ds.sum(0, dtype=d_c.dtype)
    return dq, dk, dv, d_c


# one custom op (its backward a second), so that torch.compile keeps the kernel
_op = attention_op("fox_attention", _fox_forward, _fox_backward)


def fox_attention(q: Tensor, k: Tensor, v: Tensor, c: Tensor, scale: float) -> Tensor:
    r"""Causal attention with FoX's decay, ``softmax_j(scale · q_i·k_j + c_i - c_j)`` over ``j <= i + Lk - Lq``,
    without any ``[B, H, Lq, Lk]`` tensor: ``[B, H, Lq, d]``.

    Args:
        q, k, v: ``[B, H, Lq|Lk, d]``, CPU, float32 or float64; the queries are the last ``Lq`` of the ``Lk`` tokens.
        c: ``[B, H, Lk]`` float64, the cumulative log-gates of the keys (query ``i``'s is ``c[..., i + Lk - Lq]``);
            its gradient flows back.
        scale: the temperature of ``q·k`` (the decay is added after it).
    """
    check_inputs(q, k, v, True, "fox_attention", cpu=False)  # its own CPU check below says where FoX runs
    b, h, lk = q.shape[0], q.shape[1], k.shape[2]
    if not isinstance(c, Tensor) or c.shape != (b, h, lk):
        shape = tuple(c.shape) if isinstance(c, Tensor) else type(c).__name__
        raise ConfigError(f"fox_attention: c must be [{b}, {h}, {lk}] (one cumulative log-gate per key), got {shape}")
    if q.device.type != "cpu":
        raise ConfigError(f"fox_attention runs the CPU flash kernel; got q on {q.device} (FoX.logits works anywhere)")
    return _op(q, k, v, c.to(torch.float64), float(scale), True)


# ------------------------------------------------------------------------------------------------ the encoding
def decay_matrix(c: Tensor, lq: int, e: Tensor | None = None) -> Tensor:
    """``D_ij`` for the last ``lq`` of the keys as queries: ``[..., Lq, Lk]`` from the running sums of the keys.

    ``c`` ``[..., Lk]``: ``Σ_{s<=t} log σ(f_s)``; ``D_ij = c_i - c_j`` for ``j <= i``. ``e`` (a bidirectional FoX):
    ``Σ_{s<t} log σ(g_s)``, and ``D_ij = e_j - e_i`` for ``j > i``; without it ``-|c_i - c_j|`` (the sums fall, so
    that is ``c_i - c_j`` for ``j <= i`` and ``c_j - c_i`` after)."""
    lk = c.shape[-1]
    diff = c[..., lk - lq :, None] - c[..., None, :]
    if e is None:
        return -diff.abs()
    later = torch.arange(lk, device=c.device)[None, :] > torch.arange(lk - lq, lk, device=c.device)[:, None]
    return torch.where(later, e[..., None, :] - e[..., lk - lq :, None], diff)


@register
class FoX(PositionalEncoding):
    r"""FoX: a forget gate per head and token; the logit of ``(i, j)`` gets ``Σ_{t=j+1..i} log σ(f_t)``.

    .. math::
        A_{ij} = \frac{q_i^\top k_j}{\sqrt d} + \sum_{t=j+1}^{i} \log\sigma(f_t), \qquad
        f_t = W_f\, k_t + b_f \in \mathbb{R}^{H}

    (``k_t``: the token's keys of every head, so ``f_t`` is an affine function of the layer input ``x_t`` as in the
    paper, where ``f_t = w_f^\top x_t + b_f``; see the module's docstring.) Without a causal mask
    (``causal=False``) the keys after the query decay by gates of their own, ``Σ_{t=i..j-1} log σ(g_t)``.

    Args:
        n_heads: heads (one gate per head and token).
        head_dim: width of one head's key.
        gate_bias: the initial ``b_f`` (``None``: ``nn.Linear``'s default initialisation, the paper's; a large
            value, e.g. 5, starts with gates near 1, little forgetting).
        causal: the model is causal (the paper's); ``False``: an encoder, with the second gate ``g`` for the keys
            after the query (without it, a call with no mask extends the forward decay symmetrically).
    """

    info = Card(
        name="fox",
        title="FoX (Forgetting Transformer: a data-dependent forget gate)",
        paper="Lin, Nikishin, He, Courville, Forgetting Transformer: Softmax Attention with a Forget Gate",
        year=2025,
        family="bias",
        position="relative",
        learnable=True,
        summary="Σ_{t=j+1..i} log σ(f_t) added after scaling, f_t = W_f k_t + b (gates from the keys): a "
        "data-dependent ALiBi; causal blocks of rows through flash with a row of c_ref - c_j.",
        reference="the paper's sum of log-gates in float64 (a literal triple loop): max diff 2.8e-16, the fast "
        "kernel and the reference path; KV cache == literal",
        shortcoming="the gates come from the keys (an affine function of x, as the paper's, another parameterisation);"
        " an encoder's second gate for the keys after the query is posenc's extension",
    )
    shared_across_layers = False
    key_state_channels = 1  # c in float64, stored beside the keys by a KV cache
    fused_min_pairs = 64 * 64  # the blocked kernel pays off early (no L x L tensor, SDPA's flash per block)
    decodes_itself = True  # a decoding step: the row of decays from the cached sums, one pass, the scores added in
    claims = {"relative_only": True, "decay": True, "params_constant": True}

    def __init__(self, n_heads: int, head_dim: int, gate_bias: float | None = None, causal: bool = True):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, head_dim
        self.gate_bias = gate_bias
        self.causal = bool(causal)
        # the forward gates f (and, for an encoder, the reversed sequence's g): one per head and token
        self.gate = nn.Linear(n_heads * head_dim, n_heads * (1 if self.causal else 2))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.gate.reset_parameters()
        if self.gate_bias is not None:
            nn.init.constant_(self.gate.bias, float(self.gate_bias))

    def cost(self, head_dim: int) -> Cost:
        # per token and head: the gate f = W_f[h]·k_t reads the token's keys of every head (2·H·d products; an
        # encoder's g as many again); the log-sigmoid and the running sum (~5); per pair and head: one add of
        # c_i - c_j (the kernel's row of -c_j)
        return Cost(
            token=2.0 * self.n_heads * head_dim * (1 if self.causal else 2),
            token_elementwise=5.0,
            pair_elementwise=1.0,
            note="a gate per token and head from its keys; one add per pair (flash with a row of -c_j per block)",
        )

    # ---------------------------------------------------------------- the gates
    def log_gates(self, k: Tensor, ctx: AttentionContext | None = None) -> Tensor:
        """``log σ(f_t)`` for keys ``k`` ``[B, H, L, d]``: ``[B, H, L]`` (float64); for an encoder
        (``causal=False``) ``[B, 2H, L]``, the forward gates then the reversed sequence's ``log σ(g_t)``.

        A gate that is not finite (a key holding NaN or inf), and the gate of a key that no query of the call may see
        (``ctx.mask``: a padded token; the keys are the last ``L`` of the mask's), is 1 (``log σ = 0``): such a token
        decays nothing, so its gate does not cross into the sums of the queries around it. The queries that see a
        poisoned key still get NaN (the attention's quarantine of non-finite keys)."""
        b, h, n, d = k.shape
        if d != self.head_dim or h > self.n_heads or self.n_heads % h:
            raise ConfigError(
                f"fox was built for n_heads={self.n_heads}, head_dim={self.head_dim} but got keys of {h} heads of "
                f"width {d}; it takes keys of width head_dim, one head per query head or grouped ({self.n_heads} "
                "divisible by the key heads)"
            )
        if h < self.n_heads:  # grouped keys (a transformers model): each key head serves its group of query heads
            k = k.repeat_interleave(self.n_heads // h, dim=1)
            h = self.n_heads
        f = self.gate(k.transpose(1, 2).reshape(b, n, h * d))  # [B, L, H] (or 2H)
        g = F.logsigmoid(f.double()).transpose(1, 2).nan_to_num(0.0, 0.0, 0.0)  # a non-finite gate: 1 (log 0)
        mask = ctx.mask if ctx is not None else None
        if mask is not None and mask.shape[-1] >= n:
            hidden = ~mask.any(-2)[..., mask.shape[-1] - n :]  # [B|1, 1|H, L]: keys no query may see
            if hidden.shape[1] not in (1, g.shape[1]):
                hidden = hidden.repeat(1, g.shape[1] // hidden.shape[1], 1)
            g = g.masked_fill(hidden, 0.0)
        return g

    def cumulative(self, k: Tensor, start: Tensor | None = None, ctx: AttentionContext | None = None) -> Tensor:
        """``c_t = start + Σ_{s<=t} log σ(f_s)`` for the keys ``k``: ``[B, H, L]`` float64 (``start`` ``[B, H]``;
        ``ctx``: the call's mask, see :meth:`log_gates`)."""
        c = self.log_gates(k, ctx)[:, : self.n_heads].cumsum(-1)
        return c if start is None else c + start[..., None]

    def reversed_cumulative(self, k: Tensor, ctx: AttentionContext | None = None) -> Tensor | None:
        """An encoder's ``e_t = Σ_{s<t} log σ(g_s)`` for the keys ``k`` (``[B, H, L]`` float64), ``None`` where
        ``causal``: ``D_ij = e_j - e_i`` for the keys ``j > i``."""
        if self.causal:
            return None
        g = self.log_gates(k, ctx)[:, self.n_heads :]
        return g.cumsum(-1) - g

    @staticmethod
    def _channels(c: Tensor, dtype: torch.dtype) -> Tensor:
        """``c`` as two channels of ``dtype`` whose sum keeps its digits: ``[B, H, L, 2]``."""
        hi = c.to(dtype)
        return torch.stack([hi, (c - hi.double()).to(dtype)], dim=-1)

    @staticmethod
    def _from_channels(state: Tensor) -> Tensor:
        """``c`` (float64) from the per-key state :meth:`rotate` sets: its one float64 channel."""
        return state[..., 0]

    def _past_c(self, ctx: AttentionContext) -> Tensor | None:
        """``c`` of the keys a KV cache holds for this layer (``[B, H, n, 1]``, the cache's view), or ``None``."""
        past = ctx.past_keys
        if past is None or past.shape[2] == 0:
            return None
        state = ctx.past_key_state
        if state is None or state.shape[-1] != self.key_state_channels or state.shape[2] != past.shape[2]:
            raise ConfigError(
                "fox: the KV cache holds keys without FoX's running sums (FoX stores them beside its keys): the "
                "cache was filled by another encoding; start a new posenc.KVCache()"
            )
        return state

    def rotate(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> tuple[Tensor, Tensor]:
        """Nothing rotates: the gates of the new keys and their running sum ``c`` go to ``ctx.key_state``, which a KV
        cache stores beside the keys (see the module). A decoding step's one new key takes :meth:`_step_state`."""
        if not ctx.caching:
            ctx.key_state = self.cumulative(k, None, ctx)[..., None]
            return q, k
        if k.shape[1] != self.n_heads:
            raise ConfigError(
                f"fox keeps one running sum per query head with the keys of a KV cache, which needs one key head "
                f"per query head; got {k.shape[1]} key heads for n_heads={self.n_heads}"
            )
        past = self._past_c(ctx)
        if past is not None and k.shape[2] == 1 and self.causal and k.shape[3] == self.head_dim:
            ctx.key_state = self._step_state(k, past[:, :, -1:], ctx.mask)
            return q, k
        c = self.cumulative(k, None if past is None else past[:, :, -1, 0], ctx)
        ctx.key_state = c[..., None]  # float64, one channel: a KV cache keeps it beside the keys as it is
        return q, k

    def _step_state(self, k: Tensor, last: Tensor, mask: Tensor | None) -> Tensor:
        """``c`` of a decoding step's one new key ``k`` ``[B, H, 1, d]`` from ``last``, the cached ``c`` of the key
        before it (``[B, H, 1, 1]``): ``[B, H, 1, 1]`` float64, :meth:`log_gates` and :meth:`cumulative`'s numbers
        (``last + log σ(f)``, the same float64 add) in five ops. ``k`` is the key projection's output split into
        heads, so the gate reads it without a copy; ``mask``: the call's, a new key no query sees gates nothing."""
        b, h = k.shape[0], k.shape[1]
        f = self.gate(k.transpose(1, 2).reshape(b, 1, h * self.head_dim))  # [B, 1, H]
        g = F.logsigmoid(f.double()).nan_to_num_(0.0, 0.0, 0.0).view(b, h, 1, 1)  # a non-finite gate: 1 (log 0)
        if mask is not None:  # [B|1, 1|H, Lq, Lk]: the new key is the last; hidden where no query sees it
            g.masked_fill_(~mask[..., -1:].any(-2, keepdim=True), 0.0)
        return g.add_(last)

    def _c(self, k: Tensor, ctx: AttentionContext) -> Tensor:
        """``c`` of every key of the call: from the channels the rotate hook made, else from the keys."""
        state = ctx.key_state
        if state is not None and state.shape[2] == k.shape[2] and not ctx.reference:
            return self._from_channels(state)
        return self.cumulative(k, ctx=ctx)

    # ---------------------------------------------------------------- the hooks' terms
    def logits(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> Tensor:
        lq, lk = q.shape[-2], k.shape[-2]
        if lk < lq:
            raise ConfigError(f"fox: a call has {lk} keys for {lq} queries; FoX needs the queries among the keys")
        if ctx.reference:  # the paper's sum of the gates between i and j, term by term (float64)
            gates = self.log_gates(k, ctx)
            f, g = gates[:, : self.n_heads], gates[:, self.n_heads :]
            if lq * lk * lk <= _LITERAL_MAX:
                t = torch.arange(lk, device=k.device)
                i, j = t[lk - lq :, None, None], t[None, :, None]
                before = ((t > j) & (t <= i)).to(f.dtype)  # [Lq, Lk, t]: j < t <= i
                after = ((t >= i) & (t < j)) if g.shape[1] else ((t > i) & (t <= j))  # i <= t < j, or i < t <= j
                d = torch.einsum("bht,qkt->bhqk", f, before)
                d = d + torch.einsum("bht,qkt->bhqk", g if g.shape[1] else f, after.to(f.dtype))
            else:  # too many terms to list: the same sums as differences of float64 running sums
                d = decay_matrix(f.cumsum(-1), lq, g.cumsum(-1) - g if g.shape[1] else None)
        else:
            d = decay_matrix(self._c(k, ctx), lq, self.reversed_cumulative(k, ctx))
        return (d / self.scale(ctx.head_dim)).to(q.dtype)

    def flex_score(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> tuple[Tensor, Tensor, Any] | None:
        """FoX as a flex_attention score_mod: ``score + D_ij``, ``D_ij = -|c_i - c_j|`` (``c_i - c_j`` for ``j <= i``),
        from the running sums ``c`` of the call's keys, each held as two channels of the attention's dtype whose sum
        keeps its digits (:meth:`_channels`): the difference of the high parts is exact where ``c`` is large, and
        the low parts carry the rest. No ``[B, H, L, L]`` tensor; a KV-cache step reads the cached sums. ``None`` on
        the reference path."""
        lq, lk = q.shape[-2], k.shape[-2]
        if ctx.reference or lk < lq:
            return None
        state = self._channels(self._c(k, ctx), q.dtype)  # [B, H, Lk, 2]
        hi, lo = state[..., 0], state[..., 1]
        e = self.reversed_cumulative(k, ctx)
        back = self._channels(e, q.dtype) if e is not None else None
        shift = lk - lq  # query row i is key row i + Lk - Lq

        def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            i = q_idx + shift
            d = (hi[b, h, i] - hi[b, h, kv_idx]) + (lo[b, h, i] - lo[b, h, kv_idx])
            if back is None:
                return score - d.abs()
            after = (back[b, h, kv_idx, 0] - back[b, h, i, 0]) + (back[b, h, kv_idx, 1] - back[b, h, i, 1])
            return score + torch.where(kv_idx > i, after, d)

        return q, k, score_mod

    def decode_row(self, k: Tensor, ctx: AttentionContext, dtype: torch.dtype) -> Tensor:
        """``D_ij = c_i - c_j`` of a decoding step (the last key is the query's): ``[B, 1|H, 1, Lk]`` in ``dtype``.

        The float64 difference of the running sums, rounded once: the row carries ``ulp(|D_ij|)`` errors, not
        ``ulp(|c|)`` (``c`` falls without bound, see the module's docstring). A KV cache keeps ``c`` as one
        contiguous float64 run per head (:class:`~posenc.KVCache` stores the state channel-major), so this is one
        pass over ``8 Lk`` bytes a head."""
        c = self._c(k, ctx)
        if torch.compiler.is_compiling() or (c.requires_grad and torch.is_grad_enabled()):
            return (c[..., -1:] - c).to(dtype)[:, :, None, :]
        # the float64 difference written straight into the row of ``dtype`` (rounded once, no float64 row between)
        row = torch.empty(c.shape[0], c.shape[1], 1, c.shape[2], dtype=dtype, device=c.device)
        torch.sub(c[..., -1:], c, out=row[:, :, 0])
        return row

    def _decode(self, q: Tensor, k: Tensor, v: Tensor, scale: float, mask: Tensor | None, ctx: AttentionContext):
        """One query (a decoding step): ``softmax(scale · q kᵀ + row) v`` with the decay row of :meth:`decode_row`.

        Without autograd, the scores are added into the row in place (one batched ``q kᵀ`` on the cache's keys as
        they lie, no copy), then a softmax and one batched product with the values: measured as fast as SDPA's flash
        kernel *without* a mask at a 4,096-key cache, where flash with the row as its mask, and
        :func:`posenc.native.decode_attention` with it, were slower (benchmarks/README.md, issue 49). With autograd,
        and while ``torch.compile`` traces, SDPA takes the row as its mask."""
        row = self.decode_row(k, ctx, q.dtype)  # after the temperature
        grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or row.requires_grad)
        if grad or torch.compiler.is_compiling():
            if mask is not None:  # an allowed mask [B|1, H|1, 1, Lk]: padded keys drop out
                row = row.masked_fill(~mask, float("-inf"))
            return F.scaled_dot_product_attention(q, k, v, attn_mask=row, scale=scale)
        b, h, lk, d = k.shape
        if mask is not None:
            row.masked_fill_(~mask, float("-inf"))
        keys = k.reshape(b * h, lk, d).transpose(1, 2)  # a view of the cache's keys
        s = row.view(b * h, 1, lk).baddbmm_(q.reshape(b * h, 1, d), keys, alpha=scale)
        return torch.bmm(torch.softmax(s, dim=-1), v.reshape(b * h, lk, d)).view(b, h, 1, d)

    def blocked_attention(self, ctx: AttentionContext) -> Callable[..., Tensor] | None:
        """The causal fast form (the plan's ``own-blocked`` kernel): :func:`fox_attention` on the ``c`` of the call;
        a decoding step (one query of a causal FoX, ``decodes_itself``) in one pass, :meth:`_decode`.

        Calls with a mask beyond the causal one, and encoders, compute :meth:`logits`' ``[B, H, Lq, Lk]`` term
        here instead (correct, not blocked)."""
        if ctx.reference:
            return None

        def run(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, mask: Tensor | None) -> Tensor:
            if q.shape[-2] == 1 and self.causal and q.dtype in (torch.float32, torch.float64):
                return self._decode(q, k, v, scale, mask, ctx)
            if causal and mask is None and q.dtype in (torch.float32, torch.float64):
                return fox_attention(q, k, v, self._c(k, ctx), scale)
            s = torch.matmul(q, k.transpose(-1, -2)) + self.logits(q, k, ctx)
            s = s * scale
            lq, lk = q.shape[-2], k.shape[-2]
            if causal:
                i = torch.arange(lq, device=q.device)[:, None] + (lk - lq)
                s = s.masked_fill(torch.arange(lk, device=q.device)[None, :] > i, torch.finfo(s.dtype).min)
            if mask is not None:
                s = s.masked_fill(~mask, torch.finfo(s.dtype).min)
            return torch.matmul(torch.softmax(s, dim=-1), v)

        return run
