"""Export a patched model to a runtime's own format: a transformers folder whose ``config.json`` says the patch in
transformers' native ``rope_parameters`` (no posenc needed to load it), or a GGUF file for llama.cpp.

>>> posenc.hf.patch(model, "rope-yarn", factor=2)                       # doctest: +SKIP
>>> posenc.hf.export(model, "smol-yarn", tokenizer=tokenizer)            # doctest: +SKIP
>>> AutoModelForCausalLM.from_pretrained("smol-yarn")   # stock transformers, posenc not installed  # doctest: +SKIP

What a native config can say is what transformers' rotary modules compute from ``rope_parameters``
(``transformers.modeling_rope_utils``): RoPE with any θ (``default``; posenc's NTK-by-base ``rope-ntk`` is RoPE
with θ' = θ·s^(d/(d-2))), ``linear``, ``dynamic``, ``yarn`` (DeepSeek's ``mscale`` / ``mscale_all_dim`` included),
``llama3`` and ``longrope``; one set for every layer, or one per layer type where the model's config nests them
(Gemma 3, OLMo 3); SmolLM3's ``no_rope_layers`` switch RoPE off (or on) per layer. :func:`native_rope_parameters`
derives that description from the patch and :func:`export` checks it against the patch's own inverse frequencies
and attention factor (float32, exactly) before writing anything. A patch that no native config can express
(ALiBi, T5's buckets, FIRE, an encoding with trained parameters, a schedule the family cannot switch) is refused by
name; :func:`posenc.hf.save_pretrained` keeps such a patch in posenc's own format.

Imports :mod:`posenc.hf.state`, :mod:`posenc.hf.families`, :mod:`posenc.hf.rotary`, :mod:`posenc.hf.requests` and,
from below :mod:`posenc.hf`, the errors (transformers inside functions; the GGUF writer,
:mod:`posenc.hf.export_gguf`, only for ``format="gguf"``).
"""

from __future__ import annotations

import copy
import math
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..base import PositionalEncoding
from ..errors import ConfigError
from .families import _base_and_family, _own_rotation, _unwrap, text_config
from .rotary import _cos_sin_ok, _layer_params
from .state import PosencPatch, _patch_of

#: the formats :func:`export` writes
FORMATS = ("transformers", "gguf")
#: the scaling fields a native ``rope_parameters`` set may hold besides ``rope_type`` and ``rope_theta``
_KEPT_KEYS = ("partial_rotary_factor",)
#: where an inexpressible patch goes instead
_INSTEAD = (
    "save it with posenc.hf.save_pretrained(model, folder), which keeps posenc's own format (posenc.hf.from_pretrained "
    "loads it back, patched)"
)
#: why each kind of encoding has no native config (by registered name; the family's reason otherwise)
_WHY = {
    "alibi": "ALiBi adds a linear bias to the attention logits, and transformers' configs describe positions only as "
    "a rotation (rope_parameters) of the model's queries and keys",
    "t5": "T5's relative buckets are a bias table learned per head, and transformers' rotary configs have no field for "
    "an attention bias",
    "fire": "FIRE's bias is a small trained MLP of the relative position, which no rope_parameters field describes",
    "rope-mixed": "RoPE-Mixed's frequencies are trained per head and per axis, while rope_parameters give one set of "
    "frequencies computed from θ and a scaling",
}


def _refuse(name: str, why: str) -> ConfigError:
    return ConfigError(f"posenc.hf.export: the patch with {name} cannot be exported natively: {why}; {_INSTEAD}")


def _original_attr(state: PosencPatch, attn: nn.Module, attr: str) -> Any:
    """The attention module's ``attr`` as the model had it before the patch changed it."""
    for module, name, value in state.saved_attrs:
        if module is attn and name == attr:
            return value
    return getattr(attn, attr, None)


