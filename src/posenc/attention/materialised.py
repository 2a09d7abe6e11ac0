"""The ``materialised`` kernel: the attention as written, the logits as one ``[B, H, Lq, Lk]`` tensor, its softmax
(the probabilities a caller may ask for) and the values. The reference path, ``return_weights``, a ``values`` hook
without a form, and transformers' logit soft-capping and attention sinks (:mod:`posenc.hf`) take it.

Imports only torch, :mod:`posenc.base`, :mod:`posenc.errors` and this package's call record.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from ..base import AttentionContext
from ..errors import ConfigError
from .call import _Call


def materialised(
    call: _Call,
    scale: float,
    dropout: float,
    terms: Callable[[_Call], tuple[Tensor | None, Tensor | None]],
    values: Callable[[Tensor, AttentionContext], Tensor | None] | None,
    *,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    probabilities: Callable[[Tensor, AttentionContext], Tensor | None] | None = None,
) -> tuple[Tensor, Tensor]:
    """``softmax(scale · (q kᵀ + logits) + bias + mask) v + values(probabilities)``, and the probabilities.

    ``terms(call)`` gives the encoding's ``logits`` and ``bias`` (or ``None`` each); it is asked after ``q·kᵀ`` is
    in ``ctx.scores``, for a logits hook that reads it (computed once). ``values`` is the encoding's ``values`` hook
    (``None``: none), given the probabilities after ``dropout``. ``softcap`` passes the scaled logits through
    ``softcap · tanh(x / softcap)`` before the bias (Gemma 2); ``sinks`` ``[H]`` adds one logit per head to the
    softmax whose probability is dropped (gpt-oss). ``probabilities`` is the encoding's ``probabilities`` hook
    (``None``: none): the weights it gives from the masked logits replace the softmax's (stick-breaking)."""
    q, k, v, ctx = call.q, call.k, call.v, call.ctx
    scores = torch.matmul(q, k.transpose(-1, -2))
    ctx.scores = scores  # for a logits hook that reads q·kᵀ (logits_read_scores): computed once
    extra, post = terms(call)
    if extra is not None:
        scores = scores + extra
    scores = scores * scale
    if softcap is not None:
        scores = torch.tanh(scores / float(softcap)) * float(softcap)
    if post is not None:
        scores = scores + post
    if call.allowed is not None:
        scores = scores.masked_fill(~call.allowed, torch.finfo(scores.dtype).min)
    own = probabilities(scores, ctx) if probabilities is not None else None
    if own is not None:
        if sinks is not None:
            raise ConfigError(
                "the encoding gives its own attention weights (a probabilities hook), which have no place for "
                "attention sinks (s_aux): use an encoding with softmax weights in this model"
            )
        weights = own
    elif sinks is not None:
        b, h, lq, _ = scores.shape
        sink = sinks.to(scores.dtype).reshape(1, h, 1, 1).expand(b, h, lq, 1)
        weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        weights = torch.softmax(scores, dim=-1)
    probs = F.dropout(weights, dropout) if dropout else weights
    out = torch.matmul(probs, v)
    if values is not None:
        av = values(probs, ctx)
        if av is not None:
            out = out + av
    return out, weights
