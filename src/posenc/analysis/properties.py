"""Measured properties of a positional encoding (``posenc inspect``).

The articles posenc started from (docs/background.md) argue about what makes an
encoding good. Each claim becomes a measurement here, for any registered encoding:

==================  ===========================================================================
property            measured as
==================  ===========================================================================
unique              absolute codes: smallest ``||PE_i - PE_j||`` over positions ``i != j < L``;
                    attention-level encodings: smallest distance between the score profiles of
                    two different offsets (a query looking ``0 .. L-1`` positions back)
continuous          one step moves the code by about the same amount everywhere
                    (largest / median step <= 1.5) and by less than a typical distance
                    (median step / median distance <= 0.5)
bounded             from length L to 8L, the mean ``|PE|`` (``|score|``) over the farthest 10% of
                    positions grows by at most 1.2x, or the largest value by at most 1.05x
consistent          the code (scores) of the first ``L_s`` positions is the same in a sequence of
                    length ``L_s`` and of length ``L``
linear_offset       least-squares ``T_k`` with ``PE_{t+k} ≈ T_k PE_t`` has a relative residual < 1e-3
direction_aware     ``score(t, t+k) != score(t, t-k)`` (raw dot products for absolute codes)
relative_only       scores unchanged when every position shifts by a constant
decay               the mean score falls with ``|i-j|`` (rank correlation <= -0.5)
extrapolates        defined and finite past the trained length, in the range seen within it
params_constant     the number of parameters does not grow with ``max_len``
==================  ===========================================================================

Encodings that act inside attention (rotate, logits, bias, scale) are
measured on the attention scores they induce,
``A = scale · (q·k + logits) + bias`` after ``rotate``, with a fixed random
content vector at every position (so that ``A`` depends on positions only),
never on an embedding table. Absolute encodings are measured on their codes
(``PE_t``), and their scores are the raw dot products ``PE_i · PE_j`` that
Wu (2022) and Xixiaoyao, "Three positional encoding methods" analyse, with the dot
product through a random ``W`` (the TENER figure) reported alongside.

A property that cannot be measured for an encoding (no table past its
length, no per-position code, a hook that fails on the probe) is reported as
``n/a (reason)``; nothing here raises for a registered encoding that builds.

This module holds what a property card is made of and how it is made: the claims (:func:`claims_for`), the
card (:class:`Report`), the table of measures (:data:`MEASURES`) and :func:`measure`. The measures live by
family: :mod:`~posenc.analysis.geometry` (unique, continuous, bounded, consistent), :mod:`~posenc.analysis.offsets`
(linear_offset, direction_aware, relative_only, decay) and :mod:`~posenc.analysis.length` (extrapolates,
params_constant), each measured through a :class:`~posenc.analysis.probe.Probe`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..base import Card, PositionalEncoding
from ..errors import ConfigError
from ..registry import available, registered_class, resolve
from .geometry import measure_bounded, measure_consistent, measure_continuous, measure_unique
from .length import measure_extrapolates, measure_params
from .measurement import REL_TOL, Measurement, mean_score_by_offset, offset_profiles
from .names import PROPERTIES, PROPERTY_KEYS, PROPERTY_MEANING, PROPERTY_TITLES
from .offsets import measure_decay, measure_direction, measure_linear_offset, measure_relative_only
from .probe import ATTENTION_HOOKS, Probe, Unmeasurable, _short, check_settings, single_thread

# shortcoming phrases -> (property, claimed value)
_SHORTCOMING_RULES: tuple[tuple[tuple[str, ...], str, bool], ...] = (
    (("unbounded",), "bounded", False),
    (("inconsistent across lengths", "depends on the length"), "consistent", False),
    (("discontinuous",), "continuous", False),
    (("no linear map",), "linear_offset", False),
    (("symmetric in the offset", "no direction"), "direction_aware", False),
    (("undefined past", "not defined past"), "extrapolates", False),
    (("grow with max_len", "grows with max_len", "parameters grow"), "params_constant", False),
    (("no positional information",), "unique", False),
)


def claims_for(card: Card, encoding_class: type[PositionalEncoding] | None = None) -> dict[str, bool | None]:
    """What the encoding claims, property by property (``None``: no claim).

    The mapping: ``position="none"`` claims no unique code, no direction, no decay and
    (trivially) relative-only scores; ``position="absolute"`` claims a unique code per position;
    ``position="relative"`` claims relative-only scores; ``learnable=False`` claims a parameter
    count that does not grow with the length; phrases of the card's ``shortcoming`` (for
    example "unbounded", "undefined past max_len", "no direction") claim the property fails;
    the class's own ``claims`` (declared in its file: the background articles' and papers' claims) come last.
    ``encoding_class`` is the encoding's class (default: the one registered as ``card.name``, if any).
    """
    out: dict[str, bool | None] = {k: None for k in PROPERTY_KEYS}
    if card.position == "none":
        out.update(unique=False, direction_aware=False, decay=False, relative_only=True)
    elif card.position == "absolute":
        out["unique"] = True
    elif card.position == "relative":
        out["relative_only"] = True
    if not card.learnable:
        out["params_constant"] = True
    if encoding_class is None:
        encoding_class = registered_class(card.name)
    if encoding_class is not None:
        out.update(encoding_class.claims)
    text = f"{card.shortcoming}".lower()
    for phrases, key, value in _SHORTCOMING_RULES:
        if any(p in text for p in phrases):
            out[key] = value
    return out


@dataclass
class Report:
    """The property card of one encoding."""

    name: str
    card: Card
    settings: dict[str, Any]
    kind: str  # "code" (absolute, measured on PE_t), "attention" (measured on scores) or "unbuilt"
    hooks: tuple[str, ...]
    measurements: dict[str, Measurement]
    notes: list[str] = field(default_factory=list)
    error: str | None = None  # kind "unbuilt": why the encoding could not be built at these sizes

    def __getitem__(self, key: str) -> Measurement:
        return self.measurements[key]

    @property
    def failures(self) -> list[str]:
        return [k for k, m in self.measurements.items() if m.verdict == "FAIL"]

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "title": self.card.title,
            "family": self.card.family,
            "position": self.card.position,
            "kind": self.kind,
            "hooks": list(self.hooks),
            "settings": dict(self.settings),
            "notes": list(self.notes),
            "properties": {
                k: {
                    "title": m.title,
                    "value": m.value,
                    "holds": m.holds,
                    "claim": m.claim,
                    "verdict": m.verdict,
                    "how": m.how,
                }
                for k, m in self.measurements.items()
            },
        }


MEASURES: dict[str, Callable[..., Measurement]] = {
    "unique": measure_unique,
    "continuous": measure_continuous,
    "bounded": measure_bounded,
    "consistent": measure_consistent,
    "linear_offset": measure_linear_offset,
    "direction_aware": measure_direction,
    "relative_only": measure_relative_only,
    "decay": measure_decay,
    "extrapolates": measure_extrapolates,
    "params_constant": measure_params,
}


def measure(
    encoding: str | PositionalEncoding,
    *,
    dim: int = 64,
    length: int = 128,
    heads: int = 4,
    short_length: int | None = None,
    options: dict[str, Any] | None = None,
    properties: tuple[str, ...] | None = None,
    seed: int = 0,
) -> Report:
    """Measure every property of ``encoding`` (a registered name or an instance) and build its card.

    Args:
        dim: model width ``d_model`` (``head_dim = dim // heads``).
        length: the trained length (``max_len``); extrapolation is measured up to ``4 * length``.
        heads: attention heads.
        short_length: the short length compared with ``length`` for consistency (default ``length // 10``).
        options: extra settings passed to the encoding (``{"base": 100.0}``).
        properties: a subset of :data:`PROPERTY_KEYS` (default all).

    Raises :class:`~posenc.ConfigError` for invalid sizes and
    :class:`~posenc.UnknownNameError` for unknown names; everything else an encoding
    cannot do is reported as ``n/a`` in the card.
    """
    short = check_settings(dim, length, heads, short_length)
    keys = PROPERTY_KEYS if properties is None else tuple(properties)
    unknown = [k for k in keys if k not in MEASURES]
    if unknown:
        raise ConfigError(f"unknown properties {unknown}; known: {', '.join(PROPERTY_KEYS)}")
    settings = dict(dim=dim, length=length, heads=heads, head_dim=dim // heads, short_length=short)
    if options:
        settings["options"] = dict(options)
    if isinstance(encoding, PositionalEncoding):
        card = encoding.info
    else:
        card = resolve(encoding).info
    claims = claims_for(card, type(encoding) if isinstance(encoding, PositionalEncoding) else resolve(encoding))
    with single_thread():
        return _measure(encoding, card, claims, keys, settings, dim, length, heads, short, options, seed)


def _measure(
    encoding: str | PositionalEncoding,
    card: Card,
    claims: dict[str, bool | None],
    keys: tuple[str, ...],
    settings: dict[str, Any],
    dim: int,
    length: int,
    heads: int,
    short: int,
    options: dict[str, Any] | None,
    seed: int,
) -> Report:
    try:
        probe = Probe(encoding, dim=dim, length=length, heads=heads, options=options, seed=seed)
    except Exception as e:  # the encoding cannot be built at these sizes
        reason = _short(e, 240)
        ms = {k: Measurement(k, f"n/a (cannot build: {reason})", None, claims.get(k)) for k in keys}
        return Report(
            card.name, card, settings, "unbuilt", (), ms, notes=[f"cannot build: {reason}"], error=_short(e, 1000)
        )
    notes = []
    if probe.kind == "attention" and "probabilities" in probe.hooks:
        notes.append(
            "measured on the log of the attention weights it gives (its own, not a softmax), from scale·(q·k + "
            "logits) + bias with a fixed random q and k at every position"
        )
    elif probe.kind == "attention":
        notes.append(
            "measured on the attention scores it induces: scale·(rotate(q)·rotate(k) + logits) + bias, "
            "with a fixed random q and k at every position"
        )
    else:
        notes.append("measured on its codes PE_t; scores are the raw dot products PE_i·PE_j")
    if probe.defaulted:
        notes.append(
            "built with " + ", ".join(f"{k}={v!r}" for k, v in probe.defaulted.items()) + " (settings the probe "
            "chose because the sizes alone do not build it; pass options to change them)"
        )
    if "values" in probe.hooks:
        notes.append("its values hook (a^V) changes the attention output, not the scores: not measured here")
    if "positions" in probe.hooks:
        notes.append("its positions hook acts in training only; measured at evaluation")
    if probe.enc.requires_tokens:
        notes.append("needs token ids: measured for a fixed token (id 0, unit amplitude)")
    ms: dict[str, Measurement] = {}
    for k in keys:
        fn = MEASURES[k]
        try:
            m = fn(probe, short) if k == "consistent" else fn(probe)
        except Unmeasurable as e:
            m = Measurement(k, f"n/a ({e})", None)
        except Exception as e:  # a hook that fails on the probe: say so, never crash
            m = Measurement(k, f"n/a ({_short(e)})", None)
        m.claim = claims.get(k)
        ms[k] = m
    return Report(probe.name, card, settings, probe.kind, probe.hooks, ms, notes)


def measure_all(names: list[str] | None = None, **kwargs: Any) -> list[Report]:
    """:func:`measure` for every registered encoding (or ``names``)."""
    return [measure(n, **kwargs) for n in (available() if names is None else names)]


__all__ = [
    "ATTENTION_HOOKS",
    "MEASURES",
    "PROPERTIES",
    "PROPERTY_KEYS",
    "PROPERTY_MEANING",
    "PROPERTY_TITLES",
    "REL_TOL",
    "Measurement",
    "Probe",
    "Report",
    "Unmeasurable",
    "check_settings",
    "claims_for",
    "mean_score_by_offset",
    "measure",
    "measure_all",
    "offset_profiles",
    "single_thread",
]
