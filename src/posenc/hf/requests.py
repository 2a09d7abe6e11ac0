"""What each layer of a model is asked to get by :func:`posenc.hf.patch`: one encoding, encodings by layer type,
on some layers (``layers=``), or a schedule (a :class:`posenc.Schedule`, its string, or a list per layer), each
request checked by name (a layer type the model has, a layer index in range, an encoding's close matches, a span that
is the layer's own) and turned into one :class:`_Ask` per layer (``None``: the layer keeps what it has).

Imports the other parts of :mod:`posenc.hf` below :mod:`posenc.hf.patching`, and the registry, the schedule and the
errors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..base import PositionalEncoding
from ..errors import ConfigError
from ..registry import resolve
from ..schedule import Span
from .families import Family, _own_rotation, text_config
from .rotary import _layer_params

# ------------------------------------------------------------------------------------------ what each layer gets
#: the names RoPE's θ goes by in transformers (``rope_theta``) and in the papers (``theta``): posenc's ``base``
THETA_NAMES = ("theta", "rope_theta")


@dataclass(frozen=True)
class _Ask:
    """What one layer was asked to get: an encoding name and its options (``bare``: a name without options, which
    for ``"rope"`` means the layer's own RoPE), or a built encoding."""

    encoding: str | PositionalEncoding
    options: dict[str, Any] = field(default_factory=dict)
    bare: bool = False
    span: Span = field(default_factory=Span)  # the span a schedule wrote for the layer (checked: the layer's own)

    @property
    def spec(self) -> Any:
        """What the patch records for the layer: ``(name, options)`` or the instance."""
        if isinstance(self.encoding, PositionalEncoding):
            return self.encoding
        return (self.encoding, dict(self.options))


def _options(name: str, options: Mapping[str, Any], where: str = "") -> dict[str, Any]:
    """``options`` for encoding ``name`` with RoPE's θ under posenc's name (``theta`` / ``rope_theta`` -> ``base``)."""
    out = dict(options)
    given = [k for k in THETA_NAMES if k in out]
    if given:
        from ..registry import accepted_arguments

        if "base" not in accepted_arguments(resolve(name)):
            return out  # the encoding's own error names what it takes
        if len(given) > 1 or "base" in out:
            both = [k for k in (*THETA_NAMES, "base") if k in out]
            raise ConfigError(f"{where}{name}: θ is given twice ({', '.join(both)}); give it once, as base")
        out["base"] = out.pop(given[0])
    return out


def _ask(item: Any, where: str) -> _Ask:
    """One layer's entry (a name, a string of one layer in the schedule syntax, ``(name, options)``, an encoding
    or a :class:`~posenc.schedule.LayerSpec`) as an :class:`_Ask`; ``where`` names the layer in errors."""
    from ..schedule import LayerSpec, Schedule, is_schedule_text

    if isinstance(item, str) and is_schedule_text(item):
        parsed = Schedule.parse(item)
        if len(parsed.layers) != 1:
            raise ConfigError(f"{where}{item!r} is a schedule of {len(parsed.layers)} layers where one layer's goes")
        item = parsed.layers[0]
    if isinstance(item, LayerSpec) and item.qk_norm is not None:
        from ..schedule import QK_NORMS

        raise ConfigError(
            f"{where}{str(item)!r} asks for a QK-norm ('#{QK_NORMS[item.qk_norm]}'), which posenc.hf.patch does not "
            "apply: the suffix is for posenc's own models (posenc.LanguageModel, posenc.Transformer ...); a "
            "transformers model keeps the QK-norm it has (Qwen3's q_norm / k_norm, Llama 4's L2 norm) whatever "
            f"encoding it is patched with. Drop the '#{QK_NORMS[item.qk_norm]}' from this layer"
        )
    if isinstance(item, LayerSpec):
        if isinstance(item.encoding, PositionalEncoding):
            return _Ask(item.encoding, span=item.span)
        return _Ask(item.encoding, item.built_options(), bare=not item.options, span=item.span)
    if isinstance(item, PositionalEncoding):
        return _Ask(item)
    if isinstance(item, str):
        return _Ask(resolve(item).info.name, {}, bare=True)
    if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], Mapping):
        name = resolve(item[0]).info.name
        opts = _options(name, item[1], where)
        return _Ask(name, opts, bare=not opts)
    raise ConfigError(
        f"{where}an encoding is a name, (name, options), an encoding instance or a posenc.schedule.LayerSpec, got "
        f"{type(item).__name__} {item!r}"
    )


def _layer_types(config: Any, n: int) -> list[str] | None:
    types = getattr(config, "layer_types", None)
    return list(types[:n]) if isinstance(types, (list, tuple)) and len(types) >= n else None


def _layer_indices(model: nn.Module, layers: Any, n: int) -> list[int]:
    """``layers=`` checked: distinct layer indices in ``0 .. n-1``."""
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence) or not layers:
        raise ConfigError(f"layers must be a non-empty list of layer indices (0 .. {n - 1}), got {layers!r}")
    out: list[int] = []
    for i in layers:
        if isinstance(i, bool) or not isinstance(i, int):
            raise ConfigError(f"layers must hold layer indices (integers), got {i!r} in {list(layers)!r}")
        if not 0 <= i < n:
            raise ConfigError(
                f"layer {i} is out of range: this {type(model).__name__} has {n} layers (indices 0 .. {n - 1})"
            )
        if i in out:
            raise ConfigError(f"layer {i} is given twice in layers={list(layers)!r}")
        out.append(i)
    return out


