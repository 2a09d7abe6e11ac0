r"""Scalable-Softmax, SSMax (Nakanishi 2025): the logits of a query times ``s · log n``, n the keys it attends.

Nakanishi, "Scalable-Softmax Is Superior for Attention" (arXiv 2501.19399). The largest output of a softmax over
``n`` inputs shrinks towards 0 as ``n`` grows ("attention fading"); SSMax replaces the softmax over a query's
``n`` logits ``z`` by

.. math::
    \mathrm{SSMax}(z)_j = \frac{n^{s z_j}}{\sum_{j'} n^{s z_{j'}}}
    = \frac{e^{(s \log n) z_j}}{\sum_{j'} e^{(s \log n) z_{j'}}}

with ``s`` a learnable scalar of each layer and head, which keeps the largest weight near 1 whatever ``n``. In
attention that is the ordinary softmax of the logits times ``s log n``, i.e. the query multiplied by ``s log n``
(the paper's own remark on implementing it); the paper's variant with a bias, ``s log n + b`` (``b`` learnable per
layer and head), is ``learn_bias=True``.

``n`` is the number of keys query ``i`` attends: ``i + 1`` for causal attention at positions ``0, 1, ...``, the
sequence length for a bidirectional encoder, and with padding or packed documents the keys the mask leaves it
(the size of the softmax's input, as the paper defines it). posenc's attention (:class:`posenc.MultiHeadAttention`
and the models) knows the mask when the query is scaled (``ctx.n_keys``) and counts it; where the mask is not
known yet (``posenc.hf``, the analysis probes), ``n`` is the number of keys at positions up to the query's
(``causal=True``, the default) or all keys (``causal=False``). A query that sees no key (left padding) gets
``n = 1`` (a factor ``log 1 = 0``; its output is zero in any case). A KV-cache step counts the cached keys: the
same ``n`` as recomputing the whole sequence.

Initialisation of ``s``. The paper's text was not at hand here (only its abstract): the value used is the one that
secondary sources report for the paper's 1024-token pretraining, ``s = 0.168``, which is ``1 / mean_{n=1..1024}
log n = 0.1685``: the ``s`` for which the average factor ``s log n`` over a causal training sequence is 1, so that
SSMax starts as the ordinary softmax on average. posenc uses that rule at the model's ``max_len`` (a causal model:
``s = max_len / log(max_len!)``; a bidirectional one, where every query has ``n = max_len`` keys:
``s = 1 / log max_len``); ``s_init`` sets it directly.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from ..base import AttentionContext, Card, Cost, is_arange_rows
from ..errors import ConfigError
from ..registry import register
from ._wrapper import DEFAULT_INNER, QueryTemperature


def key_counts(ctx: AttentionContext, causal: bool) -> Tensor:
    """The number of keys each query attends: ``[B|1, 1|H, Lq]`` (integers), read from ``ctx.mask`` where the
    attention has set it before the ``rotate`` hook (``ctx.n_keys`` given: a KV-cache step's ``k_pos`` then holds
    the new keys only, and no mask means all ``n_keys``), else from the positions: the keys at positions up to the
    query's (``causal``) or every key."""
    if ctx.n_keys is not None:
        if ctx.mask is not None:
            return ctx.mask.sum(-1)
        return torch.full((1, 1, ctx.q_pos.shape[-1]), ctx.n_keys, device=ctx.q_pos.device)
    lk = ctx.k_pos.shape[-1]
    if not causal:
        return torch.full((1, 1, ctx.q_pos.shape[-1]), lk, device=ctx.q_pos.device)
    q_pos, k_pos = ctx.q_pos, ctx.k_pos
    if is_arange_rows(q_pos, ctx.cache) and is_arange_rows(k_pos, ctx.cache):
        n = (q_pos - k_pos[:, :1] + 1).clamp(0, lk)  # keys start + 0 .. start + lk - 1
    else:
        n = (k_pos[:, None, :] <= q_pos[:, :, None]).sum(-1)
    return n[:, None]


