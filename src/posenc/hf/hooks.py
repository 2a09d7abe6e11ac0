"""The hooks :func:`posenc.hf.patch` puts on a model, and taking them off again.

* before the base model's forward (:func:`_before_forward`): the positions of this forward (the model's
  ``position_ids``, else ``past + arange``, through the encoding's ``positions`` hook), the KV cache's mask sizes,
  and the checks that the patch still holds (its module not replaced, the attention implementation not changed);
* after the token embedding (:func:`_add_codes`): the encoding's absolute codes;
* after the model's own learned position table (:func:`_silence`): zeros;
* after the rotary module: :func:`posenc.hf.rotary._rotary_output` (where some layer type gets other phases than
  the model's own), and before the attention module of a layer whose phases differ from its type's:
  :func:`posenc.hf.rotary._layer_phases`;
* ``model.set_attn_implementation``, guarded while an encoding acts in posenc's attention.

Each hook is a :class:`_Bound`, so that copies and pickles of a patched model carry working hooks of their own.

Imports :mod:`posenc.hf.state`, :mod:`posenc.hf.families`, :mod:`posenc.hf.attention`, :mod:`posenc.hf.rotary`
and, from below :mod:`posenc.hf`, the base helpers and the errors.
"""

from __future__ import annotations

import functools
import inspect
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from ..base import PositionalEncoding, as_position_rows, mark_arange
from ..errors import ConfigError
from .attention import ATTENTION_NAME, _register_attention
from .families import Family
from .rotary import _layer_phases, _rotary_output
from .state import _HALF, PosencPatch, _patch_of, _settle_dtype


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


# ------------------------------------------------------------------------------------------ on and off


def _checkpointing(model: nn.Module) -> bool:
    """Whether activation (gradient) checkpointing is on for ``model``, read without transformers' deprecation
    warning: transformers 5.24 renamed ``is_gradient_checkpointing`` to ``is_activation_checkpointing`` (the old
    name warns, and goes in v6); the class attribute is looked up first so that the deprecated property is read only
    where the new one does not exist."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False


def _install(
    model: nn.Module,
    base: nn.Module,
    family: Family,
    state: PosencPatch,
    rotary: nn.Module | None,
    in_attention: bool,
) -> None:
    """Put the patch's hooks on ``model``; where the encoding acts in the attention, make ``"posenc"`` the
    model's attention implementation (and guard it)."""
    enc = state.encoding
    before = _Bound(_before_forward, model, state, base, family.tokens(base))
    state.handles.append(base.register_forward_pre_hook(before, with_kwargs=True))
    after = _Bound(_after_forward, state)
    state.handles.append(base.register_forward_hook(after, with_kwargs=True, always_call=True))
    if "embed" in enc.hooks():
        state.handles.append(family.tokens(base).register_forward_hook(_Bound(_add_codes, state)))
    table = family.table(base)
    if table is not None:
        state.handles.append(table.register_forward_hook(_Bound(_silence, state)))
        if state.name == "learned" and not state.options.get("init_std") and hasattr(enc, "weight"):
            _copy_table(enc, table)
    if rotary is not None and any(not (isinstance(v, str) and v == "own") for v in state.by_type.values()):
        state.handles.append(rotary.register_forward_hook(_Bound(_rotary_output, state), with_kwargs=True))
    attns = family.attention(base)
    for i in state.phase_layers:  # a layer whose phases differ from those of its type
        state.handles.append(attns[i].register_forward_pre_hook(_Bound(_layer_phases, state, i), with_kwargs=True))
    # the model's own temperature off where the patch gives an encoding; MLA's softmax scale the encoding's
    values = list(getattr(state, "attr_values", None) or [False] * len(state.saved_attrs))
    for (attn, attr, _), value in zip(state.saved_attrs, values, strict=True):
        setattr(attn, attr, value)
    if in_attention:
        for attn, core in zip(state.attns, state.cores, strict=True):
            object.__setattr__(attn, "_posenc_core", core)
            object.__setattr__(attn, "_posenc_patch", state)
        _register_attention()
        state.previous_attention = model.config._attn_implementation
        type(model).set_attn_implementation(model, ATTENTION_NAME)
        model.__dict__["set_attn_implementation"] = _Bound(_guarded_set_attn_implementation, model, state)


def _uninstall(model: nn.Module, base: nn.Module, family: Family, state: PosencPatch) -> None:
    """Undo :func:`_install`: the hooks off, the attention modules as they were, the model's own attention."""
    _remove_hooks(model, state)
    state.handles.clear()
    for attn, attr, value in state.saved_attrs:
        setattr(attn, attr, value)
    for attn in family.attention(base):
        for a in ("_posenc_core", "_posenc_patch", "_posenc_projections"):
            if a in attn.__dict__:
                object.__delattr__(attn, a)
    model.__dict__.pop("set_attn_implementation", None)
    if state.previous_attention is not None:
        type(model).set_attn_implementation(model, state.previous_attention)


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


