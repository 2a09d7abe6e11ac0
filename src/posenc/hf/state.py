"""What a patch leaves in a model: :class:`PosencPatch` at ``<base model>.posenc``, how to find it, and its dtype.

The patch module holds the encoding(s), the attention cores and the positions of the forward in progress, which
the hooks (:mod:`posenc.hf.hooks`), the attention function (:mod:`posenc.hf.attention`) and the rotary hook
(:mod:`posenc.hf.rotary`) share. :func:`patched` is the public way to it.

Imports :mod:`posenc.hf.families` and, from below :mod:`posenc.hf`, the attention core, the encodings' base class
and the errors.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import Tensor, nn

from ..attention import AttentionCore
from ..base import PositionalEncoding
from ..errors import ConfigError
from .families import Family, _unwrap

#: floating dtypes a patched model may have
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
#: the half dtypes, in which posenc's kernels and encodings compute in float32 (as transformers upcasts its softmax)
_HALF = (torch.bfloat16, torch.float16)


class PosencPatch(nn.Module):
    """What :func:`posenc.hf.patch` adds to a model, at ``<base model>.posenc``: the encoding(s) and the attention
    cores.

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
        # what the rotary module hands the layers, by the layer type it is called with (None: it takes none): an
        # encoding (its phases), "identity" or "own" (the model's own phases, untouched)
        self.by_type: dict[str | None, PositionalEncoding | str] = {}
        # per layer of the model (posenc.hf.patching._Plan): what it was patched with -- None (left as the model has
        # it), a (name, options) pair or an encoding instance --, its encoding (None: left alone) and the phases it
        # is handed ("own", "identity" or an encoding; a layer whose phases differ from its type's gets them from a
        # hook on its attention module)
        self.layer_specs: list[Any] = []
        self.layer_encodings: list[PositionalEncoding | None] = []
        self.layer_phases: list[PositionalEncoding | str] = []
        self.layer_keys: list[str | None] = []  # the layer type each layer's phases come from the rotary module by
        self.phase_layers: list[int] = []  # the layers handed phases by a hook on their attention module
        self.layout = "half"  # how the model's rotary module lays out its phases (rotary.rotary_layout)
        self.per_layer = False  # patched per layer (a schedule, layer types, layers=...), not with one encoding
        self.saved_attrs: list[tuple[nn.Module, str, Any]] = []  # attention modules' settings the patch changed
        self.attr_values: list[Any] = []  # what it set each of them to
        self.layer_ids: list[int] = []  # the cache index of each patched attention layer
        self.attns: list[nn.Module] = []  # the attention modules the cores serve (plain list: not submodules)
        # "cos-sin": HF rotates with the encodings' phases; "identity": posenc does (or nothing rotates); "mixed":
        # some layers each way; "own": the model's phases everywhere; "none": no rotary module
        self.rotary_mode = "none"
        self.previous_attention: str | None = None
        self.handles: list[Any] = []
        self.positions: Tensor | None = None  # of the forward in progress (after the `positions` hook)
        self.cache_sizes: dict[int, tuple[int, int, int]] | None = None  # layer -> (q start, k start, k count)
        self.past: weakref.ref | None = None  # the transformers cache of the forward in progress
        # layer -> the rotation (rotary.rotation_tag) whose keys it stores rotated in the cache (rotary.rotate_in_cache)
        self.key_rotation: dict[int, str] = {}
        self.forward_cache: dict = {}
        self.checkpointing = False  # gradient checkpointing while training: each layer its own memo
        self.first_cache: dict | None = None  # the memo as the forward's positions left it (checkpointing)
        self.embedded = False
        self.in_forward = False  # between the base model's forward hooks (the token embedding adds codes only then)
        self.warned_frozen = False
        self.model_dtype: torch.dtype = torch.float32  # the model's dtype the encodings were settled for

    def __getstate__(self) -> dict[str, Any]:
        """A copy (``copy.deepcopy`` of the model, pickling) leaves out what belongs to the forward in progress."""
        out = dict(self.__dict__)
        out.update(positions=None, forward_cache={}, first_cache=None, cache_sizes=None, past=None, handles=[])
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
    owners = [base, model, getattr(model, "_modules", {}).get("model")]
    # a vision-language model (Qwen2-VL) holds the patch on its text model, at .model.language_model
    owners += [getattr(m, "_modules", {}).get("language_model") for m in owners if m is not None]
    for m in owners:
        p = getattr(m, "_modules", {}).get("posenc")
        if isinstance(p, PosencPatch):
            return p
    return None


def patched(model: nn.Module) -> PosencPatch | None:
    """The patch of ``model`` (its encoding, options and cores), or ``None`` when it is not patched."""
    return _patch_of(model)


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


def _check_dtype(model: nn.Module, dtype: torch.dtype) -> None:
    """A model in a dtype posenc's kernels do not take is refused, saying how to cast it."""
    if dtype not in DTYPES:
        raise ConfigError(
            f"posenc.hf patches models in {', '.join(str(d) for d in DTYPES)}; this {type(model).__name__} is in "
            f"{dtype}: cast it first (model.to(torch.float32))"
        )
