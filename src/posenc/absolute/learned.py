"""Learned absolute position embeddings (BERT, GPT)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..base import Card
from ..errors import ConfigError
from ..registry import register
from ._additive import AdditiveAbsolute


@register
class LearnedAbsolute(AdditiveAbsolute):
    r"""A trained vector per position (Devlin et al. 2019; Radford et al. 2018; Gehring et al. 2017).

    .. math:: PE_{pos} = P[pos], \quad P \in \mathbb{R}^{L_{max} \times d}

    As in HF BERT's ``BertEmbeddings``: ``nn.Embedding(max_position_embeddings,
    hidden_size)`` initialised from N(0, 0.02²), looked up by position id and
    added to the token embeddings. The table starts at the scale of the token
    embeddings it is added to (``embedding_std``, passed by posenc's models: 1 when
    they scale tokens as Vaswani et al., 0.02 as BERT otherwise; ``init_std``
    overrides it). Shortcoming (Xixiaoyao, "Three positional encoding methods";
    anon., "Positional Encoding"): nothing ties
    one position to the next, the parameters grow linearly with ``max_len``,
    and positions ``>= max_len`` have no vector at all -- asking for one is an
    error that names the limit.
    """

    info = Card(
        name="learned",
        title="Learned absolute position embedding",
        paper="Devlin et al., BERT / Radford et al., GPT",
        year=2018,
        family="absolute",
        position="absolute",
        learnable=True,
        summary="A trained vector per position, up to max_len.",
        reference="HF transformers BertEmbeddings with the same weights",
        shortcoming="undefined past max_len; parameters grow with max_len",
    )
    randomized_variant = True
    claims = {"unique": True}
    scale_token_embeddings = False  # BERT / GPT: small tokens and positions alike

    def __init__(
        self, d_model: int, max_len: int = 512, init_std: float | None = None, embedding_std: float | None = None
    ):
        super().__init__()
        if max_len < 1 or d_model < 1:
            raise ConfigError(f"d_model and max_len must be positive, got {d_model} and {max_len}")
        std = init_std if init_std is not None else (embedding_std if embedding_std is not None else 0.02)
        if std <= 0:
            raise ConfigError(f"init_std must be > 0, got {std}")
        self.d_model, self.max_len, self.init_std = d_model, max_len, std
        self.weight = nn.Parameter(torch.empty(max_len, d_model))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.init_std)

    def table(self, positions: Tensor) -> Tensor:
        return self.weight[positions]