def _model_rotates_layer(state: PosencPatch, attn: nn.Module, cfg: Any, layer_type: str | None) -> bool:
    """Whether the unpatched model rotates this layer (not SmolLM3's NoPE layers, Cohere2's global layers ...)."""
    if hasattr(attn, "use_rope"):
        return bool(_original_attr(state, attn, "use_rope"))
    if not _own_rotation(attn, cfg):
        return False
    return getattr(cfg, "rope_parameters", None) is None or _layer_params(cfg, layer_type) is not None


def _nested(cfg: Any) -> bool:
    """Whether the config gives ``rope_parameters`` per layer type (Gemma 3, OLMo 3)."""
    params = getattr(cfg, "rope_parameters", None)
    types = set(getattr(cfg, "layer_types", None) or [])
    return isinstance(params, dict) and bool(types & set(params))


def _with_kept(own: dict | None, out: dict) -> dict:
    for k in _KEPT_KEYS:
        if own and k in own and k not in out:
            out[k] = own[k]
    return out


def _encoding_parameters(enc: PositionalEncoding, own: dict | None, spec: Any, where: str) -> dict[str, Any]:
    """One encoding's ``rope_parameters`` set (the class of the encoding decides the rope_type)."""
    from ..rotary.mla import RoPEMLA
    from ..rotary.mrope import MRoPE
    from ..rotary.rope import RoPE
    from ..rotary.scaling import RoPEDynamicNTK, RoPELinear, RoPELlama3, RoPELongRoPE, RoPENTK, RoPEYaRN

    name = enc.info.name
    if isinstance(enc, RoPEMLA):
        inner = enc.rope
        if not isinstance(inner, RoPEYaRN):
            return _with_kept(own, {"rope_type": "default", "rope_theta": float(inner.base)})
        out = _yarn(inner)
        if enc.mscale_all_dim is not None:  # DeepSeek-V3's softmax scale μ(s, mscale_all_dim)² reads it
            out["mscale_all_dim"] = float(enc.mscale_all_dim)
        return _with_kept(own, out)
    if isinstance(enc, MRoPE):
        section = (own or {}).get("mrope_section")
        out = {"rope_type": "default", "rope_theta": float(enc.base)}
        if section is not None:
            out["mrope_section"] = list(section)
        return _with_kept(own, out)
    if type(enc) is RoPE:
        return _with_kept(own, {"rope_type": "default", "rope_theta": float(enc.base)})
    if type(enc) is RoPENTK:  # NTK by base: RoPE with θ' = θ · s^(d/(d-2))
        return _with_kept(own, {"rope_type": "default", "rope_theta": float(enc.scaled_base)})
    if type(enc) is RoPELinear:
        return _with_kept(own, {"rope_type": "linear", "factor": float(enc.factor), "rope_theta": float(enc.base)})
    if type(enc) is RoPEDynamicNTK:
        return _with_kept(own, {"rope_type": "dynamic", "factor": float(enc.factor), "rope_theta": float(enc.base)})
    if type(enc) is RoPEYaRN:
        return _with_kept(own, _yarn(enc))
    if type(enc) is RoPELlama3:
        return _with_kept(
            own,
            {
                "rope_type": "llama3",
                "factor": float(enc.factor),
                "original_max_position_embeddings": int(enc.original_max_len),
                "low_freq_factor": float(enc.low_freq_factor),
                "high_freq_factor": float(enc.high_freq_factor),
                "rope_theta": float(enc.base),
            },
        )
    if type(enc) is RoPELongRoPE:
        pairs = enc.rotary_dim // 2
        # the factors as the patch was given them (or the model's own, which it took); the encoding keeps only
        # the frequencies they make, which _check_frequencies compares with transformers'
        given = dict(spec[1]) if isinstance(spec, tuple) else {}
        kept = own if (own or {}).get("rope_type") == "longrope" else {}
        short = [float(v) for v in (given.get("short_factor") or (kept or {}).get("short_factor") or [])]
        long = [float(v) for v in (given.get("long_factor") or (kept or {}).get("long_factor") or [])]
        if len(short) != pairs or len(long) != pairs:
            shape = torch.arange(0, enc.rotary_dim, 2, dtype=torch.int64).float() / enc.rotary_dim
            base_freq = enc.base**shape
            short = (1.0 / (enc.inv_freq.double() * base_freq.double())).tolist()
            long = (1.0 / (enc.long_inv_freq.double() * base_freq.double())).tolist()
        out = {
            "rope_type": "longrope",
            "short_factor": short,
            "long_factor": long,
            "original_max_position_embeddings": int(enc.original_max_len),
            "attention_factor": float(enc.attention_factor),
            "rope_theta": float(enc.base),
        }
        if enc.factor is not None:
            out["factor"] = float(enc.factor)
        return _with_kept(own, out)
    raise _refuse(name, _WHY.get(name, f"{where} {name} is not one of the RoPE scalings transformers computes"))


