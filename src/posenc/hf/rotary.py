"""The rotary side of :mod:`posenc.hf`: a model's own RoPE settings as posenc options, and the hooks that hand its
attention layers their phases.

A rotary encoding patched into a rotary model starts from the model's own numbers (base, rotated width, trained
length and the fields of the scaling its ``rope_parameters`` names, per layer type where they are nested:
:func:`_layer_params`; ``"rope"`` alone is each layer's own RoPE, :func:`own_rotary_name`). Where HF's own rotation
can apply the encoding (:func:`_cos_sin_ok`: RoPE rotating the pairs the model rotates, over its width), the hook on
the model's rotary module (:func:`_rotary_output`) hands each layer type the encoding's phases in the model's layout
(:func:`rotary_layout`: rotate-half cos/sin, Cohere2's interleaved cos/sin, Llama 4's complex numbers) and the
attention stays transformers' own; otherwise it hands the identity and the rotation moves into posenc's attention.
A layer whose phases differ from the others of its type gets its own from a hook on its attention module
(:func:`_layer_phases`). M-RoPE (Qwen2-VL, Qwen2.5-VL) takes its phases from the three position rows the rotary
module is called with; DeepSeek-V3's decoupled RoPE (``rope-mla``) hands the phases of its slice, which the model
rotates in its own layout. In posenc's attention, a rotation that depends on each key and its position alone
(:func:`rotates_per_key`: RoPE in the interleaved layout, xPos) rotates each key once, in the KV cache
(:func:`rotate_in_cache`), rather than every cached key at every decoding step.

Imports :mod:`posenc.hf.state` and, from below :mod:`posenc.hf`, the registry, the base class, the RoPE classes
and the errors.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ..base import AttentionContext, PositionalEncoding, as_position_rows, is_arange_rows, mark_arange
from ..errors import ConfigError
from ..registry import accepted_arguments
from .families import MROPE_ROTARY, text_config
from .state import PosencPatch

#: posenc's RoPE scalings and the rope_type transformers gives the same one in ``rope_parameters``
HF_ROPE_TYPES = {
    "rope-linear": "linear",
    "rope-dynamic": "dynamic",
    "rope-yarn": "yarn",
    "rope-llama3": "llama3",
    "rope-longrope": "longrope",
}
#: the scaling fields of ``rope_parameters`` and the posenc option each one sets
HF_ROPE_FIELDS = {
    "factor": "factor",
    "original_max_position_embeddings": "original_max_len",
    "low_freq_factor": "low_freq_factor",
    "high_freq_factor": "high_freq_factor",
    "beta_fast": "beta_fast",
    "beta_slow": "beta_slow",
    "attention_factor": "attention_factor",
    "mscale": "mscale",
    "mscale_all_dim": "mscale_all_dim",
    "truncate": "truncate",
    "long_factor": "long_factor",
    "short_factor": "short_factor",
}


def _rotary_dim_of(rotary: nn.Module | None, layer_type: str | None = None) -> int | None:
    """The width the model's rotary module rotates (of one layer type's frequencies where it has its own)."""
    inv = getattr(rotary, f"{layer_type}_inv_freq" if layer_type else "inv_freq", None)
    if not isinstance(inv, Tensor):
        inv = getattr(rotary, "inv_freq", None)
    if not isinstance(inv, Tensor):
        return None
    # HF's partial rotary in the rotate-half layout pads inv_freq with zeros (Gemma 4 style): those do not rotate
    return 2 * int(inv.numel())


def _rope_parameters_by_type(
    config: Any, n_layers: int, rotary_encoding: bool = True
) -> list[tuple[str, dict]] | None:
    """Each layer's (type, rope_parameters) where the model's layer types have their own RoPE settings (Gemma 3's
    sliding and global layers), else None."""
    params = getattr(config, "rope_parameters", None)
    types = getattr(config, "layer_types", None)
    if not isinstance(params, dict) or not types or len(types) < n_layers:
        return None
    kinds = set(types[:n_layers])
    if not any(t in params for t in kinds):
        return None  # one set of settings for every layer
    missing = sorted(t for t in kinds if not isinstance(params.get(t), dict))
    if missing and not rotary_encoding:
        return [(t, {}) for t in types[:n_layers]]
    if missing:
        raise ConfigError(
            f"this model's rope_parameters are per layer type but give none for {', '.join(missing)} (layers "
            "without RoPE): posenc.hf cannot tell which encoding those layers should get; patch a model whose layer "
            "types all have RoPE settings"
        )
    return [(t, params[t]) for t in types[:n_layers]]


def _rotary_defaults(
    model: nn.Module, cls: type[PositionalEncoding], rotary_dim: int | None, params: dict | None
) -> dict[str, Any]:
    """A rotary encoding on a rotary model defaults to the model's own settings, read as transformers reads them:
    its base (``rope_theta``), rotated width and trained length (``original_max_position_embeddings``, else
    ``max_position_embeddings``); a RoPE scaling of the type the model's ``rope_parameters`` names also takes its
    scaling fields (``factor``, ``low_freq_factor``, ``beta_fast``, ``attention_factor`` ...), with ``factor``
    derived as ``max_position_embeddings / original_max_position_embeddings`` where transformers derives it."""
    if cls.info.family != "rotary":
        return {}
    params = params or {}
    cfg = text_config(model)
    accepted = accepted_arguments(cls)
    out: dict[str, Any] = {}
    if "base" in accepted and "rope_theta" in params:
        out["base"] = float(params["rope_theta"])
    if cls.info.name == "rope-mla":
        return {**out, **_mla_defaults(cfg, params)}
    if "rotary_dim" in accepted and rotary_dim is not None:
        out["rotary_dim"] = rotary_dim
    original = params.get("original_max_position_embeddings") or getattr(cfg, "original_max_position_embeddings", None)
    if "original_max_len" in accepted:
        out["original_max_len"] = int(original or cfg.max_position_embeddings)
    if "mrope_section" in accepted and isinstance(params.get("mrope_section"), (list, tuple)):
        out["mrope_section"] = [int(v) for v in params["mrope_section"]]  # Qwen2-VL's sections of the rotary pairs
    if HF_ROPE_TYPES.get(cls.info.name) == params.get("rope_type"):
        for field, option in HF_ROPE_FIELDS.items():
            value = params.get(field)
            if value is not None and option in accepted:
                out[option] = list(value) if isinstance(value, (list, tuple)) else value
        if "factor" in accepted and params.get("factor") is None and original:
            out["factor"] = float(cfg.max_position_embeddings) / float(original)
    return out


def _mla_defaults(cfg: Any, params: dict) -> dict[str, Any]:
    """``rope-mla`` on a model with multi-head latent attention (DeepSeek-V3) takes its rotated slice
    (``qk_rope_head_dim``), its pairs' layout (``rope_interleave``) and, where its ``rope_parameters`` name YaRN,
    DeepSeek's YaRN fields (``factor``, ``original_max_position_embeddings``, ``beta_fast`` / ``beta_slow``,
    ``mscale`` / ``mscale_all_dim``)."""
    out: dict[str, Any] = {}
    if getattr(cfg, "qk_rope_head_dim", None) is not None:
        out["rope_dim"] = int(cfg.qk_rope_head_dim)
    out["interleaved"] = bool(getattr(cfg, "rope_interleave", True))
    if params.get("rope_type") == "yarn":
        fields = {"factor": "factor", "original_max_position_embeddings": "original_max_len"}
        fields.update(beta_fast="beta_fast", beta_slow="beta_slow", mscale="mscale", mscale_all_dim="mscale_all_dim")
        for field, option in fields.items():
            if params.get(field) is not None:
                out[option] = params[field]
        if out.get("original_max_len") is None:
            trained = getattr(cfg, "original_max_position_embeddings", None) or cfg.max_position_embeddings
            out["original_max_len"] = int(trained)
    return out


def _layer_params(config: Any, layer_type: str | None) -> dict | None:
    """The ``rope_parameters`` of a layer of type ``layer_type``, in each form transformers 5 writes them: one set for
    every layer (``{"rope_type": ..., "rope_theta": ...}``), or one per layer type (``{"sliding_attention": {...},
    "full_attention": {...}}``: Gemma 3, OLMo 3, ModernBERT); ``None`` where the type has none (no RoPE)."""
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict):
        return None
    types = set(getattr(config, "layer_types", None) or [])
    if any(isinstance(v, dict) for v in params.values()) or types & set(params):
        got = params.get(layer_type) if layer_type is not None else None
        return got if isinstance(got, dict) else None
    return params


def own_rotary_name(params: dict | None, where: str, mrope: bool = False) -> str:
    """The posenc encoding that is a layer's own RoPE as its ``rope_parameters`` name it (``rope_type``: default ->
    ``rope``, linear -> ``rope-linear``, yarn -> ``rope-yarn`` ...; with ``mrope_section``, ``mrope`` on a model
    whose M-RoPE posenc.hf reproduces, ``mrope``: Qwen2-VL, Qwen2.5-VL); a type posenc does not have is refused."""
    rope_type = (params or {}).get("rope_type", "default") or "default"
    section = (params or {}).get("mrope_section")
    if isinstance(section, (list, tuple)):
        if mrope and rope_type == "default":
            return "mrope"  # Qwen2-VL / Qwen2.5-VL: RoPE on three position rows, in sections of the rotary pairs
        raise ConfigError(
            f"{where} has a multimodal RoPE (mrope_section {list(section)} in its rope_parameters, rope_type "
            f"{rope_type!r}) whose layout posenc.hf reproduces only for Qwen2-VL and Qwen2.5-VL "
            "(mrope); name the encoding you want for it"
        )
    if rope_type == "default":
        return "rope"
    for name, hf_type in HF_ROPE_TYPES.items():
        if hf_type == rope_type:
            return name
    known = ", ".join(["default", *HF_ROPE_TYPES.values()])
    raise ConfigError(
        f"{where} has rope_type {rope_type!r} in its rope_parameters, which posenc has no encoding for (it reproduces "
        f"the rope_types {known}); name the encoding you want for it"
    )


def rotary_layout(rotary: nn.Module, layer_type: str | None = None) -> str:
    """How the model's rotary module lays out its phases, read from what it returns at a position: ``"half"``
    (Llama's rotate-half: each frequency twice, ``cat(f, f)``), ``"once"`` (gpt-oss: each once), ``"interleaved"``
    (Cohere2: ``f0 f0 f1 f1 ...``, pairs ``(2i, 2i+1)``) or ``"complex"`` (Llama 4: ``e^{i m θ}`` as complex numbers,
    pairs ``(2i, 2i+1)``)."""
    import inspect

    hidden = torch.zeros(1, 2, 1)
    pos = torch.tensor([[0, 5]])
    kwargs = {"layer_type": layer_type} if "layer_type" in inspect.signature(rotary.forward).parameters else {}
    with torch.no_grad():
        out = rotary(hidden, pos, **kwargs)
    if isinstance(out, Tensor) and out.is_complex():
        return "complex"
    cos = out[0][..., -1, :].reshape(-1).float()
    n = _rotary_dim_of(rotary, layer_type)
    if n is not None and cos.numel() == n // 2:
        return "once"
    half = cos.numel() // 2
    if torch.equal(cos[:half], cos[half:]):
        return "half"
    if torch.equal(cos[0::2], cos[1::2]):
        return "interleaved"
    return "half"


def _cos_sin_ok(
    enc: PositionalEncoding, rotary: nn.Module | None, layer_type: str | None = None, layout: str = "half"
) -> bool:
    """Whether HF's own rotation can apply this encoding: RoPE (any scaling) whose pairs are the model's (the
    rotate-half pairs ``(i, i + d/2)`` where the model rotates those, else ``(2i, 2i+1)``) over the width the model
    rotates, and nothing else."""
    from ..rotary.mla import RoPEMLA
    from ..rotary.mrope import MRoPE
    from ..rotary.rope import RoPE
    from ..rotary.scaling import ScaledRoPE

    if isinstance(enc, MRoPE):  # per-pair phases of three rows, in the rotate-half layout (Qwen2-VL's rotary module)
        return (
            rotary is not None
            and type(rotary).__name__ in MROPE_ROTARY
            and layout == "half"
            and enc.hooks() == {"rotate"}
            and not any(True for _ in enc.parameters())
            and enc.rotary_dim == _rotary_dim_of(rotary, layer_type)
        )
    if isinstance(enc, RoPEMLA):  # the slice's phases; the model's own rotation applies them in its own layout
        return (
            rotary is not None
            and layout == "half"
            and enc.rope_dim == _rotary_dim_of(rotary, layer_type)
            and not enc.rope_first
            and enc.hooks() <= {"rotate", "scale"}
        )
    return (
        rotary is not None
        and isinstance(enc, RoPE)
        and bool(enc.interleaved) == (layout in ("interleaved", "complex"))
        and type(enc).rotate in (RoPE.rotate, ScaledRoPE.rotate)
        and enc.hooks() == {"rotate"}
        and enc.rotary_dim == _rotary_dim_of(rotary, layer_type)
    )


def _phases(state: PosencPatch, want: PositionalEncoding | str, out: Any, position_ids: Tensor | None) -> Any:
    """What a rotary module returning ``out`` (cos/sin, or complex phases) returns instead: ``want``'s phases in the
    model's layout, the identity, or ``out`` itself (``"own"``). Made once per forward for each encoding."""
    if isinstance(want, str):
        if want == "own":
            return out
        if isinstance(out, Tensor):
            return torch.ones_like(out)
        cos, sin = out
        return torch.ones_like(cos), torch.zeros_like(sin)
    template = out if isinstance(out, Tensor) else out[0]
    three = None  # three position rows (time, height, width: Qwen2-VL's M-RoPE), for an encoding that takes them
    if position_ids is not None and position_ids.dim() == 3:
        if hasattr(want, "axis_cos_sin"):
            three = position_ids
        else:
            position_ids = state.positions  # any other encoding: the forward's one position per token
    if position_ids is None:
        position_ids = state.positions
    key = ("hf-phases", id(want), id(position_ids), tuple(template.shape), template.dtype)
    got = state.forward_cache.get(key) if position_ids is not None else None
    if got is not None and got[0] is position_ids:
        return got[1]
    rows = as_position_rows(position_ids, template.shape[-2]) if three is None else three
    made: Any
    if isinstance(out, Tensor) and not getattr(want, "length_dependent", False) and hasattr(want, "angles"):
        # complex phases (Llama 4) made as it makes them, polar(1, m θ) times the attention factor (torch.polar's
        # cos/sin differ from torch.cos/sin by an ulp)
        a = want.angles(rows)  # type: ignore[operator]
        z = torch.polar(torch.ones_like(a), a) * float(getattr(want, "attention_factor", 1.0))
        made = z.to(template.dtype).expand_as(template)
        if position_ids is not None:
            state.forward_cache[key] = (position_ids, made)
        return made
    if three is not None:
        c, s = want.axis_cos_sin(three)  # type: ignore[operator]
    else:
        c, s = want.cos_sin(rows)  # type: ignore[operator]
    if isinstance(out, Tensor):  # complex phases of a length-dependent scaling
        made = torch.complex(c.float(), s.float()).to(template.dtype).expand_as(template)
    else:
        cos = template
        if state.layout == "interleaved":
            c, s = c.repeat_interleave(2, dim=-1), s.repeat_interleave(2, dim=-1)
        elif cos.shape[-1] == 2 * c.shape[-1]:  # rotate-half tables repeat the phases (gpt-oss's hold them once)
            c, s = torch.cat((c, c), dim=-1), torch.cat((s, s), dim=-1)
        if cos.shape[-1] != c.shape[-1]:
            raise ConfigError(
                f"{state.name} gives {c.shape[-1]} rotary phases per position but this model's rotary module makes "
                f"{cos.shape[-1]}: its layout is not one posenc.hf knows"
            )
        made = (c.to(cos.dtype).expand_as(cos), s.to(out[1].dtype).expand_as(out[1]))
    if position_ids is not None:
        state.forward_cache[key] = (position_ids, made)
    return made


def _rotary_output(state: PosencPatch):
    """The hook on the model's rotary module: for the layer type it is called with, the encoding's cos/sin, the
    identity (the rotation happens in posenc's attention, or there is none) or its own output."""

    def hook(module: nn.Module, args: tuple, kwargs: dict, out: Any) -> Any:
        layer_type = kwargs.get("layer_type", args[2] if len(args) > 2 else None)
        want = state.by_type.get(layer_type, state.by_type.get(None, "own"))
        if isinstance(want, str) and want == "own":
            return None
        position_ids = kwargs.get("position_ids", args[1] if len(args) > 1 else None)
        return _phases(state, want, out, position_ids)

    return hook


def _layer_phases(state: PosencPatch, index: int):
    """The hook before one attention layer whose phases differ from what the rotary module hands its layer type (a
    layer patched apart from the others): its own ``position_embeddings``."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if "position_embeddings" in kwargs:
            given = kwargs["position_embeddings"]
        elif len(args) > 1:
            given = args[1]
        else:
            return None
        if given is None:
            return None
        made = _phases(state, state.layer_phases[index], given, kwargs.get("position_ids"))
        if "position_embeddings" in kwargs:
            return args, {**kwargs, "position_embeddings": made}
        return (args[0], made, *args[2:]), kwargs

    return hook


# ------------------------------------------------------------------------------------------ keys rotated once
#: the attribute of a transformers cache layer that records its keys posenc.hf stored rotated: (tag, n), the
#: first ``n`` keys rotated by the encoding ``tag`` names (:func:`rotation_tag`); the keys after them are as the
#: model projected them
ROTATED_ATTR = "_posenc_rotated"


def rotates_per_key(enc: PositionalEncoding) -> bool:
    """Whether ``enc`` rotates each key by the key and its position alone, with nothing else in the attention: RoPE
    (any layout), a RoPE scaling whose frequencies do not change with the length, xPos (whose keys keep the centre
    0 in a cache). Such a key may be rotated once, when it enters the KV cache; a length-dependent scaling, a
    randomized one, or a rotation with parameters to train may not."""
    from ..rotary.rope import RoPE
    from ..rotary.scaling import ScaledRoPE
    from ..rotary.xpos import XPos

    return (
        isinstance(enc, RoPE)
        and type(enc).rotate in (RoPE.rotate, ScaledRoPE.rotate, XPos.rotate)
        and not getattr(enc, "length_dependent", False)
        and enc.hooks() == {"rotate"}
        and not any(True for _ in enc.parameters())
    )


def rotation_tag(enc: PositionalEncoding) -> str:
    """The encoding and options whose rotation a cache's stored keys carry (equal tags rotate alike)."""
    opts = ", ".join(f"{k}={v!r}" for k, v in sorted(enc.params.items()))
    return f"{enc.info.name}({opts})"


def _cache_layer(past: Any, layer: int) -> Any:
    """Layer ``layer`` of the transformers cache ``past`` where posenc.hf can follow which of its keys are rotated
    (a dynamic or static full-attention layer: its keys are its positions 0, 1, ...), else None."""
    from transformers.cache_utils import DynamicLayer, StaticLayer

    layers = getattr(past, "layers", None)
    if not isinstance(layers, list) or not 0 <= layer < len(layers):
        return None
    entry = layers[layer]
    return entry if type(entry) in (DynamicLayer, StaticLayer) else None


def _slot_positions(pos: Tensor, start: int, cache: dict) -> bool:
    """Whether the forward's positions ``pos`` ``[B, L]`` are the cache slots ``start + arange(L)`` in every row."""
    key = ("hf-slot-positions", id(pos), start)
    got = cache.get(key)
    if got is None or got[0] is not pos:
        ok = is_arange_rows(pos, cache) and bool((pos[:, 0] == start).all())
        cache[key] = got = (pos, ok)
    return got[1]


def _rows(cache: dict, start: int, end: int, device: torch.device) -> Tensor:
    """``arange(start, end)[None]``, one tensor per forward (the encodings memoise their cos/sin by identity)."""
    key = ("hf-rotated-rows", start, end, device)
    got = cache.get(key)
    if got is None:
        cache[key] = got = mark_arange(cache, torch.arange(start, end, device=device)[None, :])
    return got


def rotate_in_cache(
    state: PosencPatch,
    enc: PositionalEncoding,
    query: Tensor,
    key: Tensor,
    stored: Tensor,
    ctx: AttentionContext,
    by_position: bool,
) -> tuple[Tensor, Tensor] | None:
    """The query and keys rotated, each cached key rotated once: the query and the keys not rotated yet, written
    back into the cache's own tensor (``stored``, what ``update`` returned) with a record on the cache layer of how
    many leading keys are rotated; or None where this does not apply (the caller rotates every key).

    Applies to an encoding that :func:`rotates_per_key`, with a dynamic or static full-attention cache layer
    (``past_key_values`` of the forward; its keys are its positions ``0 .. n-1``, the positions posenc.hf gives
    cached keys) and the forward's positions those slots. The record follows the cache: a key past the cache's
    length before this forward (its ``get_seq_length``) counts as not rotated, so a reset, a cropped (assisted
    decoding) or a newly made cache is right; a beam reordering moves whole rows; a copy of the cache carries its
    record. Where the keys may not be written (gradients on, ``torch.compile`` tracing, a half-precision model whose
    keys posenc computes on in float32), the keys already rotated are taken as they are and the rest rotated
    here. A cache whose keys another encoding rotated is refused: its keys cannot be turned back."""
    tag = state.key_rotation.get(ctx.layer)
    past = state.past() if state.past is not None else None
    sizes = state.cache_sizes.get(ctx.layer) if state.cache_sizes else None
    if tag is None or past is None or sizes is None:
        return None
    entry = _cache_layer(past, ctx.layer)
    q_start, k_start, _ = sizes
    lq, lk = query.shape[-2], key.shape[-2]
    end = q_start + lq
    if entry is None or k_start != 0 or end > lk:
        return None
    record = entry.__dict__.get(ROTATED_ATTR)
    done = 0
    if record is not None:
        if record[0] != tag:
            raise ConfigError(
                f"this KV cache holds keys that posenc.hf stored rotated by {record[0]}, but this model is patched "
                f"with {tag}: those keys cannot be turned back to be rotated again. Start a new cache "
                "(past_key_values=None, or a new DynamicCache) for this patch"
            )
        done = min(int(record[1]), q_start)
        entry.__dict__[ROTATED_ATTR] = (tag, done)  # keys past the cache's length were dropped or are overwritten
    if not by_position and not _slot_positions(ctx.q_pos, q_start, ctx.cache):
        return None  # the forward's own positions (a padded batch's): the keys are rotated at each step
    write = (
        stored is key
        and getattr(entry, "keys", None) is stored
        and not torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
    )
    if record is None and not write:
        return None
    rows = _rows(ctx.cache, done, end, key.device)
    sub = AttentionContext(
        q_pos=_rows(ctx.cache, q_start, end, key.device) if done != q_start else rows,
        k_pos=rows,
        n_heads=ctx.n_heads,
        head_dim=ctx.head_dim,
        layer=ctx.layer,
        reference=ctx.reference,
        cache=ctx.cache,
        caching=True,
    )
    query, fresh = enc.rotate(query, key[:, :, done:end], sub)
    if write:
        key[:, :, done:end] = fresh
        entry.__dict__[ROTATED_ATTR] = (tag, end)
        return query, key
    return query, torch.cat((key[:, :, :done], fresh, key[:, :, end:]), dim=-2)
