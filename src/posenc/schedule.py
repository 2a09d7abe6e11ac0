"""Encodings per layer: a :class:`Schedule` gives each layer of a model its encoding, its options, its span and its
QK-norm.

Models since 2025 choose the positional treatment per layer: NoPE on every fourth layer (Llama 4, SmolLM3,
Cohere2), sliding-window layers with one RoPE base and global layers with another (Gemma 3), chunked local
attention (Llama 4's ``attention_chunk_size``), a QK-norm on some layers or all (Llama 4, Qwen3). A schedule says
this as data: a pattern of :class:`LayerSpec` (``encoding``, ``options``, ``span``, ``qk_norm``) repeated over the
model's layers, with a name that reads in a leaderboard and is stored with each benchmark run.

Spans
-----
A layer's :class:`Span` is which keys each query may see, on top of causality and padding (``i`` a query's index
in the sequence, ``j`` a key's):

``global`` (the default): every key; ``("window", W)``: the last ``W`` keys, ``i - W < j <= i`` (bidirectional:
``|i - j| < W``); ``("chunk", C)``: the keys of the query's own chunk, ``floor(j / C) == floor(i / C)`` (and
``j <= i`` when causal; Llama 4's chunked local attention).
The indices are the tokens' places in the sequence (what a KV cache counts), not the encoding's positions.

QK-norm
-------
A layer may normalise its queries and keys per head, before the positional encoding (``qk_norm``): ``"rms"``
(``#qk``: RMSNorm with a learnable weight, ``eps = 1e-6``; Qwen3, Gemma 3) or ``"l2"`` (``#qk-l2``: weightless
``x * rsqrt(mean(x², -1) + eps)``; Llama 4's RoPE layers). The models take ``qk_norm=`` for a norm on every layer;
docs/schedules.md has the details.

The string syntax
-----------------
One string names a schedule (the CLI's ``--encodings`` and the leaderboard take it)::

    schedule := layer-term ( "+" layer-term )* [ "..." ]
    layer-term := layer [ "*" COUNT ]
    layer := NAME [ "(" KEY "=" VALUE ( "," KEY "=" VALUE )* ")" ] [ "@" span ] [ "#" norm ]
    span := "w" SIZE | "c" SIZE | "g"
    norm := "qk" | "qk-l2"

* ``rope*3+nope``: a pattern of four layers (three RoPE, one NoPE), repeated over the model's layers;
* ``rope@w64*3+nope``: RoPE layers with a sliding window of 64 keys; ``rope@c128``: chunks of 128 tokens;
* ``rope(base=10000.0)@w512*5+rope-linear(base=1000000.0,factor=8)...``: Gemma 3's five local and one global
  layer (VALUE is a Python literal: a number, a quoted string, ``True``, ``None`` or a list of them);
* ``rope@w16#qk*3+nope#qk``: a QK-norm on every layer;
* the trailing ``...`` lets the pattern stop part way through its last repetition (a 26-layer model with a
  pattern of six); without it, a model's layer count must be a multiple of the pattern's length.
``str(schedule)`` is the canonical form (docs/schedules.md), which ``parse`` reads back to an equal schedule.

Constructors
------------
:func:`schedule` (a pattern, a full per-layer list ``layers=[...]`` or ``by_type=``), :meth:`Schedule.parse` (a
string) and :meth:`Schedule.from_dict` (a stored dict). Every error names the layer and the value.

This module imports :mod:`posenc.errors` only; the registry (and torch) on first use, to check encoding names.
"""

from __future__ import annotations

import ast
import math
import re
import sys
import types
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import ConfigError, PosencError

if TYPE_CHECKING:
    from .base import PositionalEncoding

SPAN_KINDS = ("global", "window", "chunk")
MAX_LAYERS = 100_000  #: the most layers a schedule holds (checked before ``rope*1000000000`` is built)
_SPAN_LETTERS = {"g": "global", "w": "window", "c": "chunk"}
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_\-]*")
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
#: a layer's QK-norms: ``LayerSpec.qk_norm`` -> its suffix in the string syntax (``rope#qk``, ``rope#qk-l2``)
QK_NORMS = {"rms": "qk", "l2": "qk-l2"}
_QK_SUFFIXES = {suffix: kind for kind, suffix in QK_NORMS.items()}


