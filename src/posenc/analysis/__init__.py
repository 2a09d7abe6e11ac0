"""Measured properties and pictures of every encoding (``posenc inspect``).

The names below come from :mod:`posenc.analysis.properties`, imported on first use (PEP 562)
so that ``posenc inspect --help`` does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .names import PROPERTIES

_FROM_PROPERTIES = frozenset(
    {"PROPERTY_KEYS", "Measurement", "Probe", "Report", "Unmeasurable", "claims_for", "measure", "measure_all"}
)

if TYPE_CHECKING:
    from .properties import (
        PROPERTY_KEYS,
        Measurement,
        Probe,
        Report,
        Unmeasurable,
        claims_for,
        measure,
        measure_all,
    )


def __getattr__(name: str) -> Any:
    if name in _FROM_PROPERTIES:
        value = getattr(importlib.import_module(".properties", __name__), name)
        globals()[name] = value
        return value
    if not name.startswith("__"):
        try:
            return importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_FROM_PROPERTIES})


__all__ = [
    "PROPERTIES",
    "PROPERTY_KEYS",
    "Measurement",
    "Probe",
    "Report",
    "Unmeasurable",
    "claims_for",
    "measure",
    "measure_all",
]
