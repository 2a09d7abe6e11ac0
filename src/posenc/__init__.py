"""posenc: positional encodings for Transformers, behind one interface.

>>> import posenc
>>> posenc.available()[:3]
['none', 'binary', 'complex-order']
>>> rope = posenc.get("rope", head_dim=64)
"""

from __future__ import annotations

from .attention import KVCache, MultiHeadAttention, build_mask
from .base import AttentionContext, Card, PositionalEncoding
from .errors import ConfigError, PosencError, PositionError, UnknownNameError
from .models import (
    Decoder,
    Encoder,
    LanguageModel,
    SequenceClassifier,
    TokenTagger,
    Transformer,
    TransformerOutput,
)
from .registry import available, card, get, register, resolve

__version__ = "0.1.0"

__all__ = [
    "AttentionContext",
    "Card",
    "ConfigError",
    "Decoder",
    "Encoder",
    "KVCache",
    "LanguageModel",
    "MultiHeadAttention",
    "PosencError",
    "PositionError",
    "PositionalEncoding",
    "SequenceClassifier",
    "TokenTagger",
    "Transformer",
    "TransformerOutput",
    "UnknownNameError",
    "__version__",
    "available",
    "build_mask",
    "card",
    "get",
    "register",
    "resolve",
]