@register
class SSMax(QueryTemperature):
    r"""Scalable-Softmax: each query times ``s_h log n_i`` (``+ b_h`` with ``learn_bias``), after the inner encoding.

    .. math::
        a_{ij} = \mathrm{softmax}_j\big((s_h \log n_i)\, z_{ij}\big), \qquad
        z_{ij} = q_i^\top k_j / \sqrt{d_h}, \quad n_i = |\{j : i \text{ attends } j\}|

    ``s_h`` (and ``b_h``) are learned per layer and head. The inner encoding's hooks stay as they are (see
    :mod:`posenc.temperature._wrapper`; NoPE by default, as in the layers Llama 4 gives a temperature).

    Args:
        n_heads: heads (one ``s`` each).
        max_len: the training context, from which ``s`` is initialised (see the module docstring).
        causal: whether the model is causal (the initial ``s``, and ``n`` where the mask is not known; default
            True, the paper's language models).
        s_init: the initial ``s`` of every head instead of the rule above.
        learn_bias: the paper's variant ``s log n + b`` (``b`` per head, initialised to 0).
        inner, inner_options: the registered encoding of the layer and its settings.
        d_model, head_dim, vocab_size, n_layers, embedding_std: the model's dimensions, passed on to the inner
            encoding where it takes them.
    """

    info = Card(
        name="ssmax",
        title="Scalable-Softmax (SSMax): query × s·log n",
        paper="Nakanishi, Scalable-Softmax Is Superior for Attention",
        year=2025,
        family="temperature",
        position="none",
        learnable=True,
        summary="Logits of query i times s_h·log n_i (n_i: keys it attends, s_h learned per layer and head).",
        reference="the paper's formula (logits × s·log n, then softmax) at random shapes, masks and padding",
        aliases=("scalable-softmax",),
    )
    # no position of its own (what the mask shows); the factor s·log n grows without bound with the keys a query
    # sees (the point of the paper: the largest weight does not fade), so the scores are not bounded; one s (and b)
    # per head whatever max_len; a query's scores depend on the sequence's length where it sees every key
    # (bidirectional), not in a causal model: no claim of consistency either way
    claims = dict(bounded=False, params_constant=True, consistent=None)
    shared_across_layers = False  # s (and b) are per layer and head
    option_limits = {
        "s_init": (
            lambda v: v > 0,
            "> 0 (the factor s·log n on every logit; 0 erases the scores, a negative s inverts every softmax)",
        )
    }

    def __init__(
        self,
        d_model: int | None = None,
        n_heads: int | None = None,
        head_dim: int | None = None,
        max_len: int | None = None,
        vocab_size: int | None = None,
        n_layers: int | None = None,
        causal: bool | None = None,
        embedding_std: float | None = None,
        inner: str = DEFAULT_INNER,
        inner_options: dict[str, Any] | None = None,
        s_init: float | None = None,
        learn_bias: bool = False,
    ):
        super().__init__()
        if n_heads is None:
            raise ConfigError("encoding 'ssmax' needs n_heads (one learned s per head); a model passes its own")
        self.n_heads = n_heads
        self.causal = True if causal is None else causal
        if s_init is None:
            if max_len is None or max_len < 2:
                raise ConfigError(
                    f"encoding 'ssmax' initialises s from the training context max_len (>= 2), got max_len={max_len!r}"
                    "; pass max_len (a model passes its own) or s_init (e.g. s_init=0.168, the paper's value at "
                    "1024 tokens)"
                )
            mean_log = math.lgamma(max_len + 1) / max_len if self.causal else math.log(max_len)
            s_init = 1.0 / mean_log
        self.s_init, self.learn_bias = float(s_init), learn_bias
        self.s = nn.Parameter(torch.full((n_heads,), self.s_init))
        self.b = nn.Parameter(torch.zeros(n_heads)) if learn_bias else None
        dims = dict(
            d_model=d_model,
            n_heads=n_heads,
            head_dim=head_dim,
            max_len=max_len,
            vocab_size=vocab_size,
            n_layers=n_layers,
            causal=causal,
            embedding_std=embedding_std,
        )
        self._wrap(inner, inner_options, dims)
        self.shared_across_layers = False  # type: ignore[misc]  # whatever the inner encoding's

    def reset_parameters(self) -> None:
        super().reset_parameters()
        with torch.no_grad():
            self.s.fill_(self.s_init)
            if self.b is not None:
                self.b.zero_()

    def factor(self, q: Tensor, ctx: AttentionContext) -> Tensor:
        n = key_counts(ctx, self.causal).clamp(min=1).to(self.s.dtype)  # [B|1, 1|H, Lq]
        m = self.s[:, None] * n.log()  # [B|1, H, Lq]
        if self.b is not None:
            m = m + self.b[:, None]
        return m[..., None]

    def factor_cost(self, head_dim: int) -> Cost:
        # n_i counts the mask's row: one add per pair, shared by the heads; s·log n (+ b) per query and head
        return Cost(
            pair_elementwise=1.0 / self.n_heads,
            token_elementwise=3.0,
            note="n_i: one add per (query, key) pair shared by the heads; s·log n_i + b per query and head",
        )