def qk_norm_kind(value: Any, where: str = "qk_norm") -> str | None:
    """``value`` as a QK-norm kind: ``None`` (none), ``"rms"`` or ``"l2"``; the suffixes ``"qk"`` / ``"qk-l2"`` (with or
    without their ``#``) are taken too. Anything else is a :class:`~posenc.ConfigError` naming the accepted values."""
    text = value.strip() if isinstance(value, str) else ""
    if value is None or text in QK_NORMS:
        return text or None
    if text.lstrip("#") in _QK_SUFFIXES:
        return _QK_SUFFIXES[text.lstrip("#")]
    raise ConfigError(
        f"{where} must be None, 'rms' ('#qk': RMSNorm with a learnable weight, Qwen3 / Gemma 3) or 'l2' ('#qk-l2': "
        f"weightless, Llama 4), got {value!r}"
    )


# ------------------------------------------------------------------------------------------------ the span
@dataclass(frozen=True)
class Span:
    """Which keys a layer's queries see: ``global``, a sliding ``window`` of ``size`` keys, or a ``chunk`` of
    ``size`` tokens (see the module docstring)."""

    kind: str = "global"
    size: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in SPAN_KINDS:
            raise ConfigError(f"a span is one of {SPAN_KINDS}, got {self.kind!r}")
        if self.kind == "global":
            if self.size is not None:
                raise ConfigError(f"a global span has no size, got {self.size!r}")
            return
        size = self.size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigError(f"a {self.kind} span needs a size that is an integer >= 1, got {size!r}")

    @classmethod
    def of(cls, value: Any) -> Span:
        """A span from ``None`` / ``"global"``, ``("window", W)``, ``("chunk", C)``, ``"w64"`` / ``"c128"`` or a
        :class:`Span`."""
        if isinstance(value, Span):
            return value
        if value is None or value == "global" or value == "g":
            return cls()
        if isinstance(value, str):
            m = re.fullmatch(r"\s*([wc])\s*([0-9]+)\s*", value)
            if m is None:
                raise ConfigError(f"a span is 'global', ('window', W), ('chunk', C), 'w64' or 'c128', got {value!r}")
            return cls(_SPAN_LETTERS[m.group(1)], int(m.group(2)))
        if isinstance(value, (tuple, list)) and len(value) == 2 and value[0] in ("window", "chunk"):
            return cls(value[0], value[1])
        if isinstance(value, (tuple, list)) and len(value) == 1 and value[0] == "global":
            return cls()
        raise ConfigError(f"a span is 'global', ('window', W) or ('chunk', C), got {value!r}")

    @property
    def is_global(self) -> bool:
        return self.kind == "global"

    def as_tuple(self) -> tuple[str, int] | None:
        """``None`` for global, else ``(kind, size)``: what the attention takes."""
        return None if self.size is None else (self.kind, self.size)

    def keep(self, seen: int, held: int) -> int:
        """How many of the ``held`` latest keys a KV cache must keep once ``seen`` tokens have gone in: all of them
        (global), the last ``W - 1`` (window) or those of the current chunk (``seen mod C``)."""
        if self.kind == "window":
            assert self.size is not None
            return min(held, self.size - 1)
        if self.kind == "chunk":
            assert self.size is not None
            return min(held, seen % self.size)
        return held

    def __str__(self) -> str:
        return "" if self.size is None else f"{self.kind[0]}{self.size}"


# ------------------------------------------------------------------------------------------------ a layer
def _freeze(value: Any, what: str) -> Any:
    """An option value as an immutable, hashable one (lists become tuples); refuses what a string cannot hold."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ConfigError(f"{what} must be a finite number, got {value!r}")
        return value
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v, what) for v in value)
    raise ConfigError(
        f"{what} must be a number, a string, True/False, None or a list of them, got {type(value).__name__} {value!r}"
    )


class _Options(dict):
    """A layer's options: a dict that cannot change (hashable; pickles and deep-copies, unlike a mappingproxy)."""

    __slots__ = ()

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("a LayerSpec's options cannot change; make a new LayerSpec (or posenc.schedule(...))")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _refuse  # type: ignore[assignment]

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(self.items()))

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Options, (dict(self),))


