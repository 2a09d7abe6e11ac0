"""The entry points of :mod:`posenc.hf`: :func:`patch` and :func:`unpatch`.

``patch`` reads the model (its family, sizes, dtype and RoPE settings), builds the encoding(s), decides where the
encoding acts (HF's own rotation, posenc's attention, the embedding), refuses what cannot work with the reason,
adds the :class:`~posenc.hf.state.PosencPatch` module and its attention cores, installs the hooks, runs the
encoding once on two positions (:func:`_probe`) and records the patch in ``model.config.posenc``. Any failure
leaves the model as it was.

Imports the other parts of :mod:`posenc.hf` but :mod:`posenc.hf.checkpoints`, and from below it the attention
core, the base class, the registry, the errors and the version.
"""

from __future__ import annotations

import inspect
import json
from typing import Any

import torch
from torch import nn

from .._version import __version__
from ..attention import AttentionCore
from ..base import PositionalEncoding
from ..errors import ConfigError, PosencError
from ..registry import MODEL_DIMENSIONS, build, resolve
from .attention import posenc_attention
from .families import Family, _base_and_family, _model_dims, _model_dtype_device, _unwrap
from .hooks import _add_codes, _install, _uninstall
from .rotary import (
    _cos_sin_ok,
    _rope_parameters_by_type,
    _rotary_defaults,
    _rotary_dim_of,
    rotates_per_key,
    rotation_tag,
)
from .state import PosencPatch, _check_dtype, _patch_of, _settle_dtype

#: the attribute of ``model.config`` that records the patch (saved in ``config.json``)
CONFIG_KEY = "posenc"
#: the encoding hooks that act inside the attention
_ATTENTION_HOOKS = frozenset({"rotate", "logits", "bias", "values", "scale"})


#: the transformers release posenc.hf's tests and support matrix ran against (``constraints.txt`` pins it; a test
#: keeps the two equal). posenc.hf reads transformers' internals (its cache's argument name and mask sizes, the
#: rotary module, the attention registry), which a later release may change: transformers 5.24 renamed the
#: forward's ``past_key_values`` to ``cache``.
TESTED_TRANSFORMERS = "5.24.0"
_warned_version: list[str] = []


def _release(version: str) -> tuple[int, ...]:
    out = []
    for part in version.split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit()) if part[:1].isdigit() else ""
        out.append(int(digits or 0))
    return tuple(out)


def check_transformers_version(version: str | None = None) -> None:
    """Warn once per process where transformers is newer than :data:`TESTED_TRANSFORMERS`: the patch may still
    be right, and ``python -m posenc.hf_matrix`` says whether it is (each cell checks against the model's own
    numbers or generate without a cache)."""
    if version is None:
        import transformers

        version = transformers.__version__
    if _release(version)[:2] > _release(TESTED_TRANSFORMERS)[:2] and version not in _warned_version:
        _warned_version.append(version)
        import warnings

        warnings.warn(
            f"posenc.hf was tested with transformers {TESTED_TRANSFORMERS}; this is {version}, newer. posenc.hf "
            "reads transformers' internals (the KV cache's mask sizes, the rotary module, the attention registry); "
            "run `python -m posenc.hf_matrix` to check every family and cache against their own numbers, or "
            f"install the tested release: pip install transformers=={TESTED_TRANSFORMERS}",
            stacklevel=3,
        )


