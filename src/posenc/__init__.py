"""posenc: positional encodings for Transformers, behind one interface.

>>> import posenc
>>> posenc.available()[:3]
['none', 'nope', 'binary']
>>> rope = posenc.get("rope", head_dim=64)

The names below are imported on first use (PEP 562), so ``import posenc`` -- and with it
``posenc --help`` -- does not import torch until something that needs it is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_names
from ._version import __version__
from .errors import ConfigError, PosencError, PositionError, UnknownNameError

# public name -> the submodule that defines it
_LAZY: dict[str, str] = {
    "KVCache": "attention",
    "MultiHeadAttention": "attention",
    "build_mask": "attention",
    "AttentionContext": "base",
    "Card": "base",
    "PositionalEncoding": "base",
    "Decoder": "models",
    "Encoder": "models",
    "LanguageModel": "models",
    "SequenceClassifier": "models",
    "TokenTagger": "models",
    "Transformer": "models",
    "TransformerOutput": "models",
    "available": "registry",
    "card": "registry",
    "get": "registry",
    "register": "registry",
    "resolve": "registry",
    "Schedule": "schedule",
    # ``schedule`` is the submodule itself, which is callable: posenc.schedule("rope*3+nope")
}

if TYPE_CHECKING:  # what type checkers and IDEs see: the eager imports
    from .attention import KVCache, MultiHeadAttention, build_mask
    from .base import AttentionContext, Card, PositionalEncoding
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
    from .schedule import Schedule, schedule


__getattr__, __dir__ = lazy_names(__name__, _LAZY)


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
    "Schedule",
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
    "schedule",
]