def _yarn(enc: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "rope_type": "yarn",
        "factor": float(enc.factor),
        "original_max_position_embeddings": int(enc.original_max_len),
        "beta_fast": float(enc.beta_fast),
        "beta_slow": float(enc.beta_slow),
        "attention_factor": float(enc.attention_factor),
        "rope_theta": float(enc.base),
    }
    if not enc.truncate:
        out["truncate"] = False
    return out


def _layers(model: nn.Module) -> tuple[Any, PosencPatch | None, list[nn.Module], list[str | None]]:
    hf = _unwrap(model)
    base, family = _base_and_family(hf)
    cfg = text_config(hf)
    attns = family.attention(base)
    types = getattr(cfg, "layer_types", None)
    types = list(types[: len(attns)]) if isinstance(types, (list, tuple)) and len(types) >= len(attns) else None
    return cfg, _patch_of(hf), attns, types or [None] * len(attns)


def _describe(model: nn.Module) -> dict[str, Any]:
    """The native description of the patch: ``rope_parameters`` and, where the model's config switches RoPE per
    layer, ``no_rope_layers``. Refuses what no native config expresses."""
    hf = _unwrap(model)
    cfg, state, attns, types = _layers(hf)
    own_all = copy.deepcopy(getattr(cfg, "rope_parameters", None))
    if state is None:
        return {"rope_parameters": own_all}
    cls = type(hf).__name__
    nested = _nested(cfg)
    family = _base_and_family(hf)[1]
    rotary = family.rotary(_base_and_family(hf)[0])
    switch = list(getattr(cfg, "no_rope_layers", None) or []) if any(hasattr(a, "use_rope") for a in attns) else []
    can_switch = len(switch) >= len(attns) and getattr(cfg, "model_type", None) == "smollm3"
    groups: dict[str | None, list[tuple[int, dict[str, Any], str]]] = {}
    new_switch = list(switch)
    for i, attn in enumerate(attns):
        key = types[i] if nested else None
        own = _layer_params(cfg, types[i]) if nested else own_all
        enc = state.layer_encodings[i] if i < len(state.layer_encodings) else None
        rotates = _model_rotates_layer(state, attn, cfg, types[i])
        if enc is None:
            if rotates:
                groups.setdefault(key, []).append((i, dict(own or {}), "the model's own RoPE"))
            continue
        name = enc.info.name
        if name == "nope":
            if not rotates:
                continue
            if can_switch:
                new_switch[i] = 0
                continue
            raise _refuse(
                name,
                f"layer {i} gets no positional encoding, but {cls}'s config cannot switch RoPE off on one layer "
                "(SmolLM3's no_rope_layers can): this schedule is one the family cannot switch",
            )
        if name in _WHY:
            raise _refuse(name, _WHY[name])
        trained = [n for n, _ in enc.named_parameters()]
        if trained:
            raise _refuse(
                name,
                f"its parameters ({', '.join(trained[:3])}{' ...' if len(trained) > 3 else ''}) are trained with the "
                "model, and a native config holds only the numbers its rotation is computed from",
            )
        if enc.info.family != "rotary":
            raise _refuse(
                name,
                f"it is a {enc.info.family} encoding, and transformers' configs describe positions only as a rotation "
                "(rope_parameters) of the model's queries and keys",
            )
        if not _cos_sin_ok(enc, rotary, types[i] if nested else None, state.layout):
            raise _refuse(
                name,
                f"on layer {i} it rotates other channels or pairs than {cls}'s own rotary module does (or adds a hook "
                "of its own), so that posenc's attention applies it, not transformers' rotation",
            )
        spec = state.layer_specs[i] if i < len(state.layer_specs) else None
        params = _encoding_parameters(enc, own, spec, f"layer {i}:")
        if nested and params.get("truncate") is False:
            raise _refuse(
                name,
                "YaRN with truncate=False per layer type: transformers reads truncate only from a flat rope_parameters",
            )
        if not rotates:
            if can_switch:
                new_switch[i] = 1
            else:
                raise _refuse(
                    name,
                    f"layer {i} has no RoPE in {cls} (its config rotates only some layers), and the config cannot "
                    "switch RoPE on for it: this schedule is one the family cannot switch",
                )
        groups.setdefault(key, []).append((i, params, name))
    out_params: dict[str, Any] = {}
    for key, members in groups.items():
        first = members[0]
        for other in members[1:]:
            if other[1] != first[1]:
                if nested:
                    why = (
                        f"layers {first[0]} and {other[0]} are both {key!r} layers but get different RoPE settings "
                        f"({first[2]} and {other[2]}), while {cls}'s rope_parameters are one set per layer type"
                    )
                    raise _refuse(state.name, why + ": this schedule is one the family cannot switch")
                why = (
                    f"layer {first[0]} gets {first[2]} and layer {other[0]} gets {other[2]}, but {cls} has one "
                    "rope_parameters for every layer (no layer types with settings of their own): no native config "
                    "expresses a per-layer patch on it"
                )
                raise _refuse(state.name, why)
        if key is None:
            out_params = first[1]
        else:
            out_params[key] = first[1]
    if nested:  # layer types no patched layer rotates with keep theirs
        for key, value in (own_all or {}).items():
            out_params.setdefault(key, copy.deepcopy(value))
    elif not out_params:
        out_params = own_all or {}
    described: dict[str, Any] = {"rope_parameters": out_params}
    if can_switch and new_switch != switch:
        described["no_rope_layers"] = new_switch
    return described