def patch(model: nn.Module, encoding: str | PositionalEncoding, *, path: str = "auto", **options: Any) -> nn.Module:
    """Replace the positional encoding of a transformers ``model`` with posenc's ``encoding``; returns ``model``.

    Args:
        model: a transformers model of a supported family (:data:`SUPPORTED`), e.g. ``LlamaForCausalLM``, or a
            PEFT model wrapping one.
        encoding: a registered name (``"alibi"``, ``"rope-yarn"`` ...) or a built encoding.
        path: ``"auto"`` (posenc's fast kernels), ``"fast"`` or ``"reference"`` (the formula as written).
        options: the encoding's options (``factor=4``). The model's sizes (heads, head width, width, trained
            length) are filled in; a rotary encoding on a rotary model takes the model's own settings unless given:
            ``rope_theta``, rotated width, trained length (``original_max_position_embeddings``, else
            ``max_position_embeddings``) and, for the scaling the config names, its fields (see
            :data:`HF_ROPE_FIELDS`). Where each layer type has its own ``rope_parameters`` (Gemma 3), each type
            gets its own encoding from its own settings.

    Patching an already patched model replaces its patch. The patched model keeps transformers' ``generate``
    (with every cache transformers offers), padding masks, training, ``save_pretrained`` / ``from_pretrained``
    and the Auto classes. What cannot work is refused here, with the reason, and the model is left as it was.
    """
    check_transformers_version()
    hf_model = _unwrap(model)
    if _patch_of(hf_model) is not None:
        unpatch(hf_model)
    base, family = _base_and_family(hf_model)
    if family.refuse is not None and (why := family.refuse(hf_model)):
        raise ConfigError(f"posenc.hf cannot patch this {type(hf_model).__name__}: {why}")
    dtype, device = _model_dtype_device(hf_model)
    attns = family.attention(base)
    rotary = family.rotary(base)
    enc, name, recorded, by_type, layer_encs = _encodings(hf_model, family, attns, rotary, encoding, options)
    if not enc.key_projection:
        raise ConfigError(
            f"{name} uses K = H (no key projection), but this {type(hf_model).__name__} projects its keys; "
            "it cannot act in this model"
        )
    in_attention = bool(enc.hooks() & _ATTENTION_HOOKS)
    rotary_mode = "none"
    if rotary is not None:
        ok = all(_cos_sin_ok(e, rotary, t) for t, e in by_type.items())
        rotary_mode = "cos-sin" if ok else "identity"
        if ok:
            in_attention = False
    if in_attention and not family.interface:
        raise ConfigError(
            f"{name} acts inside the attention, but this {type(hf_model).__name__}'s attention calls "
            "torch's SDPA itself rather than transformers' attention-function registry, so posenc's attention "
            "cannot go in; encodings acting outside the attention can (RoPE and its scalings, absolute "
            "encodings such as sinusoidal or learned, nope)"
        )
    if in_attention:  # per-layer encodings (Shaw): each layer its own copy
        layer_encs = [e if (e.shared_across_layers or i == 0) else e.fresh_copy() for i, e in enumerate(layer_encs)]
    unique: list[PositionalEncoding] = []
    for e in [*by_type.values(), *layer_encs]:
        if not any(e is u for u in unique):
            unique.append(e)
    state = PosencPatch(family, name, recorded, unique)
    state.by_type = by_type
    state.rotary_mode = rotary_mode
    _settle_dtype(state, dtype, device)
    if in_attention:
        _add_cores(hf_model, family, state, attns, layer_encs, path)
        if rotary_mode == "identity":  # keys rotated once, in the KV cache (rotary.rotate_in_cache)
            state.key_rotation = {c.layer: rotation_tag(c.encoding) for c in state.cores if rotates_per_key(c.encoding)}
    base.add_module("posenc", state)
    state.train(hf_model.training)  # an eval() model gets eval encodings (their no-grad caches key on it)
    try:
        _check_dtype(hf_model, dtype)
        _install(hf_model, base, family, state, rotary, in_attention)
        _probe(hf_model, base, family, state, rotary)
        _record(hf_model, state, path)
    except Exception:
        unpatch(hf_model)
        raise
    return model


def unpatch(model: nn.Module) -> nn.Module:
    """Undo :func:`patch`: the model's own encoding and attention come back (the encoding's parameters go)."""
    hf_model = _unwrap(model)
    state = _patch_of(hf_model)
    if state is None:
        return model
    base, family = _base_and_family(hf_model)
    _uninstall(hf_model, base, family, state)
    if CONFIG_KEY in getattr(hf_model.config, "__dict__", {}):
        delattr(hf_model.config, CONFIG_KEY)
    del base._modules["posenc"]
    return model


