"""The entry points of :mod:`posenc.hf`: :func:`patch` and :func:`unpatch`.

``patch`` reads the model (its family, sizes, dtype and RoPE settings) and what each layer is asked to get (one
encoding, encodings by layer type, on some layers, or a schedule: :func:`_requested`), builds each layer's encoding,
decides where it acts (HF's own rotation, posenc's attention, the embedding: :func:`_plan`), refuses what cannot
work with the reason,
adds the :class:`~posenc.hf.state.PosencPatch` module and its attention cores, installs the hooks, runs the
encoding once on two positions (:func:`_probe`) and records the patch in ``model.config.posenc``. Any failure
leaves the model as it was.

Imports the other parts of :mod:`posenc.hf` but :mod:`posenc.hf.checkpoints`, and from below it the attention
core, the base class, the registry, the errors and the version.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .._version import TESTED_RANGES, __version__
from ..attention import AttentionCore
from ..base import PositionalEncoding
from ..errors import ConfigError, PosencError
from ..registry import MODEL_DIMENSIONS, build, resolve
from .families import (
    OWN_TEMPERATURE,
    Family,
    _base_and_family,
    _latent,
    _model_dims,
    _model_dtype_device,
    _own_temperature,
    _unwrap,
    text_config,
)
from .hooks import _install, _uninstall
from .probe import _probe
from .requests import (
    _Ask,
    _layer_types,
    _model_rotates,
    _requested,
)
from .rotary import (
    _cos_sin_ok,
    _layer_params,
    _rotary_defaults,
    _rotary_dim_of,
    own_rotary_name,
    rotary_layout,
    rotates_per_key,
    rotation_tag,
)
from .state import PosencPatch, _check_dtype, _patch_of, _settle_dtype

if TYPE_CHECKING:
    from ..schedule import Schedule

#: the attribute of ``model.config`` that records the patch (saved in ``config.json``)
CONFIG_KEY = "posenc"
#: the encoding hooks that act inside the attention
_ATTENTION_HOOKS = frozenset({"rotate", "logits", "bias", "values", "scale", "probabilities"})


#: the transformers release posenc.hf's tests and support matrix ran against on the pinned leg (``constraints.txt``
#: pins it; a test keeps the two equal). posenc.hf reads transformers' internals (its cache's argument name and mask
#: sizes, the rotary module, the attention registry), which a later release may change: transformers 5.24 renamed the
#: forward's ``past_key_values`` to ``cache``.
TESTED_TRANSFORMERS = "5.24.0"
#: the transformers minor releases the suite ran on, oldest and newest, both included (declared once, in
#: posenc/_version.py; the newest is the latest leg's, ``bash scripts/test.sh --latest``)
TESTED_TRANSFORMERS_RANGE: tuple[str, str] = TESTED_RANGES["transformers"]
_warned_version: list[str] = []


def _release(version: str) -> tuple[int, ...]:
    out = []
    for part in version.split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit()) if part[:1].isdigit() else ""
        out.append(int(digits or 0))
    return tuple(out)


def check_transformers_version(version: str | None = None) -> None:
    """Warn once per process where transformers is outside :data:`TESTED_TRANSFORMERS_RANGE` (its minor release
    older than the oldest tested or newer than the newest; any patch release of a tested minor counts as tested):
    the patch may still be right, and ``python -m posenc.hf_matrix`` says whether it is (each cell checks against
    the model's own numbers or generate without a cache)."""
    if version is None:
        import transformers

        version = transformers.__version__
    oldest, newest = TESTED_TRANSFORMERS_RANGE
    minor = _release(version)[:2]
    outside = "newer" if minor > _release(newest)[:2] else "older" if minor < _release(oldest)[:2] else None
    if outside and version not in _warned_version:
        _warned_version.append(version)
        import warnings

        warnings.warn(
            f"posenc.hf was tested with transformers {oldest} to {newest}; this is {version}, {outside}. posenc.hf "
            "reads transformers' internals (the KV cache's mask sizes, the rotary module, the attention registry); "
            "run `python -m posenc.hf_matrix` to check every family and cache against their own numbers, or "
            f"install a tested release: pip install 'transformers>={oldest},<={newest}.*'",
            stacklevel=3,
        )


def patch(
    model: nn.Module,
    encoding: str | PositionalEncoding | Schedule | Mapping[str, Any] | list[Any],
    *,
    layers: Sequence[int] | None = None,
    path: str = "auto",
    **options: Any,
) -> nn.Module:
    """Replace the positional encoding of a transformers ``model`` with posenc's ``encoding``; returns ``model``.

    Args:
        model: a transformers model of a supported family (:data:`SUPPORTED`), e.g. ``LlamaForCausalLM``, or a
            PEFT model wrapping one.
        encoding: what each layer gets:

            * a registered name (``"alibi"``, ``"rope-yarn"`` ...) or a built encoding: every layer. A rotary one
              replaces the model's RoPE where the model has RoPE; its layers without RoPE (SmolLM3's and Llama 4's
              ``no_rope_layers``, Cohere2's global layers) keep what they have. ``"rope"`` alone (no options) is the
              model's own RoPE on each layer, as its ``rope_parameters`` say, per layer type where they are nested
              (Gemma 3's θ = 1e4 local and θ = 1e6 linear ×8 global layers): ``patch(model, "rope")`` reproduces the
              model's own scheme;
            * a dict by layer type (``{"sliding_attention": "rope", "full_attention": ("rope-linear", {"factor":
              8, "theta": 1e6})}``; the types are ``config.layer_types``'): each layer of a named type gets its
              encoding (a name, ``(name, options)`` or an instance); the other types keep what they have;
            * a :class:`posenc.Schedule`, a string in its syntax (``"rope*3+nope"``) or a list with one entry per
              layer (``None``: that layer keeps what it has), as :func:`posenc.schedule` takes them.
        layers: only these layers (indices from 0) get ``encoding`` (one encoding, or a schedule / list with one
            entry per listed layer); the others keep what they have.
        path: ``"auto"`` (posenc's fast kernels), ``"fast"`` or ``"reference"`` (the formula as written).
        options: the encoding's options (``factor=4``; RoPE's θ as ``base``, or ``theta`` / ``rope_theta``), with
            one encoding name. The model's sizes (heads, head width, width, trained length) are filled in; a
            rotary encoding on a rotary model takes the layer's own settings unless given: ``rope_theta``, rotated
            width, trained length (``original_max_position_embeddings``, else ``max_position_embeddings``) and,
            for the scaling the config names, its fields (see :data:`HF_ROPE_FIELDS`); ``qtemp-llama4`` on a
            Llama 4 takes its ``floor_scale`` and ``attn_scale``.

    A layer that "keeps what it has" keeps the encoding of the patch already on the model (the same module, its
    trained parameters included), or, on a model not patched, the model's own (its RoPE or NoPE, and Llama 4's
    temperature). Patching with one encoding and no ``layers`` replaces a previous patch everywhere. A layer given
    an encoding loses the model's own position treatment (its RoPE, and Llama 4's query temperature on its NoPE
    layers; ``qtemp-llama4`` puts a temperature back over any inner encoding). A schedule's spans must be the
    layer's own (its sliding window or chunk, which its masks and KV cache follow) or left out.

    The patched model keeps transformers' ``generate`` (with every cache transformers offers), padding masks,
    training, ``save_pretrained`` / ``from_pretrained`` and the Auto classes. What cannot work is refused here, with
    the reason, and the model is left unpatched.
    """
    check_transformers_version()
    hf_model = _unwrap(model)
    base, family = _base_and_family(hf_model)
    if family.refuse is not None and (why := family.refuse(hf_model)):
        raise ConfigError(f"posenc.hf cannot patch this {type(hf_model).__name__}: {why}")
    dtype, device = _model_dtype_device(hf_model)
    attns = family.attention(base)
    rotary = family.rotary(base)
    asks, per_layer = _requested(hf_model, family, attns, rotary, encoding, options, layers)
    previous = _patch_of(hf_model)
    kept: list[tuple[Any, PositionalEncoding | None]] = [(None, None)] * len(attns)
    if previous is not None:
        if per_layer and len(previous.layer_specs) == len(attns):
            kept = list(zip(previous.layer_specs, previous.layer_encodings, strict=True))
        unpatch(hf_model)
    plan = _plan(hf_model, family, attns, rotary, asks, kept, dtype)
    uniform = not per_layer and not isinstance(encoding, (Mapping, list))
    if uniform:
        assert isinstance(encoding, (str, PositionalEncoding))
        name = encoding.info.name if isinstance(encoding, PositionalEncoding) else resolve(encoding).info.name
        recorded = plan.recorded
    else:
        name, recorded = _schedule_record(plan.specs)
    state = PosencPatch(family, name, recorded, plan.unique)
    state.per_layer = not uniform
    state.layer_specs, state.layer_encodings = plan.specs, plan.encodings
    state.layer_phases, state.layer_keys, state.layout = plan.phases, plan.keys, plan.layout
    state.by_type, state.rotary_mode, state.saved_attrs = plan.by_type, plan.rotary_mode, plan.saved_attrs
    state.attr_values = plan.attr_values
    state.phase_layers = plan.hooked
    _settle_dtype(state, dtype, device)
    in_attention = any(c is not None for c in plan.cores)
    if in_attention:
        _add_cores(hf_model, family, state, attns, plan.cores, path)
        if rotary is not None:  # keys rotated once, in the KV cache (rotary.rotate_in_cache)
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
    for owner in (base, hf_model, hf_model._modules.get("model")):
        if owner is not None and owner._modules.get("posenc") is state:
            del owner._modules["posenc"]
    return model


@dataclass
class _Plan:
    """What :func:`patch` does to each layer (see :class:`~posenc.hf.state.PosencPatch`)."""

    specs: list[Any]
    encodings: list[PositionalEncoding | None]
    phases: list[PositionalEncoding | str]
    keys: list[str | None]
    cores: list[PositionalEncoding | None]  # the encoding each layer's posenc attention runs (None: no core)
    unique: list[PositionalEncoding]
    by_type: dict[str | None, PositionalEncoding | str]
    rotary_mode: str
    layout: str
    saved_attrs: list[tuple[nn.Module, str, Any]]
    recorded: dict[str, Any]
    hooked: list[int]  # the layers whose phases differ from their type's: a hook on their attention hands them
    attr_values: list[Any]  # what the patch sets each of saved_attrs' attributes to


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, PositionalEncoding) or isinstance(b, PositionalEncoding):
        return a is b
    return a == b