def native_rope_parameters(model: nn.Module) -> dict[str, Any]:
    """The patch of ``model`` as transformers' native ``rope_parameters`` (what its ``config.json`` holds).

    The shape is transformers 5's:

    * one set for every layer (Llama, Qwen2, SmolLM3, Phi-3, DeepSeek-V3, Cohere2 ...):
      ``{"rope_type": T, "rope_theta": θ, ...T's fields}``;
    * one set per layer type where the model's config nests them (Gemma 3, OLMo 3):
      ``{"sliding_attention": {"rope_type": ...}, "full_attention": {"rope_type": ...}}`` (each type present).

    ``T`` is ``"default"`` (RoPE with ``rope_theta``; posenc's ``rope-ntk`` is RoPE with the NTK-scaled θ),
    ``"linear"`` / ``"dynamic"`` (``factor``), ``"yarn"`` (``factor``, ``original_max_position_embeddings``,
    ``beta_fast``, ``beta_slow``, ``attention_factor``; ``mscale_all_dim`` for DeepSeek-V3's softmax scale; ``truncate``
    only where it is ``False``), ``"llama3"`` (``factor``, ``original_max_position_embeddings``, ``low_freq_factor``,
    ``high_freq_factor``) or ``"longrope"`` (``short_factor``, ``long_factor`` lists of rotary_dim/2 numbers,
    ``original_max_position_embeddings``, ``attention_factor``, ``factor``). The model's own
    ``partial_rotary_factor`` (and Qwen2-VL's ``mrope_section``) are kept. Numbers are Python floats / ints, lists
    are lists: the dict is JSON as it is, and a fresh copy (changing it changes nothing in the model).

    A model not patched gives its own ``rope_parameters``. A patch no native config expresses is a
    :class:`~posenc.errors.ConfigError` naming the encoding and why, pointing at :func:`posenc.hf.save_pretrained`.
    (SmolLM3's NoPE layers that a schedule switches are in ``no_rope_layers``, which :func:`export` writes too.)
    """
    return _describe(model)["rope_parameters"]


