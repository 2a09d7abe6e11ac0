"""The attention function :mod:`posenc.hf` registers with transformers: :func:`posenc_attention`, named ``"posenc"``.

Each patched attention layer of a transformers model calls it with its own projections' queries, keys and values
(the cache's keys included) and its mask; it finds the layer's :class:`~posenc.attention.AttentionCore` and the
patch, works out the queries' and keys' positions (the forward's, or the ones the KV cache reports), turns
transformers' mask into posenc's, and runs the encoding's hooks with posenc's kernels -- or, for what those do not
take (logit soft-capping, attention sinks), the formula as transformers' eager attention writes it.

Imports :mod:`posenc.hf.state`, :mod:`posenc.hf.rotary` and, from below :mod:`posenc.hf`, :mod:`posenc.attention`,
the base types and the errors (transformers only inside functions).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ..attention import AttentionCore, _Call, build_mask, check_groups, repeat_kv
from ..attention.core import finish_rows, quarantine_nonfinite
from ..attention.materialised import materialised
from ..base import AttentionContext, contiguous_positions, mark_arange
from ..errors import ConfigError
from .rotary import rotate_in_cache
from .state import _HALF, PosencPatch

#: the name of posenc's attention function (and mask) in transformers' registries
ATTENTION_NAME = "posenc"

#: keywords of transformers' attention interface that posenc's attention reads (``is_causal``, ``sliding_window``
#: and ``output_attentions`` below) or that describe what it already has (positions, the cache, packed
#: sequences, which the mask carries)
KNOWN_KWARGS = frozenset(
    {
        "is_causal", "sliding_window", "softcap", "s_aux", "output_attentions", "position_ids", "cache_position",
        "use_cache", "past_key_values", "cache",
        "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "num_items_in_batch",
        "output_hidden_states", "output_router_logits", "return_dict", "layer_type", "token_type_ids",
    }
)
#: keywords that change the attention in a way posenc's attention does not implement: refused when given
REFUSED_KWARGS = {
    "position_bias": "a position bias of the model's own (it already has a positional encoding in the attention)",
    "head_mask": "a head mask",
}


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
    """What the encoding's context lends as ``attention`` (the layer's own query/key projections), or None."""
    got = module.__dict__.get("_posenc_projections")
    if got is None:
        if (
            isinstance(getattr(module, "q_proj", None), nn.Module)
            and isinstance(getattr(module, "k_proj", None), nn.Module)
            and getattr(module, "num_key_value_groups", 1) == 1
        ):
            got = module  # Llama-style, every head its own key
        elif all(isinstance(getattr(module, a, None), nn.Module) for a in ("query", "key")):
            got = _Projections(module.query, module.key)  # BERT
        else:
            got = False  # fused c_attn / qkv_proj / query_key_value, grouped keys: none to lend
        object.__setattr__(module, "_posenc_projections", got)
    return got or None


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


def _query_key_positions(
    state: PosencPatch, layer: int, lq: int, lk: int, device: torch.device, cache: dict
) -> tuple[Tensor, Tensor, bool]:
    """The positions of this layer's ``lq`` queries and ``lk`` keys, and whether they come from the KV cache's
    mask sizes (then the mask is made from them where transformers passes none).

    Without a cache: the forward's positions. With a cache that reports its mask sizes: the new queries follow
    the cached ones and the keys sit where the cache says (a static cache's slots, a sliding window's kept keys).
    A cache the model made itself: positions are indices in it (offsets exact, as its mask assumes)."""
    pos = state.positions
    sizes = state.cache_sizes.get(layer) if state.cache_sizes else None
    whole = lk == lq and pos is not None and pos.shape[-1] == lq  # no cached keys: the forward's positions
    if sizes is not None and not (sizes[0] == 0 and whole):
        q_start, k_start, k_count = sizes
        if lk != k_count:
            raise ConfigError(
                f"the KV cache handed layer {layer} {lk} keys where its mask sizes say {k_count}: posenc.hf "
                "cannot tell their positions in this cache; use another cache_implementation (dynamic, static, "
                "offloaded, quantized)"
            )
        key = ("hf-cache-positions", q_start, k_start, lq, lk, device, id(pos))
        got = cache.get(key)
        if got is None:
            q_pos = torch.arange(q_start, q_start + lq, device=device)[None, :]
            k_pos = torch.arange(k_start, k_start + lk, device=device)[None, :]
            compiling = torch.compiler.is_compiling()
            if pos is not None and pos.shape[-1] == lq and not pos.is_floating_point():
                # the slots shifted per row to the forward's own positions (a left-padded row's start later than
                # its slots): offsets stay the slots', and an encoding that reads the query's position itself
                # (FIRE's normaliser, Llama 4's temperature) sees the position it has without a cache
                shift = q_pos[:, -1:] - pos[:, -1:].to(device)  # [B, 1], from the last query (never left padding)
                # while torch.compile traces, the shifted form always (no branch on a tensor's values: a graph
                # break there, inside this inlined call, crashed Dynamo); shifting by zero changes nothing
                if compiling or bool((shift != 0).any()):
                    q_pos, k_pos = q_pos - shift, k_pos - shift
            # a left-padded row's pads before position 0, as keys and as queries: masked (a pad query's output is
            # not read), placed at 0 (no longer start + arange: the kernels take the gather forms); an encoding
            # that rotates in posenc's attention (mrope) refuses a negative position. While compiling, always (no
            # branch on a tensor's values)
            if compiling or bool((q_pos < 0).any()):
                q_pos = q_pos.clamp(min=0)
            else:
                q_pos = mark_arange(cache, q_pos)
            if compiling or bool((k_pos < 0).any()):
                k_pos = k_pos.clamp(min=0)
            else:
                k_pos = mark_arange(cache, k_pos)
            cache[key] = got = (q_pos, k_pos)
            cache[("hf-cache-positions-source", id(pos))] = pos  # keeps the id from being reused in the forward
        return got[0], got[1], True
    if whole:
        assert pos is not None
        return pos, pos, False
    key = ("hf-cache-positions", lq, lk, device)
    got = cache.get(key)
    if got is None:
        k_pos = mark_arange(cache, torch.arange(lk, device=device)[None, :])
        q_pos = mark_arange(cache, k_pos[:, lk - lq :])
        cache[key] = got = (q_pos, k_pos)
    return got[0], got[1], False


def _mask(
    cache: dict,
    attention_mask: Tensor | None,
    q_pos: Tensor,
    k_pos: Tensor,
    shape: tuple[int, int, int],
    causal: bool,
    window: int | None,
    by_position: bool,
    device: torch.device,
    sees_all: bool = False,
) -> tuple[Tensor | None, bool]:
    """posenc's mask for transformers' ``attention_mask`` (``shape``: batch, queries, keys) and whether it may hide
    keys beyond the causal pattern (padding, a window, cache positions). Every layer of a forward gets the same
    mask (the same tensor from transformers), so it is made once per forward and kept in ``cache``. ``sees_all``:
    one query after every key of the cache (a decoding step on a dynamic cache), which needs no mask where
    transformers passes none (as posenc's own decoding steps)."""
    b, lq, lk = shape
    key = ("hf-mask", id(attention_mask), b, lq, lk, causal, window, by_position, sees_all, device)
    allowed = cache.get(key, False)
    if allowed is False:
        if attention_mask is not None:
            allowed = _allowed(attention_mask[..., :lk])
        elif sees_all and window is None:
            allowed = None
        elif by_position or window is not None:
            allowed = _positions_mask(q_pos, k_pos, causal, window)
        else:
            allowed = build_mask(batch=b, lq=lq, lk=lk, device=device, causal=causal)
        cache[key] = allowed
        cache[("hf-mask-source", id(attention_mask))] = attention_mask  # keeps the id from being reused
    padding = attention_mask is not None or ((by_position or window is not None) and allowed is not None)
    return allowed, padding


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
    out_dtype, stored = query.dtype, key  # stored: the keys as the KV cache returned them
    if query.dtype in _HALF:  # posenc's kernels and encodings compute in float32 (as HF upcasts its softmax)
        query, key, value = query.float(), key.float(), value.float()
    b, h, lq, d = query.shape
    dv = value.shape[-1]
    if dv != d:  # values narrower than the queries and keys (multi-head latent attention: DeepSeek-V3's v_head_dim)
        value = _value_width(core, value, d)
    # grouped-query attention (each key/value head serves h / Hkv query heads): the keys stay grouped; the core
    # repeats them only for a kernel that needs one key head per query head (AttentionCore.attend)
    check_groups(h, key.shape[1])
    lk = key.shape[2]
    cache = dict(state.first_cache) if state.checkpointing and state.first_cache is not None else state.forward_cache
    q_pos, k_pos, by_position = _query_key_positions(state, core.layer, lq, lk, query.device, cache)
    enc = core.encoding
    assert enc is not None
    if core.training != module.training or enc.training != module.training:
        core.train(module.training)  # the encoding too: model.train()/eval() after the patch reach it here
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
        # each cached key rotated once where the encoding allows it (rotate_in_cache), else every key at each call
        rotated = rotate_in_cache(state, enc, query, key, stored, ctx, by_position) if state.key_rotation else None
        query, key = rotated if rotated is not None else enc.rotate(query, key, ctx)
    ctx.contiguous = contiguous_positions(q_pos, k_pos, cache)
    is_causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", False) if is_causal is None else is_causal) and lk >= lq
    sizes = state.cache_sizes.get(core.layer) if by_position and state.cache_sizes else None
    sees_all = sizes is not None and lq == 1 and sizes[1] + lk - 1 <= sizes[0]  # keys k_start .. k_start+lk-1
    allowed, padding = _mask(
        cache, attention_mask, q_pos, k_pos, (b, lq, lk), causal, kwargs.get("sliding_window"), by_position,
        query.device, sees_all,
    )
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
    if dv != d:
        out = out[..., :dv]
    out = out.transpose(1, 2).contiguous().to(out_dtype)
    return out, (weights.to(out_dtype) if weights is not None else None)


def _value_width(core: AttentionCore, value: Tensor, d: int) -> Tensor:
    """Values of width ``dv < d`` padded with zeros to the queries' width ``d`` (the kernels take one head width;
    the padded channels of the output are zeros, cut off after): ``softmax(.) V`` is unchanged. Refused for an
    encoding with a values term (it is defined on the width of the heads it was built for) and for ``dv > d``."""
    enc = core.encoding
    dv = value.shape[-1]
    if enc is not None and "values" in enc.hooks():
        raise ConfigError(
            f"{enc.info.name} adds a term to the values, but this model's value heads are {dv} wide where its query "
            f"and key heads are {d} (multi-head latent attention's v_head_dim): name an encoding without a values "
            "term (alibi, t5, fire, rope-mla ...)"
        )
    if dv > d:
        raise ConfigError(
            f"this model's value heads ({dv}) are wider than its query and key heads ({d}); posenc's attention takes "
            "values at most as wide as the keys"
        )
    return torch.nn.functional.pad(value, (0, d - dv))


def _materialised(
    core: AttentionCore, call: _Call, scale: float, *, softcap: float | None = None, sinks: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The attention with what posenc's planned kernels do not take, as transformers' own eager attention computes
    it (:func:`posenc.attention.materialised.materialised`): logit soft-capping (Gemma 2's
    ``attn_logit_softcapping``: the scaled logits -- ``q·k`` and the encoding's ``logits`` term -- pass through
    ``softcap · tanh(x / softcap)``, then the encoding's ``bias`` is added, after the cap, as transformers adds its
    mask) and attention sinks (gpt-oss's ``s_aux``: one more logit per head in the softmax, whose probability is
    dropped), with the core's dropout while training; a query that sees no key (left padding) gets zeros, as
    :meth:`~posenc.attention.AttentionCore.attend` gives it."""
    dropout = core.dropout if core.training else 0.0
    held = quarantine_nonfinite(call)  # a NaN/inf key reaches only the queries that see it (as in core.attend)
    call, poisoned = held if held is not None else (call, None)
    out, weights = materialised(
        call, scale, dropout, core._terms, core._values(), softcap=softcap, sinks=sinks,
        probabilities=core._probabilities(),  # an encoding's own weights (stick-breaking) here too, not softmax
    )
    return finish_rows(out, call, poisoned), weights


_registered = False


def _register_attention() -> None:
    """``"posenc"`` in transformers' attention-function and mask registries (once per process)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, posenc_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    _registered = True
