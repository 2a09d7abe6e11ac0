"""Measured properties and pictures of every encoding (``posenc inspect``).

The names below come from :mod:`posenc.analysis.properties`, imported on first use (PEP 562)
so that ``posenc inspect --help`` does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_names
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


__getattr__, __dir__ = lazy_names(__name__, dict.fromkeys(_FROM_PROPERTIES, "properties"))


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