def _trained_length(cfg: Any, own: dict | None) -> int:
    original = (own or {}).get("original_max_position_embeddings") or getattr(
        cfg, "original_max_position_embeddings", None
    )
    return int(original or cfg.max_position_embeddings)


def _stretched_length(cfg: Any, params: dict[str, Any], own: dict | None) -> int | None:
    """The context one set of parameters is stretched to (``factor × original``), ``None`` for plain RoPE."""
    kind = params.get("rope_type", "default")
    if kind in ("default", "dynamic"):
        return None
    factor = params.get("factor")
    if factor is None:
        return None
    original = params.get("original_max_position_embeddings") or _trained_length(cfg, own)
    return int(round(float(factor) * int(original)))


def _ntk_lengths(model: nn.Module, cfg: Any) -> list[int]:
    """The stretched lengths of the patch's NTK-by-base layers (``factor ×`` the trained length): their native
    parameters are plain RoPE with another θ, which says no length."""
    from ..rotary.scaling import RoPENTK

    state = _patch_of(model)
    if state is None:
        return []
    own = getattr(cfg, "rope_parameters", None)
    trained = _trained_length(cfg, own if isinstance(own, dict) and "rope_type" in own else None)
    return [int(round(e.factor * trained)) for e in state.layer_encodings if type(e) is RoPENTK]


def native_config_changes(model: nn.Module, max_length: int | None = None) -> dict[str, Any]:
    """What :func:`export` sets in (a copy of) the model's config: ``rope_parameters`` (as
    :func:`native_rope_parameters`), ``max_position_embeddings`` (the stretched length: ``factor × original`` of
    the scalings that stretch, or ``max_length``), ``original_max_position_embeddings`` where the config keeps it
    outside ``rope_parameters`` (Phi-3), and SmolLM3's ``no_rope_layers`` where a schedule switches them."""
    hf = _unwrap(model)
    cfg = text_config(hf)
    described = _describe(hf)
    params = described["rope_parameters"]
    nested = _nested(cfg)
    sets = {k: v for k, v in params.items() if isinstance(v, dict)} if nested else {None: params}
    own_all = getattr(cfg, "rope_parameters", None) or {}
    dynamic = [p for p in sets.values() if p.get("rope_type") == "dynamic"]
    out: dict[str, Any] = {"rope_parameters": params}
    if "no_rope_layers" in described:
        out["no_rope_layers"] = described["no_rope_layers"]
    if dynamic:
        # transformers' dynamic NTK takes max_position_embeddings as the trained length it grows from
        trained = int(cfg.max_position_embeddings)
        if max_length is not None and int(max_length) != trained:
            raise ConfigError(
                f"max_length={max_length}: with rope-dynamic transformers reads max_position_embeddings as the trained "
                f"length its NTK scaling starts from ({trained} here), so the exported config keeps it; leave "
                "max_length out"
            )
        out["max_position_embeddings"] = trained
        return out
    if max_length is not None:
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length <= 0:
            raise ConfigError(
                f"max_length must be a positive integer (the exported context length), got {max_length!r}"
            )
        out["max_position_embeddings"] = int(max_length)
    else:
        lengths = [
            n
            for k, p in sets.items()
            if p != ((own_all.get(k) if k is not None else own_all) or {})
            and (n := _stretched_length(cfg, p, own_all.get(k) if k is not None else own_all)) is not None
        ]
        lengths += _ntk_lengths(hf, cfg)
        out["max_position_embeddings"] = max(lengths) if lengths else int(cfg.max_position_embeddings)
    originals = [p.get("original_max_position_embeddings") for p in sets.values()]
    originals = [o for o in originals if o is not None]
    if getattr(cfg, "original_max_position_embeddings", None) is not None and originals:
        out["original_max_position_embeddings"] = int(originals[0])
    return out


