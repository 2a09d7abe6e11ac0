r"""Llama 4's attention temperature tuning: the queries of its NoPE layers grow with the log of the position.

Llama 4 (Meta, 2025; its "iRoPE" layers: RoPE in three layers of four, no position encoding in the fourth) gives
the layers without RoPE an *inference-time temperature*: the query at position ``p`` is multiplied by

.. math::
    m_p = 1 + \alpha \, \log\!\Big(1 + \Big\lfloor \frac{p + 1}{F} \Big\rfloor\Big),
    \qquad \alpha = \texttt{attn\_scale} = 0.1, \quad F = \texttt{floor\_scale} = 8192

(transformers' ``Llama4TextAttention``, ``attn_temperature_tuning``: ``torch.log1p(torch.floor((positions + 1) /
floor_scale)) * attn_scale + 1``; its comment cites Nakanishi's Scalable-Softmax, of which this is a fixed,
stepwise form). The factor is 1 up to position ``F - 2`` and grows by ``α log`` of the number of whole blocks of
``F`` positions, so the attention of far queries stays sharp where a softmax over more keys would flatten.

posenc reads ``p`` from the true query positions (``ctx.q_pos``); transformers takes the index in its KV cache
(``arange`` after the cached tokens), the same numbers wherever the positions are ``0, 1, 2 ...``. The factor is
computed in float32, as transformers computes it, and cast to the query's dtype.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..base import AttentionContext, Card
from ..registry import register
from ._wrapper import DEFAULT_INNER, QueryTemperature


@register
class Llama4Temperature(QueryTemperature):
    r"""Llama 4's query temperature over an inner encoding (default ``nope``, Llama 4's NoPE layers).

    .. math::
        q_p \leftarrow q_p \cdot \Big(1 + \alpha \log\big(1 + \lfloor (p + 1) / F \rfloor\big)\Big)

    applied after the inner encoding's rotation; every hook of the inner encoding stays as it is (see
    :mod:`posenc.temperature._wrapper`).

    Args:
        inner: the registered encoding of the layer (``"nope"``: Llama 4's NoPE layers; transformers applies the
            temperature only there).
        inner_options: settings of the inner encoding beyond the model's dimensions.
        floor_scale: ``F``, the width of the blocks of positions that share a factor (Llama 4: 8192); ``> 0``.
        attn_scale: ``α``, the strength (Llama 4: 0.1); ``>= 0`` (0: no temperature, the inner encoding alone).
        d_model, n_heads, head_dim, max_len, vocab_size, n_layers, causal, embedding_std: the model's
            dimensions, passed on to the inner encoding where it takes them.
    """

    info = Card(
        name="qtemp-llama4",
        title="Llama 4 attention temperature tuning (query × 1 + α log(1 + ⌊(p + 1)/F⌋))",
        paper="Meta AI, The Llama 4 herd (transformers' Llama4TextAttention, attn_temperature_tuning)",
        year=2025,
        family="temperature",
        position="absolute",
        learnable=False,
        summary="Query at position p times 1 + 0.1·log(1 + ⌊(p+1)/8192⌋), over NoPE (or any inner encoding).",
        reference="HF transformers Llama4TextAttention (attn_temperature_tuning on a NoPE layer)",
        aliases=("attn-temperature-tuning", "llama4-temperature"),
    )
    # the factor is a function of the absolute query position (scores change when every position shifts), one
    # number per block of floor_scale positions: positions inside a block are not told apart (no unique code)
    claims = dict(unique=None, relative_only=False)
    # a model built for max_len: blocks of an eighth of it, so that the factor changes within the trained length
    example_options = staticmethod(lambda dims: {"floor_scale": float(max(1, dims["max_len"] // 8))})
    option_limits = {
        "floor_scale": (lambda v: v > 0, "> 0 (the width of the blocks of positions that share a factor)"),
        "attn_scale": (
            lambda v: v >= 0,
            ">= 0 (0: no temperature; a negative one would turn far queries' factors negative)",
        ),
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
        floor_scale: float = 8192.0,
        attn_scale: float = 0.1,
    ):
        super().__init__()
        self.floor_scale, self.attn_scale = floor_scale, attn_scale
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

    def factors(self, positions: Tensor) -> Tensor:
        """``1 + α log1p(⌊(p + 1) / F⌋)`` for each position (float32, as transformers computes it)."""
        return torch.log1p(torch.floor((positions.float() + 1.0) / self.floor_scale)) * self.attn_scale + 1.0

    def factor(self, q: Tensor, ctx: AttentionContext) -> Tensor:
        return self.factors(ctx.q_pos)[:, None, :, None]  # [B|1, 1, Lq, 1]