def _plan(
    model: nn.Module,
    family: Family,
    attns: list[nn.Module],
    rotary: nn.Module | None,
    asks: list[_Ask | None],
    kept: list[tuple[Any, PositionalEncoding | None]],
    dtype: torch.dtype,
) -> _Plan:
    """Build each layer's encoding and decide where it acts: HF's own rotation (its phases in the model's
    layout), posenc's attention (a core), or the embedding; refuse what cannot work."""
    cfg = text_config(model)
    n = len(attns)
    mname = type(model).__name__
    types = _layer_types(cfg, n) or [None] * n
    takes_type = rotary is not None and "layer_type" in inspect.signature(rotary.forward).parameters
    keys = [t if takes_type else None for t in types]
    layout = rotary_layout(rotary, keys[0]) if rotary is not None else "half"
    specs: list[Any] = [None] * n
    encs: list[PositionalEncoding | None] = [None] * n
    built: dict[Any, tuple[PositionalEncoding, dict[str, Any]]] = {}
    recorded: dict[str, Any] = {}
    for i, ask in enumerate(asks):
        if ask is None:
            specs[i], encs[i] = kept[i]
            continue
        specs[i] = ask.spec
        params = _layer_params(cfg, types[i])
        where = f"layer {i}" + (f" ({types[i]})" if types[i] else "")
        if isinstance(ask.encoding, PositionalEncoding):
            key: Any = ("instance", id(ask.encoding))
            name, opts = ask.encoding.info.name, {}
        else:
            name, opts = ask.encoding, ask.options
            if ask.bare and name == "rope" and rotary is not None:
                # multi-head latent attention (DeepSeek-V3): its own RoPE is the decoupled one on a slice of each head
                own = f"this {mname}'s {where}"
                name = "rope-mla" if _latent(attns[i]) else own_rotary_name(params, own, family.name == "qwen2-vl")
                kind = (params or {}).get("rope_type", "default") or "default"
                if name == "rope-mla" and kind not in ("default", "yarn"):
                    raise ConfigError(
                        f"{own} has rope_type {kind!r}; its own RoPE as posenc reproduces it (rope-mla) is DeepSeek's "
                        "default RoPE or YaRN on the rotated slice: name the encoding you want for it (a RoPE "
                        "scaling such as rope-linear goes on the slice through the model's own rotation)"
                    )
            key = (name, repr(sorted(opts.items())), repr(params), _rotary_dim_of(rotary, keys[i]),
                   family.head_dim(attns[i]))
        if key not in built:
            try:
                enc, _, rec = _build_encoding(
                    model, family, attns[i], _rotary_dim_of(rotary, keys[i]),
                    ask.encoding if isinstance(ask.encoding, PositionalEncoding) else name, opts, params,
                )
            except PosencError as err:
                if len(set(map(id, asks))) > 1 and not str(err).startswith("layer"):
                    err.args = (f"{where}: {err.args[0]}", *err.args[1:])
                raise
            if not isinstance(ask.encoding, PositionalEncoding) and layout in ("interleaved", "complex"):
                _pairs_as_the_model(enc)
            built[key] = (enc, rec)
            if not recorded:
                recorded = rec
        encs[i] = built[key][0]
    for enc in encs:
        if enc is not None and not enc.key_projection:
            raise ConfigError(
                f"{enc.info.name} uses K = H (no key projection), but this {mname} projects its keys; it cannot act "
                "in this model"
            )
    patched_layers = [i for i in range(n) if encs[i] is not None]
    _check_model_wide(model, family, encs, specs, patched_layers)
    # where each layer's encoding acts
    phases: list[PositionalEncoding | str] = ["own"] * n
    rotating = [rotary is not None and _model_rotates(model, a, types[i]) for i, a in enumerate(attns)]
    cores: list[PositionalEncoding | None] = [None] * n
    for i, enc in enumerate(encs):
        if enc is None:
            continue
        if rotating[i] and _cos_sin_ok(enc, rotary, keys[i], layout):
            phases[i] = enc
            continue
        if rotating[i]:
            phases[i] = "identity"
        if enc.hooks() & _ATTENTION_HOOKS:
            cores[i] = enc
    if any(c is not None for c in cores):
        if not family.interface:
            what = next(c for c in cores if c is not None).info.name
            raise ConfigError(
                f"{what} acts inside the attention, but this {mname}'s attention calls torch's SDPA itself rather "
                "than transformers' attention-function registry, so posenc's attention cannot go in; encodings "
                "acting outside the attention can (RoPE and its scalings, absolute encodings such as sinusoidal or "
                "learned, nope)"
            )
        # per-layer encodings (Shaw): each layer its own copy; a layer left as the model has it runs in posenc's
        # attention too (the model's attention implementation is posenc's now), with no encoding of its own
        first: set[int] = set()
        passthrough: PositionalEncoding | None = None
        for i in range(n):
            e = cores[i]
            if e is not None:
                as_is = kept[i][1] is e or e.shared_across_layers or id(e) not in first
                first.add(id(e))
                if not as_is:
                    cores[i] = encs[i] = e.fresh_copy()
            elif encs[i] is None:
                if passthrough is None:
                    passthrough = build("nope", dims=_model_dims(model, family, attns[i]))
                cores[i] = passthrough
    # what the rotary module hands each layer type: what most of its layers take; the others get their own
    by_type: dict[str | None, PositionalEncoding | str] = {}
    for k in dict.fromkeys(keys):
        votes = [phases[i] for i in range(n) if keys[i] == k and rotating[i]]
        if votes:
            by_type[k] = max(votes, key=lambda v: sum(_same(v, w) for w in votes))
    hooked = [i for i in range(n) if rotating[i] and not _same(phases[i], by_type.get(keys[i], "own"))]
    if rotary is None:
        mode = "none"
    else:
        used = [phases[i] for i in range(n) if rotating[i]]
        cos = any(isinstance(p, PositionalEncoding) for p in used)
        turns = any(c is not None and "rotate" in c.hooks() for c in cores)
        ident = any(isinstance(p, str) and p == "identity" for p in used)
        mode = "mixed" if cos and turns else "cos-sin" if cos else "identity" if (ident or turns) else "own"
    saved = [(a, OWN_TEMPERATURE, True) for i, a in enumerate(attns) if encs[i] is not None and _own_temperature(a)]
    values: list[Any] = [False] * len(saved)  # the model's own temperature off
    for i, a in enumerate(attns):
        if encs[i] is not None and _latent(a):
            new_scaling = _latent_scaling(model, a, encs[i], cores[i])
            saved.append((a, "scaling", a.scaling))
            values.append(new_scaling)
    unique: list[PositionalEncoding] = []
    wide = [e for e in encs if e is not None and e.hooks() & {"embed", "positions"}]
    for e in [*wide, *encs, *cores]:
        if e is not None and not any(e is u for u in unique):
            unique.append(e)
    if not unique:
        raise ConfigError("this patch gives no layer an encoding: name at least one layer's")
    return _Plan(specs, encs, phases, keys, cores, unique, by_type, mode, layout, saved, recorded, hooked, values)