def _exported_config(model: nn.Module, changes: dict[str, Any]) -> Any:
    """A copy of the model's config with ``changes`` and without posenc's record."""
    from .patching import CONFIG_KEY

    hf = _unwrap(model)
    config = copy.deepcopy(hf.config)
    target = text_config_of(config)
    for k, v in changes.items():
        setattr(target, k, copy.deepcopy(v))
    for c in {id(config): config, id(target): target}.values():
        if CONFIG_KEY in c.__dict__:
            delattr(c, CONFIG_KEY)
    return config


def text_config_of(config: Any) -> Any:
    """The text decoder's part of a config (itself, or its ``text_config``)."""
    inner = getattr(config, "text_config", None)
    return inner if inner is not None and getattr(inner, "hidden_size", None) is not None else config


def _check_frequencies(model: nn.Module, config: Any) -> None:
    """The exported config's inverse frequencies and attention factor, as transformers computes them, are the
    patch's own, exactly (float32; at lengths within and beyond the trained one for the length-dependent
    scalings); a difference is a bug in the export and is refused rather than written."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = _unwrap(model)
    cfg, state, attns, types = _layers(hf)
    if state is None:
        return
    target = text_config_of(config)
    nested = _nested(cfg)
    seen: set[int] = set()
    for i, enc in enumerate(state.layer_encodings):
        if enc is None or id(enc) in seen or enc.info.family != "rotary":
            continue
        seen.add(id(enc))
        layer_type = types[i] if nested else None
        params = target.rope_parameters[layer_type] if nested else target.rope_parameters
        kind = params.get("rope_type", "default")
        rope = getattr(enc, "rope", enc)  # rope-mla: the slice's RoPE
        original = getattr(rope, "original_max_len", None) or int(target.max_position_embeddings)
        lengths = [None, original + 1, 2 * original + 3] if getattr(rope, "length_dependent", False) else [None]
        for n in lengths:
            ours = rope.frequencies(n) if n is not None else rope.inv_freq
            our_scale = float(getattr(rope, "attention_factor", 1.0))
            if kind == "default":
                dim = rope.rotary_dim
                theirs = 1.0 / (
                    float(params["rope_theta"]) ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
                )
                scale = 1.0
            else:
                kwargs = {"layer_type": layer_type} if layer_type is not None else {}
                # a tensor length, as transformers' forward passes it (max(position_ids) + 1)
                length = torch.tensor(n) if n is not None and kind == "dynamic" else n
                theirs, scale = ROPE_INIT_FUNCTIONS[kind](copy.deepcopy(target), "cpu", seq_len=length, **kwargs)
            if (
                theirs.shape != ours.shape
                or not torch.equal(theirs.float(), ours.float().cpu())
                or not math.isclose(float(scale), our_scale, rel_tol=0, abs_tol=0)
            ):
                diff = (
                    (theirs.double() - ours.double().cpu()).abs().max().item() if theirs.shape == ours.shape else None
                )
                raise ConfigError(
                    f"posenc.hf.export: transformers would compute other frequencies from the exported "
                    f"rope_parameters ({params}) than the patch's {enc.info.name} on layer {i} (largest difference "
                    f"{diff}, attention factor {scale} vs {our_scale}); please report this. {_INSTEAD}"
                )


def export(
    model: nn.Module,
    folder: str | os.PathLike,
    format: str = "transformers",  # noqa: A002 -- the public name of the choice
    *,
    tokenizer: Any = None,
    max_length: int | None = None,
    **kwargs: Any,
) -> Path:
    """Write ``model`` with its patch in a runtime's own format; returns where it went.

    Args:
        model: a transformers model, patched by :func:`posenc.hf.patch` (or not: then it is written as it is).
        folder: the folder to write (``format="transformers"``), or the ``.gguf`` file / a folder for it
            (``format="gguf"``).
        format: ``"transformers"``: a folder that stock transformers loads with ``AutoModelForCausalLM`` and no
            posenc: the weights (the model's own; posenc adds none to a RoPE scaling), the tokenizer when given, and a
            ``config.json`` whose native ``rope_parameters`` express the patch (:func:`native_rope_parameters`),
            with ``max_position_embeddings`` set to the stretched length. ``"gguf"``: a llama.cpp file, written by
            :mod:`posenc.hf.export_gguf` from the same description.
        tokenizer: the model's tokenizer, saved beside it.
        max_length: the exported context length (``max_position_embeddings``); default ``factor ×`` the trained
            length of the scaling.
        kwargs: ``format="transformers"``: passed to ``save_pretrained`` (``safe_serialization``, ``max_shard_size``
            ...); ``format="gguf"``: to the GGUF writer.

    The model is not changed. A patch no native config expresses (ALiBi, T5, FIRE, trained encoding parameters,
    a schedule the family cannot switch) is a :class:`~posenc.errors.ConfigError` that names it and points at
    :func:`posenc.hf.save_pretrained`, posenc's own format.
    """
    if not isinstance(format, str) or format not in FORMATS:
        raise ConfigError(f"format must be one of {', '.join(map(repr, FORMATS))}, got {format!r}")
    if not isinstance(folder, (str, os.PathLike)) or not str(folder).strip():
        raise ConfigError(f"folder must be a path to write the export to, got {folder!r}")
    if not isinstance(model, nn.Module) or not hasattr(_unwrap(model), "config"):
        raise ConfigError(
            f"model must be a transformers model (patched by posenc.hf.patch), got {type(model).__name__}"
        )
    changes = native_config_changes(model, max_length)
    config = _exported_config(model, changes)
    _check_frequencies(model, config)
    if format == "gguf":
        from .export_gguf import write_gguf

        return write_gguf(
            model,
            folder,
            tokenizer=tokenizer,
            rope=changes["rope_parameters"],
            **{k: v for k, v in changes.items() if k != "rope_parameters"},
            **kwargs,
        )
    return _write_transformers(model, Path(folder), config, tokenizer, kwargs)


def _write_transformers(model: nn.Module, out: Path, config: Any, tokenizer: Any, kwargs: dict[str, Any]) -> Path:
    """The model's own weights (its state dict without the patch module's tensors) with ``config``, and the
    tokenizer. The model itself is not changed: its config is swapped for the exported one only while saving."""
    from .patching import CONFIG_KEY

    hf = _unwrap(model)
    if "state_dict" in kwargs:
        raise ConfigError("state_dict is not an export option: export writes the model's own weights")
    weights = {k: v for k, v in hf.state_dict().items() if not _posenc_key(k)}
    out.mkdir(parents=True, exist_ok=True)
    saved_config = hf.config
    attn = getattr(saved_config, "_attn_implementation", None)
    state = _patch_of(hf)
    if state is not None and state.previous_attention is not None:
        config._attn_implementation = state.previous_attention
    elif attn == "posenc":
        config._attn_implementation = None
    try:
        hf.config = config
        hf.save_pretrained(out, state_dict=weights, **kwargs)
    finally:
        hf.config = saved_config
    written = out / "config.json"
    if written.is_file() and f'"{CONFIG_KEY}"' in written.read_text():
        raise ConfigError(f"posenc.hf.export: {written} still records the posenc patch; please report this")
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


def _posenc_key(name: str) -> bool:
    """Whether a state-dict key is one of posenc's (the patch module at ``<base>.posenc``)."""
    return ".posenc." in f".{name}"