def _thaw(value: Any) -> Any:
    return [_thaw(v) for v in value] if isinstance(value, tuple) else value


def _format_value(value: Any) -> str:
    if isinstance(value, tuple):
        return "[" + ",".join(_format_value(v) for v in value) + "]"
    return repr(value)


@dataclass(frozen=True)
class LayerSpec:
    """One layer of a :class:`Schedule`: its ``encoding`` (a registered name, or an instance), the ``options`` the
    name is built with, its :class:`Span` (``span`` also takes ``("window", W)``, ``("chunk", C)`` or
    ``"global"``) and its ``qk_norm`` (``None``, ``"rms"`` or ``"l2"``: see the module docstring; ``"qk"`` and
    ``"qk-l2"`` are read as those two)."""

    encoding: str | PositionalEncoding
    options: Mapping[str, Any] = field(default_factory=dict)
    span: Span = field(default_factory=Span)
    qk_norm: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "span", Span.of(self.span))
        object.__setattr__(self, "qk_norm", qk_norm_kind(self.qk_norm))
        enc = self.encoding
        if isinstance(enc, str):
            object.__setattr__(self, "encoding", _canonical_name(enc))
        elif not _is_encoding(enc):
            raise ConfigError(
                f"an encoding is a registered name or a posenc.PositionalEncoding, got {type(enc).__name__}"
            )
        if not isinstance(self.options, Mapping):
            raise ConfigError(f"options must be a dict, got {type(self.options).__name__}")
        if self.options and not isinstance(enc, str):
            raise ConfigError("options go with an encoding name, not with an instance (it is built already)")
        frozen = {}
        for key in sorted(self.options):
            if not isinstance(key, str) or _KEY.fullmatch(key) is None:
                raise ConfigError(f"an option name must be an identifier, got {key!r}")
            frozen[key] = _freeze(self.options[key], f"option {key!r}")
        if frozen:
            _check_option_names(str(self.encoding), frozen)
        object.__setattr__(self, "options", _Options(frozen))

    def __hash__(self) -> int:
        norm = () if self.qk_norm is None else (self.qk_norm,)  # without a norm: the hash of before norms existed
        return hash((self.encoding, tuple(self.options.items()), self.span, *norm))

    @property
    def name(self) -> str:
        """The encoding's registered name."""
        return self.encoding if isinstance(self.encoding, str) else self.encoding.info.name

    def built_options(self) -> dict[str, Any]:
        """The options as the encoding takes them (lists, not the tuples they are kept as)."""
        return {k: _thaw(v) for k, v in self.options.items()}

    def same_encoding(self, other: LayerSpec) -> bool:
        """Whether ``other`` has this layer's encoding and options (its span and QK-norm may differ)."""
        if isinstance(self.encoding, str) != isinstance(other.encoding, str):
            return False
        if not isinstance(self.encoding, str):
            return self.encoding is other.encoding
        return self.encoding == other.encoding and dict(self.options) == dict(other.options)

    def __str__(self) -> str:
        if isinstance(self.encoding, str):
            text, options = self.encoding, dict(self.options)
        else:
            text, options = self.encoding.info.name, dict(self.encoding.params)
        if options:
            text += "(" + ",".join(f"{k}={_format_value(_freeze_lenient(v))}" for k, v in sorted(options.items())) + ")"
        span = str(self.span)
        text += f"@{span}" if span else ""
        return text + (f"#{QK_NORMS[self.qk_norm]}" if self.qk_norm is not None else "")

    def as_dict(self) -> dict[str, Any]:
        """``{"encoding": name, "options": {...}, "span": "global" | [kind, size]}``, and ``"qk_norm": "rms" | "l2"``
        where the layer has one (an instance: its name and settings, and ``"instance": True``)."""
        d: dict[str, Any] = {
            "encoding": self.name,
            "options": self.built_options() if isinstance(self.encoding, str) else dict(self.encoding.params),
            "span": "global" if self.span.is_global else [self.span.kind, self.span.size],
        }
        if self.qk_norm is not None:  # absent without a norm: the dict of such a layer is what it was before
            d["qk_norm"] = self.qk_norm
        if not isinstance(self.encoding, str):
            d["instance"] = True
        return d