# ------------------------------------------------------------------------------------------ the encodings
def _encodings(
    model: nn.Module,
    family: Family,
    attns: list[nn.Module],
    rotary: nn.Module | None,
    encoding: str | PositionalEncoding,
    options: dict[str, Any],
) -> tuple[PositionalEncoding, str, dict[str, Any], dict[str | None, PositionalEncoding], list[PositionalEncoding]]:
    """The encoding, its name, the options to record, the encoding of each rotary layer type and each layer's.

    A named rotary encoding on a model whose layer types have their own ``rope_parameters`` gets one encoding per
    type, each from its type's settings; otherwise every layer has the one encoding."""
    family_of = (resolve(encoding) if isinstance(encoding, str) else encoding).info.family
    typed = (
        _rope_parameters_by_type(model.config, len(attns), family_of == "rotary") if rotary is not None else None
    )
    params = typed[0][1] if typed else getattr(model.config, "rope_parameters", None)
    first_type = typed[0][0] if typed else None
    enc, name, recorded = _build_encoding(
        model, family, attns[0], _rotary_dim_of(rotary, first_type), encoding, options, params
    )
    by_type: dict[str | None, PositionalEncoding] = {None: enc}
    layer_encs = [enc] * len(attns)
    if typed is not None and isinstance(encoding, str) and enc.info.family == "rotary":
        by_type = {first_type: enc}
        for t, type_params in typed:
            if t not in by_type:
                by_type[t] = _build_encoding(
                    model, family, attns[0], _rotary_dim_of(rotary, t), encoding, options, type_params
                )[0]
        layer_encs = [by_type[t] for t, _ in typed]
    return enc, name, recorded, by_type, layer_encs


def _build_encoding(
    model: nn.Module,
    family: Family,
    attn: nn.Module,
    rotary_dim: int | None,
    encoding: str | PositionalEncoding,
    options: dict[str, Any],
    params: dict | None,
) -> tuple[PositionalEncoding, str, dict[str, Any]]:
    """One encoding for ``model``: a built one checked against the model's sizes, or a named one built with the
    model's sizes and (a rotary one) its RoPE settings ``params`` under the caller's ``options``."""
    dims = _model_dims(model, family, attn)
    if isinstance(encoding, PositionalEncoding):
        if options:
            raise ConfigError("pass encoding options only with an encoding name, not with an encoding instance")
        # the check posenc's own attention and models make (and that an embedding-only encoding would not meet)
        encoding.check_sizes(**{k: dims[k] for k in ("d_model", "n_heads", "head_dim", "vocab_size")})
        return encoding, encoding.info.name, {k: v for k, v in encoding.params.items() if k not in dims}
    cls = resolve(encoding)
    for key in set(options) & set(MODEL_DIMENSIONS):
        if key in dims and options[key] != dims[key]:
            raise ConfigError(
                f"{key}={options[key]!r} does not match this {type(model).__name__} ({key}={dims[key]}); leave "
                f"{key} out and posenc.hf takes it from the model"
            )
    full = {**_rotary_defaults(model, cls, rotary_dim, params), **options}
    return build(cls.info.name, dims=dims, options=full), cls.info.name, dict(options)


def _add_cores(
    model: nn.Module,
    family: Family,
    state: PosencPatch,
    attns: list[nn.Module],
    layer_encs: list[PositionalEncoding],
    path: str,
) -> None:
    """One :class:`~posenc.attention.AttentionCore` per attention layer the encoding acts in."""
    for i, (attn, layer_enc) in enumerate(zip(attns, layer_encs, strict=True)):
        if layer_enc.info.family == "rotary" and not getattr(attn, "use_rope", True):
            continue  # a layer the model keeps without rotation (SmolLM3's NoPE layers): so does the patch
        idx = getattr(attn, "layer_idx", None)
        core = AttentionCore(
            int(model.config.num_attention_heads),
            family.head_dim(attn),
            layer_enc,
            path=path,
            layer=int(idx if idx is not None else i),
        )
        state.cores.append(core)
        state.layer_ids.append(core.layer)
        state.attns.append(attn)


