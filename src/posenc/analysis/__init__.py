"""Measured properties and pictures of every encoding (``posenc inspect``)."""

from .properties import (
    PROPERTIES,
    PROPERTY_KEYS,
    Measurement,
    Probe,
    Report,
    Unmeasurable,
    claims_for,
    measure,
    measure_all,
)

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