def _freeze_lenient(v: Any) -> Any:
    try:
        return _freeze(v, "option")
    except ConfigError:
        return v


def _is_encoding(value: Any) -> bool:
    from .base import PositionalEncoding

    return isinstance(value, PositionalEncoding)


def _canonical_name(name: str) -> str:
    from .registry import registered_class

    cls = registered_class(name)
    if cls is None:
        from .registry import unknown_encoding

        exc = unknown_encoding(name)  # its close matches: names `posenc list` shows (an alias's target)
        close = list(exc.close_matches)
        hint = f" (close matches: {', '.join(close)})" if close else ""
        exc.args = (f"unknown encoding {name!r}{hint}; `posenc list` (or posenc.available()) lists every encoding",)
        raise exc
    return cls.info.name


def _check_option_names(name: str, options: Mapping[str, Any]) -> None:
    from .registry import accepted_arguments, resolve

    accepted = accepted_arguments(resolve(name))
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        hint = " (RoPE's θ is called base here)" if "theta" in unknown and "base" in accepted else ""
        raise ConfigError(
            f"encoding {name!r} does not take {', '.join(map(repr, unknown))}{hint}; "
            f"it takes: {', '.join(accepted) or 'no options'}"
        )


class _AtLayer:
    """Re-raise a posenc error inside the block with ``layer i: `` in front of its message (same type)."""

    def __init__(self, index: int | str):
        self.index = index

    def __enter__(self) -> None:
        return None

    def __exit__(self, typ: Any, exc: BaseException | None, tb: Any) -> bool:
        if isinstance(exc, PosencError) and exc.args and not str(exc.args[0]).startswith("layer"):
            exc.args = (f"layer {self.index}: {exc.args[0]}", *exc.args[1:])
        return False


def _as_layer(item: Any, index: int) -> LayerSpec:
    """One layer from a name, ``(name, options)``, ``(name, options, span)``, ``(name, options, span, qk_norm)``, an
    instance or a :class:`LayerSpec`."""
    with _AtLayer(index):
        if isinstance(item, LayerSpec):
            return item
        if isinstance(item, str):
            return LayerSpec(item)
        if isinstance(item, tuple) and 1 <= len(item) <= 4:
            name, options, span, qk_norm = (*item, None, None, None)[:4]
            return LayerSpec(name, {} if options is None else options, Span.of(span), qk_norm)
        if _is_encoding(item):
            return LayerSpec(item)
        raise ConfigError(
            "a layer is an encoding name, (name, options), (name, options, span), (name, options, span, qk_norm), "
            f"an encoding instance or a posenc.schedule.LayerSpec, got {type(item).__name__} {item!r}"
        )