def _record(model: nn.Module, state: PosencPatch, path: str) -> None:
    """The patch, in ``model.config.posenc`` (saved in ``config.json`` by ``model.save_pretrained``)."""
    spec: dict[str, Any] = {"encoding": state.name, "options": state.options, "path": path, "version": __version__}
    try:
        json.dumps(spec)
    except TypeError as err:
        spec = {"encoding": state.name, "unsaveable": f"its options cannot be written as JSON ({err})"}
    setattr(model.config, CONFIG_KEY, spec)


# ------------------------------------------------------------------------------------------ the probe
def _probe(
    model: nn.Module,
    base: nn.Module,
    family: Family,
    state: PosencPatch,
    rotary: nn.Module | None,
) -> None:
    """Run the encoding once on two positions, so that an encoding that cannot act in this model fails now: its
    codes, and each distinct attention layer's own forward (which shows every keyword the model passes)."""
    enc = state.encoding
    dtype, dev = _model_dtype_device(model)
    saved = (state.positions, state.forward_cache, state.embedded, state.cache_sizes)
    try:
        with torch.no_grad():
            pos = torch.arange(2, device=dev)[None, :]
            state.positions, state.forward_cache, state.cache_sizes = pos, {}, None
            if "embed" in enc.hooks():
                x = torch.zeros(1, 2, int(model.config.hidden_size), device=dev, dtype=dtype)
                state.embedded = False
                _add_codes(state)(family.tokens(base), (torch.zeros(1, 2, dtype=torch.long, device=dev),), x)
            if rotary is not None:  # the rotary hook once (the cos/sin layout), for each layer type
                hidden = torch.zeros(1, 2, int(model.config.hidden_size), device=dev, dtype=dtype)
                takes_type = "layer_type" in inspect.signature(rotary.forward).parameters
                types = sorted(set(getattr(model.config, "layer_types", None) or [])) if takes_type else [None]
                for t in (t for t in types if t is None or hasattr(rotary, f"{t}_inv_freq")):
                    rotary(hidden, pos, **({"layer_type": t} if takes_type else {}))
            if state.cores:
                seen: set[int] = set()
                for attn, core in zip(state.attns, state.cores, strict=True):
                    if id(core.encoding) in seen and getattr(attn, "layer_type", None) is None:
                        continue
                    seen.add(id(core.encoding))
                    _probe_layer(model, family, attn, rotary, dev, dtype)
    except PosencError as err:
        raise ConfigError(f"{state.name} cannot act in this {type(model).__name__}: {err}") from err
    except (RuntimeError, TypeError, ValueError) as err:
        hint = "" if dtype == torch.float32 else f" (in {dtype}; cast the model to float32 to patch it)"
        raise ConfigError(f"{state.name} cannot act in this {type(model).__name__}{hint}: {err}") from err
    finally:
        state.positions, state.forward_cache, state.embedded, state.cache_sizes = saved


def _probe_layer(
    model: nn.Module,
    family: Family,
    attn: nn.Module,
    rotary: nn.Module | None,
    dev: torch.device,
    dtype: torch.dtype,
) -> None:
    """One attention layer's own forward on two zero tokens (through transformers' code, so that every keyword it
    passes reaches posenc's attention); where the layer's forward takes other arguments than the usual ones, the
    attention function alone."""
    hidden = torch.zeros(1, 2, int(model.config.hidden_size), device=dev, dtype=dtype)
    kwargs: dict[str, Any] = {"hidden_states": hidden, "attention_mask": None}
    if rotary is not None:
        sig = inspect.signature(rotary.forward).parameters
        extra = {"layer_type": getattr(attn, "layer_type", None)} if "layer_type" in sig else {}
        kwargs["position_embeddings"] = rotary(hidden, torch.arange(2, device=dev)[None, :], **extra)
    try:
        attn(**kwargs)
        return
    except PosencError:
        raise
    except Exception:  # a forward with other arguments: the attention function alone
        pass
    h, d = int(model.config.num_attention_heads), family.head_dim(attn)
    q = torch.zeros(1, h, 2, d, device=dev, dtype=dtype)
    posenc_attention(attn, q, q, q, None, scaling=d**-0.5)
