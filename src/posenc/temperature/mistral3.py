r"""Mistral 3's query scaling (``llama_4_scaling_beta``): the query grows with the log of whole trained contexts.

Ministral 3 and Mistral 4 (Mistral AI, 2025) multiply the query of every layer, after its RoPE (YaRN in their
checkpoints), by

.. math::
    m_p = 1 + \beta \, \log\!\Big(1 + \Big\lfloor \frac{p}{L_0} \Big\rfloor\Big),
    \qquad \beta = \texttt{llama\_4\_scaling\_beta} = 0.1, \quad L_0 = \texttt{original\_max\_position\_embeddings}

(transformers' ``get_llama_4_attn_scale`` in ``models/ministral3/modeling_ministral3.py``: ``1 + beta *
torch.log(1 + torch.floor(position_ids / original_max_position_embeddings))``). The factor is 1 within the trained
context ``L_0`` and grows by ``β log`` of the number of whole contexts beyond it: Llama 4's temperature
(:mod:`posenc.temperature.llama4`) with ``p`` for ``p + 1``, the trained length for the block width, and on every
layer rather than on the NoPE ones.

``p`` is the true query position (``ctx.q_pos``; transformers reads ``position_ids``). The factor is computed in
float32, as transformers computes it (under the default float32 dtype), and cast to the query's dtype.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..base import AttentionContext, Card
from ..errors import ConfigError
from ..registry import register
from ._wrapper import DEFAULT_INNER, QueryTemperature


@register
class Mistral3Temperature(QueryTemperature):
    r"""Mistral 3's query scaling over an inner encoding (default ``nope``; Mistral 3 itself: ``rope-yarn``).

    .. math::
        q_p \leftarrow q_p \cdot \Big(1 + \beta \log\big(1 + \lfloor p / L_0 \rfloor\big)\Big)

    applied after the inner encoding's rotation; every hook of the inner encoding stays as it is (see
    :mod:`posenc.temperature._wrapper`). As in transformers' Mistral 3, ``L_0`` is also the inner encoding's
    ``original_max_len`` (YaRN's, say) unless ``inner_options`` sets that.

    Args:
        inner: the registered encoding of the layers (Mistral 3: ``"rope-yarn"``, with ``inner_options`` such as
            ``{"factor": 16.0, "base": 1e6}``).
        inner_options: settings of the inner encoding beyond the model's dimensions.
        beta: ``β`` (Mistral 3: 0.1); ``>= 0`` (0: no scaling, the inner encoding alone).
        original_max_len: ``L_0``, the context the model was trained on (transformers'
            ``original_max_position_embeddings``; Ministral 3: 16384); default the model's ``max_len``.
        d_model, n_heads, head_dim, max_len, vocab_size, n_layers, causal, embedding_std: the model's
            dimensions, passed on to the inner encoding where it takes them.
    """

    info = Card(
        name="qtemp-mistral3",
        title="Mistral 3 query scaling (query × 1 + β log(1 + ⌊p/L₀⌋), llama_4_scaling_beta)",
        paper="Mistral AI, Ministral 3 / Mistral 3 (transformers' get_llama_4_attn_scale, llama_4_scaling_beta)",
        year=2025,
        family="temperature",
        position="absolute",
        learnable=False,
        summary="Query at position p times 1 + β·log(1 + ⌊p/L₀⌋) after the inner encoding (Mistral 3: YaRN).",
        reference="HF transformers Ministral3Attention (get_llama_4_attn_scale)",
        aliases=("mistral3-temperature", "llama-4-scaling-beta"),
    )
    # the factor is a function of the absolute query position (scores change when every position shifts), one
    # number per whole trained context L_0: positions inside one are not told apart (no unique code)
    claims = dict(unique=None, relative_only=False)
    # a model built for max_len positions from one trained on max_len / 2 (as the RoPE scalings' examples)
    example_options = staticmethod(lambda dims: {"original_max_len": max(1, dims["max_len"] // 2)})
    option_limits = {
        "beta": (lambda v: v >= 0, ">= 0 (0: no scaling; a negative one would turn far queries' factors negative)"),
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
        beta: float = 0.1,
        original_max_len: int | None = None,
    ):
        super().__init__()
        if original_max_len is None:
            if max_len is None:
                raise ConfigError(
                    "encoding 'qtemp-mistral3' needs original_max_len, the context length the model was trained on "
                    "(transformers' original_max_position_embeddings, e.g. 16384 for Ministral 3), or max_len "
                    "(a model passes its own, and original_max_len defaults to it)"
                )
            original_max_len = max_len
        self.beta, self.original_max_len = beta, original_max_len
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
        self._wrap(inner, inner_options, dims, shared={"original_max_len": original_max_len})

    def factors(self, positions: Tensor) -> Tensor:
        """``1 + β log(1 + ⌊p / L_0⌋)`` for each position (float32, as transformers computes it)."""
        return 1 + self.beta * torch.log(1 + torch.floor(positions.float() / self.original_max_len))

    def factor(self, q: Tensor, ctx: AttentionContext) -> Tensor:
        return self.factors(ctx.q_pos)[:, None, :, None]  # [B|1, 1, Lq, 1]