# ------------------------------------------------------------------------------------------------ the schedule
@dataclass(frozen=True)
class Schedule:
    """A pattern of :class:`LayerSpec` repeated over a model's layers.

    ``truncate=False``: a model's layer count must be a multiple of ``len(layers)``; ``True``: the last repetition
    may stop part way (printed as a trailing ``...``). ``full=True`` (``schedule(layers=[...])``): one entry per
    layer, never repeated: a model's layer count must equal ``len(layers)``. ``str(schedule)`` is the canonical string,
    :meth:`as_dict` the stored form; both read back (:meth:`parse`, :meth:`from_dict`)."""

    layers: tuple[LayerSpec, ...]
    truncate: bool = False
    full: bool = field(default=False, compare=False)

    def __post_init__(self) -> None:
        layers = tuple(self.layers) if isinstance(self.layers, (list, tuple)) else None
        if not layers:
            raise ConfigError(f"a schedule needs at least one layer, got {self.layers!r}")
        for i, spec in enumerate(layers):
            if not isinstance(spec, LayerSpec):
                raise ConfigError(f"layer {i}: expected a posenc.schedule.LayerSpec, got {type(spec).__name__}")
        if not isinstance(self.truncate, bool):
            raise ConfigError(f"truncate must be True or False, got {self.truncate!r}")
        if len(layers) > MAX_LAYERS:
            raise ConfigError(f"a schedule has at most {MAX_LAYERS} layers, got {len(layers)}")
        object.__setattr__(self, "layers", layers)

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self) -> Any:
        return iter(self.layers)

    def __getitem__(self, i: int) -> LayerSpec:
        return self.layers[i]

    # ------------------------------------------------------------------ over a model
    def for_layers(self, n_layers: int) -> tuple[LayerSpec, ...]:
        """The spec of each of ``n_layers`` layers: the pattern repeated (and cut, with ``truncate``)."""
        if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 1:
            raise ConfigError(f"n_layers must be an integer >= 1, got {n_layers!r}")
        p = len(self.layers)
        if self.full and n_layers != p:
            raise ConfigError(
                f"layers=[...] is a full per-layer list of {p} entries, but the model has n_layers={n_layers}: give "
                f"exactly {n_layers} entries, or for a repeated pattern a pattern instead of layers=: "
                f"posenc.schedule({str(self)!r}) (or a string like 'rope*3+nope', or posenc.schedule(*pattern))"
            )
        if n_layers % p and not self.truncate:
            raise ConfigError(
                f"the schedule {str(self)!r} is a pattern of {p} layers, which does not divide n_layers={n_layers} "
                f"({n_layers} = {n_layers // p}×{p} + {n_layers % p}); use n_layers a multiple of {p}, a pattern "
                f"that divides it, or let the last repetition stop part way: a trailing '...' "
                f"({str(self)!r} + '...') or posenc.schedule(..., truncate=True)"
            )
        return tuple(self.layers[i % p] for i in range(n_layers))

    def resolve(self, n_layers: int) -> Schedule:
        """This schedule as one spec per layer of a model of ``n_layers`` layers."""
        return Schedule(self.for_layers(n_layers))

    @property
    def uniform(self) -> bool:
        """Every layer has the same encoding and options (spans may differ)."""
        return all(s.same_encoding(self.layers[0]) for s in self.layers)

    @property
    def local(self) -> bool:
        """Some layer has a window or chunk span."""
        return any(not s.span.is_global for s in self.layers)

    @property
    def name(self) -> str:
        return str(self)

    # ------------------------------------------------------------------ text and dicts
    def __str__(self) -> str:
        terms: list[str] = []
        i = 0
        while i < len(self.layers):
            j = i
            while j + 1 < len(self.layers) and self.layers[j + 1] == self.layers[i]:
                j += 1
            count = j - i + 1
            terms.append(str(self.layers[i]) + (f"*{count}" if count > 1 else ""))
            i = j + 1
        return "+".join(terms) + ("..." if self.truncate else "")

    def __repr__(self) -> str:
        return f"posenc.schedule({str(self)!r})"

    def as_dict(self) -> dict[str, Any]:
        """``{"name": str(self), "layers": [...], "truncate": bool}`` (JSON-ready)."""
        d = {"name": str(self), "layers": [s.as_dict() for s in self.layers], "truncate": self.truncate}
        return {**d, "full": True} if self.full else d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Schedule:
        """A schedule from :meth:`as_dict`'s dict (the ``name`` alone also does)."""
        if not isinstance(d, Mapping):
            raise ConfigError(f"a stored schedule is a dict, got {type(d).__name__}")
        if "layers" not in d:
            if "name" in d:
                return cls.parse(d["name"])
            raise ConfigError(f"a stored schedule has 'layers' (or 'name'), got keys {sorted(d)}")
        if isinstance(d["layers"], (str, bytes, Mapping)) or not isinstance(d["layers"], Iterable):
            raise ConfigError(f"a stored schedule's 'layers' is a list of layer dicts, got {d['layers']!r}")
        layers = []
        for i, item in enumerate(d["layers"]):
            with _AtLayer(i):
                if not isinstance(item, Mapping) or "encoding" not in item:
                    raise ConfigError(f"a stored layer is a dict with 'encoding', got {item!r}")
                if item.get("instance"):
                    raise ConfigError(
                        f"this layer was an encoding instance ({item['encoding']!r}); a stored schedule cannot "
                        "rebuild one: give its name and options instead"
                    )
                span = Span.of(item.get("span"))
                layers.append(LayerSpec(item["encoding"], item.get("options") or {}, span, item.get("qk_norm")))
        return cls(tuple(layers), truncate=bool(d.get("truncate", False)), full=bool(d.get("full", False)))

    @classmethod
    def parse(cls, text: str) -> Schedule:
        """A schedule from its string (the syntax of the module docstring)."""
        return _parse(text)


