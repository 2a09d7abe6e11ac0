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

**A reference path only.** The weights are a ``[B, H, Lq, Lk]`` tensor (:meth:`StickBreaking.probabilities`, the
attention's ``probabilities`` hook, which the ``materialised`` kernel calls with the masked logits), for lengths
up to a few thousand: a call of more keys than :data:`MAX_KEYS`, or more query-key pairs than :data:`MAX_PAIRS`
over the batch and heads, is refused with the limit named. The authors' kernels (Triton, CUDA) stream the keys
instead; none is ported here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..base import AttentionContext, Card, Cost, PositionalEncoding
from ..errors import ConfigError
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
        "(reference path: materialised, up to 4096 keys)",
        reference="the paper's product written out in loops, float64: max diff 3.3e-16 (and the cumulative form in log "
        "space); KV cache == none",
        shortcoming="a reference path only (the [B, H, Lq, Lk] weights): O(L²) memory; an encoder breaks the stick by "
        "distance, posenc's extension",
    )
    claims = {"relative_only": True, "decay": True, "params_constant": True}

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
            memory="the [B, H, Lq, Lk] weights (a reference path: no blocked kernel)",
            note="the stick's running sum per pair in log space; materialised",
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