# ------------------------------------------------------------------------------------------ the hooks
def _before_forward(model: nn.Module, state: PosencPatch, base: nn.Module, tokens: nn.Module):
    """The hook before the base model's forward: this forward's positions, for the other hooks and the
    attention; where the encoding embeds and the caller passes ``inputs_embeds``, the codes are added here."""
    enc = state.encoding
    sig = inspect.signature(base.forward)
    maps = "positions" in enc.hooks()

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        _check_still_patched(model, module, state)
        weight = getattr(tokens, "weight", None)
        if isinstance(weight, Tensor) and weight.dtype != state.model_dtype:  # the model was cast after patching
            _settle_dtype(state, weight.dtype)
        try:
            bound = sig.bind_partial(*args, **kwargs).arguments
        except TypeError:
            bound = kwargs
        if module.training and torch.is_grad_enabled() and not state.warned_frozen:
            _warn_if_frozen(state)
        ids, embeds = bound.get("input_ids"), bound.get("inputs_embeds")
        x = ids if ids is not None else embeds
        state.forward_cache = {}
        state.embedded = False
        state.in_forward = True
        state.cache_sizes = None
        if x is None:
            state.positions = None
            return None
        if ids is not None and ids.dtype.is_floating_point:
            raise ConfigError(f"input_ids must be integer token ids, got dtype {ids.dtype}")
        length = x.shape[1]
        past = _the_cache(bound)
        state.past = None
        if past is not None and state.cores and hasattr(past, "get_mask_sizes"):
            state.cache_sizes = _cache_sizes(past, state.layer_ids, length)
            if state.key_rotation:
                state.past = weakref.ref(past)  # where rotary.rotate_in_cache stores keys rotated
        pos = bound.get("position_ids")
        if pos is not None and pos.dim() == 3:  # three or four rows (Qwen2-VL's M-RoPE): one position per token
            pos = _one_row(pos.to(x.device), length)
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
        state.checkpointing = bool(module.training and _checkpointing(model))
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


def _after_forward(state: PosencPatch):
    """The hook after the base model's forward (also when it raised): the forward is over, so a call of the token
    embedding before the next one (a vision-language model embeds its tokens before its text model's forward, which
    then adds the codes) adds no codes."""

    def hook(module: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        state.in_forward = False

    return hook


def _one_row(pos: Tensor, length: int) -> Tensor | None:
    """One position per token from transformers' three or four position rows (Qwen2-VL, Qwen2.5-VL): the text
    positions where four rows lead with them (what ``generate`` passes: ``[text; time; height; width]``); the rows
    themselves where the three are equal (text); else ``None``, the sequence index (as transformers' masks take it
    then). The three rows reach the M-RoPE encodings on the rotary module's own call (:func:`rotary._phases`)."""
    if pos.shape[0] == 4:
        return pos[0]
    if pos.shape[0] != 3:
        raise ConfigError(
            f"position_ids of shape {tuple(pos.shape)}: posenc.hf takes [B, L], or three rows [3, B, L] (time, "
            "height, width) with an optional leading row of text positions [4, B, L]"
        )
    if bool((pos[0] == pos[1]).all()) and bool((pos[0] == pos[2]).all()):
        return pos[0]
    return None


def _check_still_patched(model: nn.Module, base: nn.Module, state: PosencPatch) -> None:
    """The patch's module and attention implementation are still the ones it installed, else a clear error."""
    if base._modules.get("posenc") is not state:
        raise ConfigError(
            f"the {state.name} patch's module at {type(base).__name__}.posenc was replaced (by PEFT's "
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


def _warn_if_frozen(state: PosencPatch) -> None:
    """Once per patch: training with the encoding's parameters frozen (PEFT freezes them) leaves them as they are."""
    params = list(state.parameters())
    if params and not any(p.requires_grad for p in params):
        state.warned_frozen = True
        warnings.warn(
            f"the parameters of the {state.name} encoding posenc.hf patched in are frozen (requires_grad="
            "False; PEFT's get_peft_model freezes every parameter but its adapters), so training leaves them "
            "as they are. To train them: for p in posenc.hf.patched(model).parameters(): "
            "p.requires_grad_(True)",
            stacklevel=3,
        )


#: the names transformers gives the KV cache argument of a model's forward: ``cache`` since 5.24, ``past_key_values``
#: before (and still accepted by 5.24's models), ``cache_params`` in some state-space models
CACHE_ARGUMENTS = ("cache", "past_key_values", "cache_params")


def _the_cache(bound: dict[str, Any]) -> Any:
    """The KV cache a forward was handed, under whichever name (:data:`CACHE_ARGUMENTS`), or one found by what it
    is (an object with the cache interface posenc.hf reads) under a name transformers may give it later, so that a
    rename never leaves posenc.hf guessing positions from the key count (transformers 5.24 renamed
    ``past_key_values`` to ``cache``: a static cache's keys were then taken for ``0 .. Lk-1`` with the queries at
    the end, and a patched model generated other tokens with a static cache than without a cache)."""
    for name in CACHE_ARGUMENTS:
        got = bound.get(name)
        if got is not None:
            return got
    for value in bound.values():
        if hasattr(value, "get_mask_sizes") and hasattr(value, "get_seq_length"):
            return value
    return None


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
    """The hook after the token embedding: the encoding's absolute codes added (once per forward)."""

    def hook(module: nn.Module, args: tuple, out: Tensor) -> Tensor | None:
        if state.embedded or state.positions is None or not getattr(state, "in_forward", True):
            return None  # a later use of the same table in this forward (GPT-2's token types), or outside one
        state.embedded = True
        tokens = args[0] if args else None
        pos = state.positions
        if pos.shape[-1] != out.shape[1]:
            raise ConfigError(f"posenc.hf: {out.shape[1]} embeddings for {pos.shape[-1]} positions")
        work = torch.float32 if out.dtype in _HALF else out.dtype
        return state.encoding.embed(out.to(work), pos, tokens=tokens).to(out.dtype)

    return hook


def _silence(state: PosencPatch) -> Callable[..., Tensor]:
    """The hook on the model's own learned position table: zeros while patched."""
    return lambda module, args, out: torch.zeros_like(out)