# ------------------------------------------------------------------------------------------------ parsing
def _split_top(text: str, sep: str) -> list[str]:
    """``text`` split at ``sep`` outside brackets and quotes."""
    parts, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(text):
        if quote:
            if ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def _parse_options(body: str, name: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in _split_top(body, ","):
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq or _KEY.fullmatch(key) is None:
            raise ConfigError(f"{name}'s options are KEY=VALUE separated by commas, got {item.strip()!r}")
        try:
            value = ast.literal_eval(raw.strip())
        except (ValueError, SyntaxError):
            raise ConfigError(
                f"option {key}={raw.strip()} of {name}: the value must be a Python literal (a number, a quoted "
                "string, True/False, None or a list of them)"
            ) from None
        if key in out:
            raise ConfigError(f"option {key!r} of {name} is given twice")
        out[key] = value
    return out


def _parse_layer(text: str, index: int) -> LayerSpec:
    with _AtLayer(index):
        s = text.strip()
        m = _NAME.match(s)
        if m is None:
            raise ConfigError(f"expected an encoding name, got {s!r}")
        name, rest = m.group(0), s[m.end() :].strip()
        options: dict[str, Any] = {}
        if rest.startswith("("):
            depth, end = 0, -1
            for i, ch in enumerate(rest):
                depth += ch == "("
                depth -= ch == ")"
                if depth == 0:
                    end = i
                    break
            if end < 0:
                raise ConfigError(f"{name}'s options are not closed by ')': {s!r}")
            options = _parse_options(rest[1:end], name)
            rest = rest[end + 1 :].strip()
        rest, hash_, suffix = rest.partition("#")
        rest, suffix = rest.strip(), suffix.strip()
        qk_norm = None
        if hash_:
            if "@" in suffix:
                raise ConfigError(f"{name}: the QK-norm comes after the span: NAME(KEY=VALUE,...)@w<W>#qk, got {s!r}")
            if suffix not in _QK_SUFFIXES:
                raise ConfigError(
                    f"unexpected '#{suffix}' after {name!r} in {s!r}: a layer's QK-norm is '#qk' (RMSNorm with a "
                    "learnable weight, Qwen3 / Gemma 3) or '#qk-l2' (weightless, Llama 4)"
                )
            qk_norm = _QK_SUFFIXES[suffix]
        span = Span()
        if rest.startswith("@"):
            if not rest[1:].strip():
                raise ConfigError(f"{name}: nothing after '@' in {s!r}: a span is @w<W>, @c<C> or @g (rope@w64)")
            span = Span.of(rest[1:].strip())
            rest = ""
        if rest:
            raise ConfigError(
                f"unexpected {rest!r} after {name!r}: a layer is NAME, NAME(KEY=VALUE,...), then @w<W>, @c<C> or @g, "
                "then #qk or #qk-l2"
            )
        return LayerSpec(name, options, span, qk_norm)


def _parse(text: Any, offset: int = 0) -> Schedule:
    if isinstance(text, Schedule):
        return text
    if not isinstance(text, str):
        raise ConfigError(f"a schedule string is a str, got {type(text).__name__}")
    s = text.strip()
    truncate = s.endswith("...")
    if truncate:
        s = s[:-3].rstrip()
    if not s:
        raise ConfigError(f"an empty schedule {text!r}: name at least one encoding, e.g. 'rope*3+nope'")
    layers: list[LayerSpec] = []
    for term in _split_top(s, "+"):
        pieces = _split_top(term, "*")
        if not term.strip():
            raise ConfigError(
                f"layer {offset + len(layers)}: an empty term in {text!r} (two '+' in a row, or one at an end)"
            )
        if len(pieces) > 2:
            raise ConfigError(f"layer {offset + len(layers)}: {term.strip()!r} has more than one '*COUNT'")
        count = 1
        if len(pieces) == 2:
            raw = pieces[1].strip()
            if not re.fullmatch(r"[0-9]+", raw) or int(raw) < 1:
                raise ConfigError(
                    f"layer {offset + len(layers)}: {term.strip()!r}: the count after '*' must be an integer >= 1, "
                    f"got {raw!r} (ASCII digits: rope*3)"
                )
            count = int(raw)
            if len(raw) > 7 or offset + len(layers) + count > MAX_LAYERS:
                raise ConfigError(
                    f"layer {offset + len(layers)}: {term.strip()!r}: a schedule has at most {MAX_LAYERS} layers, "
                    f"but the counts in {text!r} add up to more; a pattern repeats over the model by itself "
                    "('rope*3+nope' on 40 layers is 10 repetitions)"
                )
        spec = _parse_layer(pieces[0], offset + len(layers))
        layers.extend([spec] * count)
    return Schedule(tuple(layers), truncate=truncate)


def is_schedule_text(text: Any) -> bool:
    """Whether ``text`` is written in the schedule syntax (more than a bare name): it has ``+ * @ ( # ...``."""
    return isinstance(text, str) and (any(c in text for c in "+*@(#") or text.rstrip().endswith("..."))


def check_names(names: list[str], where: str = "") -> None:
    """Check encoding names and schedules where they enter (``--encodings``): each schedule parsed (its error names
    the layer), then every plain name at once by :func:`posenc.registry.check_names` (each with its close matches)."""
    from .registry import check_names as check_plain

    for n in names:
        if is_schedule_text(n):
            try:
                Schedule.parse(n)
            except PosencError as exc:
                exc.args = (f"{where + ': ' if where else ''}{n!r}: {exc.args[0]}", *exc.args[1:])
                raise
    check_plain([n for n in names if not is_schedule_text(n)], where)


def as_schedule(value: Any) -> Schedule | None:
    """``value`` as a :class:`Schedule` if it is one, a list of layers, or a string in the schedule syntax;
    ``None`` for a bare name, an instance or ``None`` (a model's single encoding)."""
    if isinstance(value, Schedule):
        return value
    if isinstance(value, list):
        return schedule(layers=value)
    if is_schedule_text(value):
        return _parse(value)
    return None


# ------------------------------------------------------------------------------------------------ the constructor
def schedule(
    *pattern: Any,
    layers: Iterable[Any] | None = None,
    by_type: Mapping[str, Any] | None = None,
    layer_types: Iterable[str] | None = None,
    spans: Mapping[str, Any] | None = None,
    truncate: bool = False,
) -> Schedule:
    """A :class:`Schedule`, three ways.

    * a pattern repeated over the model's layers: ``schedule("rope", "rope", "rope", "nope")``, or the same as one
      string ``schedule("rope*3+nope")`` (the syntax of :mod:`posenc.schedule`); each item is a name, a string in
      that syntax, ``(name, options)``, ``(name, options, span)``, ``(name, options, span, qk_norm)``, an encoding
      instance or a :class:`LayerSpec`;
    * a full per-layer list: ``schedule(layers=[...])``, exactly one entry per layer of the model (never repeated);
    * by layer type, as transformers configs give them: ``schedule(by_type={"sliding": ("rope", {"base": 1e4}),
      "full": ("rope-linear", {"factor": 8, "base": 1e6})}, layer_types=["sliding", ..., "full"],
      spans={"sliding": ("window", 512)})``; ``spans`` default to global.

    ``truncate=True`` lets the last repetition stop part way when the model's layer count is not a multiple of the
    pattern's length (without it, that is an error naming both). An error names the layer and the value.
    """
    given = sum(x for x in (bool(pattern), layers is not None, by_type is not None or layer_types is not None))
    if given != 1:
        raise ConfigError(
            "posenc.schedule takes one of: a pattern (schedule('rope', 'rope', 'rope', 'nope') or "
            "schedule('rope*3+nope')), layers=[...] or by_type={...} with layer_types=[...]"
        )
    if by_type is not None or layer_types is not None:
        return _by_type(by_type, layer_types, spans, truncate)
    if spans is not None:
        raise ConfigError("spans= goes with by_type=; in a pattern, give each layer its span ('rope@w512')")
    items: list[Any]
    if layers is not None:
        if isinstance(layers, (str, bytes)) or not isinstance(layers, Iterable):
            raise ConfigError(f"layers must be a list of layers, got {type(layers).__name__}")
        items = list(layers)
    elif len(pattern) == 1 and isinstance(pattern[0], list):
        items = list(pattern[0])
    elif len(pattern) == 1 and isinstance(pattern[0], (Schedule, str)):
        s = _parse(pattern[0])
        return Schedule(s.layers, truncate=s.truncate or truncate)
    else:
        items = list(pattern)
    out: list[LayerSpec] = []
    for item in items:
        if isinstance(item, str) and is_schedule_text(item):
            parsed = _parse(item, len(out))
            if parsed.truncate:
                raise ConfigError(f"layer {len(out)}: '...' ends a whole schedule, not one item of it: {item!r}")
            out.extend(parsed.layers)
        else:
            out.append(_as_layer(item, len(out)))
    if not out:
        raise ConfigError("a schedule needs at least one layer")
    if layers is not None and truncate:
        raise ConfigError("truncate=True goes with a pattern; layers=[...] is a full per-layer list, never cut")
    return Schedule(tuple(out), truncate=truncate, full=layers is not None)


def _by_type(
    by_type: Mapping[str, Any] | None,
    layer_types: Iterable[str] | None,
    spans: Mapping[str, Any] | None,
    truncate: bool,
) -> Schedule:
    if not isinstance(by_type, Mapping) or not by_type:
        raise ConfigError(f"by_type must be a dict of layer type -> encoding, got {by_type!r}")
    if layer_types is None or isinstance(layer_types, str):
        raise ConfigError(f"layer_types must be a list of layer types (one per layer), got {layer_types!r}")
    types_ = list(layer_types)
    if not types_:
        raise ConfigError("layer_types is empty: give one type per layer")
    spans = dict(spans or {})
    stray = sorted(set(spans) - set(by_type))
    if stray:
        raise ConfigError(f"spans names layer types {stray} that by_type does not; by_type has {sorted(by_type)}")
    unused = sorted(set(by_type) - set(types_))
    if unused:
        raise ConfigError(
            f"by_type names layer types {unused} that no layer has; layer_types has {sorted(set(types_))}"
        )
    made: dict[str, LayerSpec] = {}
    out: list[LayerSpec] = []
    for i, t in enumerate(types_):
        if t not in by_type:
            raise ConfigError(
                f"layer {i}: layer type {t!r} has no encoding in by_type (types given: {', '.join(map(repr, by_type))})"
            )
        if t not in made:
            spec = _as_layer(by_type[t], i)
            if t in spans:
                with _AtLayer(i):
                    spec = LayerSpec(spec.encoding, dict(spec.options), Span.of(spans[t]), spec.qk_norm)
            made[t] = spec
        out.append(made[t])
    return Schedule(tuple(out), truncate=truncate)


class _CallableModule(types.ModuleType):
    """``posenc.schedule`` is this module, and calling it is :func:`schedule` (``posenc.schedule("rope*3+nope")``),
    whichever of the two an import found first."""

    def __call__(self, *args: Any, **kwargs: Any) -> Schedule:
        return schedule(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
