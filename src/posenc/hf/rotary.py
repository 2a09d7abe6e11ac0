"""The rotary side of :mod:`posenc.hf`: a model's own RoPE settings as posenc options, and the hook on its rotary
module.

A rotary encoding patched into a rotary model starts from the model's own numbers (base, rotated width, trained
length and the fields of the scaling its ``rope_parameters`` names, per layer type where the layer types have
their own). Where HF's own rotate-half rotation can apply the encoding (:func:`_cos_sin_ok`), the hook on the
model's rotary module (:func:`_rotary_output`) hands the attention layers the encoding's cos/sin, and the
attention stays transformers' own; otherwise it hands the identity and the rotation moves into posenc's
attention.

Imports :mod:`posenc.hf.state` and, from below :mod:`posenc.hf`, the registry, the base class, the RoPE classes
and the errors.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ..base import PositionalEncoding, as_position_rows
from ..errors import ConfigError
from ..registry import accepted_arguments
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


def _cos_sin_ok(enc: PositionalEncoding, rotary: nn.Module | None, layer_type: str | None = None) -> bool:
    """Whether HF's own rotation can apply this encoding: RoPE (any scaling) in the rotate-half layout over the
    width the model rotates, and nothing else."""
    from ..rotary.rope import RoPE
    from ..rotary.scaling import ScaledRoPE

    return (
        rotary is not None
        and isinstance(enc, RoPE)
        and not enc.interleaved
        and type(enc).rotate in (RoPE.rotate, ScaledRoPE.rotate)
        and enc.hooks() == {"rotate"}
        and enc.rotary_dim == _rotary_dim_of(rotary, layer_type)
    )


def _rotary_output(state: PosencPatch):
    """The hook on the model's rotary module: the encoding's cos/sin (``cos-sin`` mode), or the identity where the
    rotation happens in posenc's attention or there is none."""

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