def _latent_scaling(
    model: nn.Module, attn: nn.Module, enc: PositionalEncoding, core: PositionalEncoding | None
) -> float:
    """The softmax scale a patched layer of multi-head latent attention (DeepSeek-V3) runs with. The model's own
    (``qk_head_dim^{-1/2}`` times YaRN's ``mscale(factor, mscale_all_dim)²``) belongs to its RoPE, so the patch
    replaces it: with the encoding's own scale where the model's attention runs (``rope-mla``: DeepSeek's factor, in
    transformers' order of products), ``qk_head_dim^{-1/2}`` where posenc's attention does (it applies the encoding's
    own change to it). A rotation posenc's attention would apply is refused: it would turn the whole head, or a
    slice of its own, where the model's position lives in the last ``qk_rope_head_dim`` channels."""
    d = int(attn.qk_head_dim)
    if core is not None and "rotate" in core.hooks():
        r = int(attn.qk_rope_head_dim)
        why = ""
        if getattr(core, "rope_dim", r) != r or getattr(core, "rope_first", False):
            why = f" (this one rotates {'the first' if core.rope_first else 'the last'} {core.rope_dim} channels)"
        raise ConfigError(
            f"{core.info.name}{why} would rotate in posenc's attention, but this {type(model).__name__} has multi-head "
            f"latent attention: the position lives in the last qk_rope_head_dim={r} channels of each head (DeepSeek's "
            "decoupled RoPE; the other channels come from the latent and carry none), which only the model's own "
            f"rotation reaches. Name rope-mla (rope_dim={r}), or RoPE or a RoPE scaling (rope-linear, rope-yarn ...), "
            "which the model applies to that slice; encodings that act on the logits (alibi, t5, fire ...) or the "
            "embeddings go in as they are"
        )
    return float(enc.scale(d)) if core is None else d**-0.5


