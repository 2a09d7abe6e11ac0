"""The probe of a patch: :func:`_probe` runs the encoding once on two positions through the model's own code (its
codes, its rotary module per layer type, each distinct attention layer's forward), so that an encoding that cannot
act in this model fails at :func:`~posenc.hf.patch`, with the reason, not at the first forward.

Imports :mod:`posenc.hf.attention`, :mod:`posenc.hf.families`, :mod:`posenc.hf.hooks` and :mod:`posenc.hf.state`,
and the errors.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError, PosencError
from .attention import posenc_attention
from .families import Family, _model_dtype_device, text_config
from .hooks import _add_codes
from .state import PosencPatch


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
    saved = (state.positions, state.forward_cache, state.embedded, state.cache_sizes, state.in_forward)
    try:
        with torch.no_grad():
            pos = torch.arange(2, device=dev)[None, :]
            state.positions, state.forward_cache, state.cache_sizes, state.in_forward = pos, {}, None, True
            if "embed" in enc.hooks():
                x = torch.zeros(1, 2, int(text_config(model).hidden_size), device=dev, dtype=dtype)
                state.embedded = False
                _add_codes(state)(family.tokens(base), (torch.zeros(1, 2, dtype=torch.long, device=dev),), x)
            if rotary is not None:  # the rotary hook once (the cos/sin layout), for each layer type
                hidden = torch.zeros(1, 2, int(text_config(model).hidden_size), device=dev, dtype=dtype)
                takes_type = "layer_type" in inspect.signature(rotary.forward).parameters
                for t in dict.fromkeys(state.layer_keys or [None]):
                    if t is None or hasattr(rotary, f"{t}_inv_freq"):
                        rotary(hidden, pos, **({"layer_type": t} if takes_type and t is not None else {}))
            attns = family.attention(base)
            keys = state.layer_keys or [None] * len(attns)
            seen: set[Any] = set()
            for attn, core in zip(state.attns, state.cores, strict=True):
                i = attns.index(attn)
                if (id(core.encoding), keys[i]) in seen:
                    continue
                seen.add((id(core.encoding), keys[i]))
                _probe_layer(model, family, attn, rotary, dev, dtype, keys[i])
            for i in state.phase_layers:  # a layer handed phases of its own
                if ("phases", id(state.layer_phases[i]), keys[i]) not in seen:
                    seen.add(("phases", id(state.layer_phases[i]), keys[i]))
                    _probe_layer(model, family, attns[i], rotary, dev, dtype, keys[i])
    except PosencError as err:
        raise ConfigError(f"{state.name} cannot act in this {type(model).__name__}: {err}") from err
    except (RuntimeError, TypeError, ValueError) as err:
        hint = "" if dtype == torch.float32 else f" (in {dtype}; cast the model to float32 to patch it)"
        raise ConfigError(f"{state.name} cannot act in this {type(model).__name__}{hint}: {err}") from err
    finally:
        state.positions, state.forward_cache, state.embedded, state.cache_sizes, state.in_forward = saved


def _probe_layer(
    model: nn.Module,
    family: Family,
    attn: nn.Module,
    rotary: nn.Module | None,
    dev: torch.device,
    dtype: torch.dtype,
    layer_type: str | None = None,
) -> None:
    """One attention layer's own forward on two zero tokens (through transformers' code, so that every keyword it
    passes reaches posenc's attention); where the layer's forward takes other arguments than the usual ones, the
    attention function alone."""
    hidden = torch.zeros(1, 2, int(text_config(model).hidden_size), device=dev, dtype=dtype)
    kwargs: dict[str, Any] = {"hidden_states": hidden, "attention_mask": None}
    if rotary is not None:
        sig = inspect.signature(rotary.forward).parameters
        extra = {"layer_type": layer_type} if "layer_type" in sig else {}
        kwargs["position_embeddings"] = rotary(hidden, torch.arange(2, device=dev)[None, :], **extra)
    try:
        attn(**kwargs)
        return
    except PosencError:
        raise
    except Exception:  # a forward with other arguments: the attention function alone
        pass
    h, d = int(text_config(model).num_attention_heads), family.head_dim(attn)
    q = torch.zeros(1, h, 2, d, device=dev, dtype=dtype)
    posenc_attention(attn, q, q, q, None, scaling=d**-0.5)