def _own_span(model: nn.Module, attn: nn.Module, layer_type: str | None) -> Span:
    """Which keys the model lets this layer's queries see: its chunk (Llama 4's chunked layers), its sliding
    window, or all of them."""
    cfg = text_config(model)
    if layer_type == "chunked_attention" and getattr(cfg, "attention_chunk_size", None):
        return Span("chunk", int(cfg.attention_chunk_size))
    window = getattr(attn, "sliding_window", None)
    if window is None and layer_type == "sliding_attention":
        window = getattr(cfg, "sliding_window", None)
    return Span("window", int(window)) if window else Span()


def _requested(
    model: nn.Module,
    family: Family,
    attns: list[nn.Module],
    rotary: nn.Module | None,
    encoding: Any,
    options: dict[str, Any],
    layers: Any,
) -> tuple[list[_Ask | None], bool]:
    """Each layer's :class:`_Ask` (``None``: it keeps what it has) and whether the request was per layer."""
    from ..schedule import Schedule, is_schedule_text

    n = len(attns)
    name = type(model).__name__
    targets = _layer_indices(model, layers, n) if layers is not None else None
    several = isinstance(encoding, (Mapping, list, Schedule)) or is_schedule_text(encoding)
    if several and options:
        raise ConfigError(
            f"options ({', '.join(sorted(options))}) go with one encoding name; with encodings per layer give each "
            "its own: (name, {options}) or 'name(key=value)'"
        )
    asks: list[_Ask | None]
    if isinstance(encoding, Mapping):
        if targets is not None:
            raise ConfigError("give layers= or encodings by layer type, not both")
        types = _layer_types(text_config(model), n)
        if types is None:
            raise ConfigError(
                f"this {name} has no layer types (config.layer_types), so encodings by layer type do not apply: give a "
                f"list with one entry per layer ({n}), a schedule, or layers=[...]"
            )
        unknown = [t for t in encoding if t not in types]
        if unknown:
            import difflib

            known = sorted(set(types))
            close = [k for k in known if str(unknown[0]) in k] or difflib.get_close_matches(str(unknown[0]), known, n=2)
            hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
            raise ConfigError(
                f"unknown layer type {unknown[0]!r}{hint}: this {name}'s layer types are "
                f"{', '.join(map(repr, sorted(set(types))))}"
            )
        made = {t: _ask(v, f"layer type {t!r}: ") for t, v in encoding.items()}
        return _spans_checked(model, attns, [made.get(t) for t in types]), True
    count = len(targets) if targets is not None else n
    if isinstance(encoding, list):
        if len(encoding) != count:
            what = f"the {count} layers of layers=" if targets is not None else f"this {name}'s {n} layers"
            raise ConfigError(f"a list of encodings has one entry per layer: {len(encoding)} entries for {what}")
        asks = [None if e is None else _ask(e, f"layer {(targets or range(n))[i]}: ") for i, e in enumerate(encoding)]
    elif isinstance(encoding, Schedule) or is_schedule_text(encoding):
        sched = encoding if isinstance(encoding, Schedule) else Schedule.parse(encoding)
        specs = sched.for_layers(count)
        where = targets if targets is not None else list(range(n))
        asks = [_ask(spec, f"layer {i}: ") for i, spec in zip(where, specs, strict=True)]
    else:
        if isinstance(encoding, PositionalEncoding):
            if options:
                raise ConfigError("pass encoding options only with an encoding name, not with an encoding instance")
            one = _Ask(encoding)
        elif isinstance(encoding, str):
            cname = resolve(encoding).info.name
            opts = _options(cname, options)
            one = _Ask(cname, opts, bare=not opts)
        else:
            raise ConfigError(
                f"encoding must be a name, an encoding, a schedule, a list (one entry per layer) or a dict by layer "
                f"type, got {type(encoding).__name__}"
            )
        if targets is None:
            # one rotary encoding replaces the model's RoPE where it has RoPE; its layers without keep theirs
            rotary_one = (isinstance(encoding, PositionalEncoding) and encoding.info.family == "rotary") or (
                isinstance(encoding, str) and resolve(encoding).info.family == "rotary"
            )
            types = _layer_types(text_config(model), n) or [None] * n
            return [
                None if rotary_one and rotary is not None and not _model_rotates(model, a, types[i]) else one
                for i, a in enumerate(attns)
            ], False
        asks = [one] * count
    if targets is None:
        return _spans_checked(model, attns, asks), True
    out: list[_Ask | None] = [None] * n
    for i, a in zip(targets, asks, strict=True):
        out[i] = a
    return _spans_checked(model, attns, out), True


def _spans_checked(model: nn.Module, attns: list[nn.Module], asks: list[_Ask | None]) -> list[_Ask | None]:
    """``asks``, once every span a schedule wrote is the layer's own (posenc.hf does not change which keys a layer
    sees: the model's masks and KV cache follow its own window or chunk)."""
    types = _layer_types(text_config(model), len(attns)) or [None] * len(attns)
    for i, ask in enumerate(asks):
        if ask is None or ask.span.is_global:
            continue
        own = _own_span(model, attns[i], types[i])
        if ask.span != own:
            raise ConfigError(
                f"layer {i}: a span of {str(ask.span)!r} is asked, but posenc.hf keeps each layer's own span (this "
                f"{type(model).__name__}'s layer {i}: {str(own) or 'global'}), which its masks and KV cache follow: "
                "leave the span out"
            )
    return asks


def _model_rotates(model: nn.Module, attn: nn.Module, layer_type: str | None) -> bool:
    """Whether the model rotates this layer by its RoPE: not a layer without RoPE (``no_rope_layers``, Cohere2's
    global layers), nor one whose layer type has no ``rope_parameters`` where they are given per type."""
    cfg = text_config(model)
    if not _own_rotation(attn, cfg):
        return False
    return getattr(cfg, "rope_parameters", None) is None or _layer_params(cfg, layer_type) is not None
