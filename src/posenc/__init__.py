"""posenc: positional encodings for Transformers, behind one interface.

>>> import posenc
>>> posenc.available()[:3]
['none', 'nope', 'binary']
>>> rope = posenc.get("rope", head_dim=64)

The names below are imported on first use (PEP 562), so ``import posenc`` -- and with it
``posenc --help`` -- does not import torch until something that needs it is used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import ConfigError, PosencError, PositionError, UnknownNameError

__version__ = "0.1.0"

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


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is not None:
        value = getattr(importlib.import_module(f".{module}", __name__), name)
        globals()[name] = value
        return value
    if not name.startswith("__"):
        # a submodule (posenc.attention, posenc.native ...): `import posenc` used to load several
        try:
            return importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


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
