r"""PaTH, position encoding by accumulated Householder transformations (Yang, Shen, Wen, Tan, Mishra, Ren, Panda and
Kim 2025, "PaTH Attention: Position Encoding via Accumulating Householder Transformations").

RoPE puts a fixed rotation ``R^{i-j}`` between query ``i`` and key ``j``; PaTH puts the product of one data-dependent
Householder-like matrix per token between them (the paper's equation 2):

.. math::
    H_t = I - \beta_t\, w_t w_t^\top, \qquad
    A_{ij} = \operatorname{softmax}_j\Big(\frac{1}{\sqrt d}\, q_i^\top \Big(\prod_{t=i}^{j+1} H_t\Big) k_j\Big)
    \quad (j \le i)

the product running from ``H_i`` (next to ``q_i``) down to ``H_{j+1}`` (next to ``k_j``; empty for ``j = i``), with
``w_t`` a unit vector and ``β_t ∈ (0, 2)`` per head and token (``β = 2``: a reflection).

**Where ``w_t`` and ``β_t`` come from.** The paper computes them from the layer's input ``x_t`` (a low-rank
projection and a short convolution, L2-normalised, for ``w``; ``2σ(·)`` for ``β``). posenc's hooks see the keys,
so here ``w_t = normalize(W_w k_t)`` and ``β_t = 2σ(W_β k_t + b_β)`` with ``k_t`` the token's keys of every head
(an affine function of ``x_t``, as FoX's gates: see :mod:`posenc.bias.fox`), and no short convolution.

**Without a causal mask** (an encoder) the key ``j > i`` gets the transforms of the tokens after ``i`` up to ``j``,
from the query's side: ``q_i^T H_{i+1} ... H_j k_j`` (posenc's symmetric extension).

**A reference path only.** :meth:`PaTH.logits` returns the PaTH logit minus ``q_i·k_j`` (the attention adds
``q·k`` back): the ``[B, H, Lq, Lk]`` logits, computed by carrying every query through the transforms one key back
at a time (``Lk`` steps of ``[B, H, Lq, d]`` work: ``O(L²·d)``, as attention itself, and as much memory under
autograd). A call of more keys than :data:`MAX_KEYS`, or more than :data:`MAX_GRAD_NUMBERS` numbers to keep for
the gradient, is refused with the limit named. The paper's blocked (WY / UT) algorithm and its kernels are not
ported.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..base import AttentionContext, Card, Cost, PositionalEncoding
from ..errors import ConfigError
from ..registry import register

#: the most keys one call may have: the logits are materialised and the transforms applied one key at a time
MAX_KEYS = 4096
#: the most numbers (batch × heads × queries × keys × head_dim) the steps may keep for autograd
MAX_GRAD_NUMBERS = 2**29


def path_logits(q: Tensor, k: Tensor, w: Tensor, beta: Tensor, future: bool = True) -> Tensor:
    r"""``q_i^T (Π_{t=i..j+1} H_t) k_j`` for ``j <= i`` and ``q_i^T (Π_{t=i+1..j} H_t) k_j`` for ``j > i``:
    ``[B, H, Lq, Lk]``, the queries the last ``Lq`` of the ``Lk`` tokens (``future=False``: zero for ``j > i``).

    ``q`` ``[B, H, Lq, d]``, ``k`` and ``w`` (unit vectors) ``[B, H, Lk, d]``, ``beta`` ``[B, H, Lk]``. Each
    query's row vector ``r = q_i^T`` is carried one key back (``r ← r H_{j+1}``, ``H`` symmetric: ``r - β (r·w) w``)
    and, for ``future``, one key forward, all queries at once; the logits are gathered by offset."""
    b, h, lq, d = q.shape
    lk = k.shape[2]
    own = torch.arange(lq, device=q.device) + (lk - lq)  # the queries' key indices
    keys = torch.arange(lk, device=q.device)
    offset = own[:, None] - keys[None, :]  # i - j
    parts = []
    for direction, steps in ((-1, lk), (1, lq if future else 1)):
        r = q
        by_offset = [(q * k[:, :, own]).sum(-1)] if direction < 0 else [torch.zeros_like(q[..., 0])]
        for s in range(1, steps):
            j = own + direction * s  # the key s steps away; the transform next to its query side
            valid = ((j >= 0) & (j < lk)).to(q.dtype)
            t = (j + 1 if direction < 0 else j).clamp(0, lk - 1)
            wt = w[:, :, t]  # [B, H, Lq, d]
            r = r - (beta[:, :, t] * (r * wt).sum(-1) * valid)[..., None] * wt
            by_offset.append((r * k[:, :, j.clamp(0, lk - 1)]).sum(-1) * valid)
        table = torch.stack(by_offset, dim=-1)  # [B, H, Lq, steps]: the logit of the key s steps away
        dist = (offset if direction < 0 else -offset).clamp(0, table.shape[-1] - 1)
        seen = (offset >= 0) if direction < 0 else (offset < 0) & (-offset < table.shape[-1])
        parts.append(table.gather(-1, dist.expand(b, h, lq, lk)) * seen.to(q.dtype))
    return parts[0] + parts[1]


@register
class PaTH(PositionalEncoding):
    r"""PaTH: ``q_i^T H_i H_{i-1} ... H_{j+1} k_j`` with ``H_t = I - β_t w_t w_t^T`` from each token's keys.

    Args:
        n_heads: heads (one ``w_t`` and ``β_t`` per head and token).
        head_dim: width of one head.
    """

    info = Card(
        name="path",
        title="PaTH (accumulated Householder transformations)",
        paper="Yang, Shen, Wen, Tan, Mishra, Ren, Panda, Kim, PaTH Attention: Position Encoding via Accumulating "
        "Householder Transformations",
        year=2025,
        family="relative",
        position="relative",
        learnable=True,
        summary="q_i^T (Π_{t=j+1..i} (I - β_t w_t w_t^T)) k_j: data-dependent Householder products between query "
        "and key, w and β from the keys (reference path: materialised, up to 4096 keys)",
        reference="the paper's matrix product written out per pair (d x d matrices), float64: max diff 1.4e-16; KV "
        "cache == none",
        shortcoming="a reference path only (O(L²) logits, L steps; O(L²·d) memory under autograd); w and β from the "
        "keys without the paper's short convolution",
    )
    shared_across_layers = False
    claims = {"relative_only": True, "params_constant": True}

    def __init__(self, n_heads: int, head_dim: int):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, head_dim
        self.w_proj = nn.Linear(n_heads * head_dim, n_heads * head_dim, bias=False)
        self.beta_proj = nn.Linear(n_heads * head_dim, n_heads)

    def cost(self, head_dim: int) -> Cost:
        # per token and head: w = W_w k (2·H·d·d products: a d-vector from the token's H·d keys) and β (2·H·d). Per
        # pair and head: the transformed query against the key, q_i^T (Π H) k_j, one more d-product than q·k
        # (2·d) where the paper's blocked algorithm forms the transforms as products of blocks (UT / WY), and the
        # add (1). The reference here carries each query through every key elementwise (~6·d per pair) instead.
        return Cost(
            pair=2.0 * head_dim,
            pair_elementwise=1.0,
            token=2.0 * self.n_heads * head_dim * (head_dim + 1),
            memory="the [B, H, Lq, Lk] logits, and O(L²·d) under autograd (a reference path)",
            note="one more d-product per pair (the transformed query); the reference path materialises the logits",
        )

    def transforms(self, k: Tensor) -> tuple[Tensor, Tensor]:
        """``w_t`` (unit, ``[B, H, L, d]``) and ``β_t ∈ (0, 2)`` (``[B, H, L]``) from the keys ``[B, Hk, L, d]``
        (grouped keys serve their group of query heads)."""
        b, h, n, d = k.shape
        if d != self.head_dim or h > self.n_heads or self.n_heads % h:
            raise ConfigError(
                f"path was built for n_heads={self.n_heads}, head_dim={self.head_dim} but got keys of {h} heads of "
                f"width {d}; it takes keys of width head_dim, one head per query head or grouped"
            )
        if h < self.n_heads:
            k = k.repeat_interleave(self.n_heads // h, dim=1)
        flat = k.transpose(1, 2).reshape(b, n, self.n_heads * d)
        w = F.normalize(self.w_proj(flat).view(b, n, self.n_heads, d), dim=-1).transpose(1, 2)
        beta = 2.0 * torch.sigmoid(self.beta_proj(flat)).transpose(1, 2)
        return w, beta

    def logits(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> Tensor:
        b, h, lq, d = q.shape
        lk = k.shape[2]
        if lk < lq:
            raise ConfigError(f"path: a call has {lk} keys for {lq} queries; the queries must be the last of the keys")
        if lk > MAX_KEYS:
            raise ConfigError(
                f"path is a reference implementation (materialised logits, one step per key): a call of {lk} keys is "
                f"more than its limit of {MAX_KEYS}; use shorter sequences"
            )
        if torch.is_grad_enabled() and b * h * lq * lk * d > MAX_GRAD_NUMBERS:
            raise ConfigError(
                f"path is a reference implementation whose gradient keeps batch x heads x queries x keys x head_dim "
                f"= {b} x {h} x {lq} x {lk} x {d} numbers, more than its limit of {MAX_GRAD_NUMBERS}; use a smaller "
                "batch or shorter sequences (or torch.no_grad() for inference)"
            )
        w, beta = self.transforms(k)
        # the keys after a query are needed without a mask, or where the mask shows one (an encoder)
        future = ctx.mask is None or torch.compiler.is_compiling()
        if not future:
            later = torch.arange(lk, device=q.device)[None, :] > torch.arange(lq, device=q.device)[:, None] + lk - lq
            future = bool((ctx.mask & later).any())
        full = path_logits(q, k, w.to(q.dtype), beta.to(q.dtype), future)
        return full - torch.matmul(q, k.transpose(-1, -2))