def _pairs_as_the_model(enc: PositionalEncoding) -> None:
    """A RoPE built by name for a model that rotates the pairs ``(2i, 2i+1)`` (Cohere2, Llama 4) rotates those:
    in :mod:`posenc.hf` RoPE and its scalings rotate the pairs the model's own RoPE rotates (``rope-interleaved``
    names that layout on a model of either)."""
    from ..rotary.rope import RoPE
    from ..rotary.xpos import XPos

    inner = getattr(enc, "inner", None)
    if isinstance(inner, PositionalEncoding):
        _pairs_as_the_model(inner)
    if isinstance(enc, RoPE) and not isinstance(enc, XPos) and not enc.interleaved:
        enc.interleaved = True


def _check_model_wide(
    model: nn.Module, family: Family, encs: list[PositionalEncoding | None], specs: list[Any], patched: list[int]
) -> None:
    """Refuse a per-layer patch whose layers differ while one of them acts once for the whole model (absolute codes
    added to the embeddings, randomized positions), or that leaves layers as they are in a model whose own positions
    are a learned table added to the embeddings (GPT-2, BERT: silenced while patched, for every layer)."""
    mname = type(model).__name__
    untouched = [i for i in range(len(encs)) if encs[i] is None]
    if untouched and family.table_path is not None:
        raise ConfigError(
            f"this {mname}'s own positions are a learned table added to the embeddings once, for every layer, and "
            f"posenc.hf silences it while patched, so layers {untouched} cannot keep them: give every layer an "
            "encoding"
        )
    for i in patched:
        enc = encs[i]
        assert enc is not None
        wide = sorted(enc.hooks() & {"embed", "positions"})
        if not wide:
            continue
        other = next((j for j in patched if not _same(specs[j], specs[i])), None)
        if other is not None:
            raise ConfigError(
                f"layer {i}: {enc.info.name} acts once for the whole model (its {' and '.join(wide)} hook: on the "
                f"embeddings or the positions, before the first layer), so every patched layer must have it, with "
                f"the same options, but layer {other} has {_spec_text(specs[other])}"
            )
        if "embed" in wide and untouched:
            raise ConfigError(
                f"{enc.info.name} adds its codes to the embeddings, which every layer reads, but layers {untouched} "
                "are left as the model has them: give it to every layer"
            )
        return


def _spec_text(spec: Any) -> str:
    if isinstance(spec, PositionalEncoding):
        return f"an instance of {spec.info.name}"
    if spec is None:
        return "the model's own encoding"
    name, opts = spec
    return name + (f"({', '.join(f'{k}={v!r}' for k, v in sorted(opts.items()))})" if opts else "")


def _schedule_record(specs: list[Any]) -> tuple[str, dict[str, Any]]:
    """The name and options a per-layer patch records: the schedule of its patched layers, and ``layers`` where
    some are left as the model has them (``patch(model, name, **options)`` gives the patch again)."""
    from ..schedule import LayerSpec, Schedule

    idx = [i for i, s in enumerate(specs) if s is not None]
    if any(isinstance(specs[i], PositionalEncoding) for i in idx):
        text = "+".join(_spec_text(specs[i]) for i in idx)
        return text, {"unsaveable": "a layer's encoding is an instance"}
    layer_specs = tuple(LayerSpec(specs[i][0], specs[i][1]) for i in idx)
    one = all(s == layer_specs[0] for s in layer_specs)  # one encoding on the listed layers: its name alone
    text = str(layer_specs[0] if one else Schedule(layer_specs))
    return text, ({} if len(idx) == len(specs) else {"layers": idx})


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
    full = {**_rotary_defaults(model, cls, rotary_dim, params), **_temperature_defaults(model, cls), **options}
    return build(cls.info.name, dims=dims, options=full), cls.info.name, dict(options)


def _temperature_defaults(model: nn.Module, cls: type[PositionalEncoding]) -> dict[str, Any]:
    """``qtemp-llama4`` on a model with Llama 4's temperature settings takes them (``floor_scale``, ``attn_scale``)."""
    cfg = text_config(model)
    if cls.info.name != "qtemp-llama4" or getattr(cfg, "floor_scale", None) is None:
        return {}
    return {"floor_scale": float(cfg.floor_scale), "attn_scale": float(getattr(cfg, "attn_scale", 0.1))}


def _add_cores(
    model: nn.Module,
    family: Family,
    state: PosencPatch,
    attns: list[nn.Module],
    layer_encs: list[PositionalEncoding | None],
    path: str,
) -> None:
    """One :class:`~posenc.attention.AttentionCore` per attention layer the encoding acts in."""
    for i, (attn, layer_enc) in enumerate(zip(attns, layer_encs, strict=True)):
        if layer_enc is None:
            continue
        idx = getattr(attn, "layer_idx", None)
        core = AttentionCore(
            int(text_config(model).num_attention_heads),
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
