"""The KV cache of incremental decoding: :class:`KVCache` and the growing storage behind each of its layers.

The cache keeps the rules of its use (one model's, one batch, positions that continue after the cached ones) in
:meth:`KVCache._extend`, which the attention calls once per layer and step. Imports only :mod:`posenc.base` and
:mod:`posenc.errors`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..base import AttentionContext
from ..errors import ConfigError, PositionError


class _KVBuffer:
    """Storage for one layer of a :class:`KVCache`: ``[B, H, capacity, Dh]`` keys and values, ``[B', capacity]``
    positions, of which the first ``filled`` slots are in use."""

    __slots__ = ("k", "v", "pos", "filled")

    def __init__(self, pk: Tensor, pv: Tensor, ppos: Tensor, capacity: int):
        n = pk.shape[2]
        self.k = pk.new_empty(pk.shape[0], pk.shape[1], capacity, pk.shape[3])
        self.v = pv.new_empty(pv.shape[0], pv.shape[1], capacity, pv.shape[3])
        self.pos = ppos.new_empty(ppos.shape[0], capacity)
        self.k[:, :, :n] = pk
        self.v[:, :, :n] = pv
        self.pos[:, :n] = ppos
        self.filled = n

    def holds(self, pk: Tensor, pv: Tensor, ppos: Tensor, needed: int) -> bool:
        """Whether ``pk, pv, ppos`` are the views this buffer last handed out and ``needed`` slots fit."""
        n = self.filled
        views = ((pk, self.k[:, :, :n]), (pv, self.v[:, :, :n]), (ppos, self.pos[:, :n]))
        return needed <= self.k.shape[2] and all(
            t.shape == b.shape and t.stride() == b.stride() and t.data_ptr() == b.data_ptr() and t.dtype == b.dtype
            for t, b in views
        )

    def write(self, k: Tensor, v: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        n, m = self.filled, k.shape[2]
        self.k[:, :, n : n + m] = k
        self.v[:, :, n : n + m] = v
        self.pos[:, n : n + m] = k_pos
        self.filled = n + m
        return self.k[:, :, : n + m], self.v[:, :, : n + m], self.pos[:, : n + m]


@dataclass
class KVCache:
    """Keys, values and key positions of earlier steps, one entry per layer.

    Keys are stored *after* the ``rotate`` hook, so a cached step is never
    rotated twice; positions are stored with them, so a hook always sees the
    true positions of every key.
    """

    layers: dict[int, tuple[Tensor, Tensor, Tensor, Tensor | None]] = field(default_factory=dict)
    # layer -> id() of the attention module that filled it: a cache is one model's, and another model reading it
    # (even of the same sizes) is refused instead of attending to foreign keys
    owners: dict[int, int] = field(default_factory=dict, repr=False)
    # layer -> the preallocated storage behind that layer's entry (see :meth:`_append`)
    _buffers: dict[int, _KVBuffer] = field(default_factory=dict, repr=False, compare=False)
    # layer -> the sizes of the attention module that filled it, in words (named when another module reads it)
    _sizes: dict[int, str] = field(default_factory=dict, repr=False, compare=False)

    def get(self, layer: int) -> tuple[Tensor, Tensor, Tensor, Tensor | None] | None:
        return self.layers.get(layer)

    def _extend(
        self, layer: int, owner: int, sizes: str, k: Tensor, v: Tensor, ctx: AttentionContext
    ) -> tuple[Tensor, Tensor]:
        """All keys and values so far: the cached ones of ``layer`` followed by ``k, v`` (stored, with
        ``ctx.k_pos`` and ``ctx.k_segments`` extended the same way). ``owner`` is the ``id()`` of the attention
        module calling, ``sizes`` its sizes in words: a layer filled by another module is refused, as are keys of
        another batch, shape, dtype or device, and positions that do not continue after the cached ones."""
        past = self.get(layer)
        filled_by = self.owners.get(layer)
        if past is not None and filled_by is not None and filled_by != owner:
            pk = past[0]
            theirs = self._sizes.get(layer) or f"n_heads={pk.shape[1]}, head_dim={pk.shape[3]}"
            raise ConfigError(
                f"this KVCache's layer {layer} was filled by another attention module ({theirs}) and is read "
                f"by one of {sizes} (another model?); a cache belongs to the model that filled it: start "
                "a new posenc.KVCache() for this one"
            )
        if past is not None:
            pk, pv, ppos, pseg = past
            if pk.shape[0] != k.shape[0] or pk.shape[1] != k.shape[1] or pk.shape[3] != k.shape[3]:
                raise ConfigError(
                    f"the KVCache holds keys of batch={pk.shape[0]}, heads={pk.shape[1]}, head_dim={pk.shape[3]} "
                    f"but this call has batch={k.shape[0]}, heads={k.shape[1]}, head_dim={k.shape[3]}; a cache "
                    "serves one batch of sequences of one model: start a new posenc.KVCache()"
                )
            if pk.dtype != k.dtype or pk.device != k.device:
                raise ConfigError(
                    f"the KVCache holds {pk.dtype} keys on {pk.device} but this call makes {k.dtype} on {k.device}; "
                    "start a new posenc.KVCache() after changing the model's dtype or device"
                )
            if ppos.numel() and ctx.k_pos.numel() and not torch.compiler.is_compiling():
                last = ppos.amax(dim=1, keepdim=True)
                first = ctx.k_pos.amin(dim=1, keepdim=True)
                if bool((first <= last).any()):
                    raise PositionError(
                        f"the new tokens' positions (from {first.min().item()}) overlap the {ppos.shape[1]} the "
                        f"KVCache holds (up to {last.max().item()}); positions must continue after the cached "
                        "ones (the default does): pass positions > the cached ones, or start a new posenc.KVCache()"
                    )
            k, v, ctx.k_pos = self._append(layer, past, k, v, ctx.k_pos)
            if pseg is not None and ctx.k_segments is not None and pseg.shape[0] == ctx.k_segments.shape[0]:
                ctx.k_segments = torch.cat([pseg, ctx.k_segments], dim=1)
        self.update(layer, k, v, ctx.k_pos, ctx.k_segments)
        self.owners[layer] = owner
        self._sizes[layer] = sizes
        return k, v

    def _append(
        self, layer: int, past: tuple[Tensor, Tensor, Tensor, Tensor | None], k: Tensor, v: Tensor, k_pos: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The cached keys, values and positions followed by the new ones (not stored: :meth:`update` does).

        They are views of a per-layer buffer whose capacity doubles when full, so a step copies only its new
        keys (amortised), not all of them as ``torch.cat`` does. The buffer is written in place only where that
        is safe: no autograd through the keys, not while tracing, and only while ``past`` is exactly what the
        buffer last handed out (a cache forked by copying its entries, e.g. :meth:`MultiHeadAttention.plan`'s, or
        one rebuilt by hand gets a buffer of its own instead of overwriting the other's later slots).
        """
        pk, pv, ppos, _ = past
        if ppos.shape[0] != k_pos.shape[0]:
            nb = max(ppos.shape[0], k_pos.shape[0])
            ppos, k_pos = ppos.expand(nb, -1), k_pos.expand(nb, -1)
        n, m = pk.shape[2], k.shape[2]
        if (
            (torch.is_grad_enabled() and (k.requires_grad or v.requires_grad or pk.requires_grad or pv.requires_grad))
            or torch.compiler.is_compiling()
            or ppos.dtype != k_pos.dtype
            or pv.shape[2] != n
            or ppos.shape[1] != n
        ):
            return torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2), torch.cat([ppos, k_pos], dim=1)
        buf = self._buffers.get(layer)
        if buf is None or not buf.holds(pk, pv, ppos, n + m):
            buf = _KVBuffer(pk, pv, ppos, max(n + m + 64, 3 * (n + m) // 2))  # grows by half: amortised O(m)
            self._buffers[layer] = buf
        return buf.write(k, v, k_pos)

    def update(self, layer: int, k: Tensor, v: Tensor, k_pos: Tensor, k_segments: Tensor | None = None) -> None:
        """Store all keys so far (rotated), their values, positions and segment ids (if any)."""
        self.layers[layer] = (k, v, k_pos, k_segments)

    def length(self) -> int:
        """Number of cached key positions (0 when empty)."""
        if not self.layers:
            return 0
        return next(iter(self.layers.values()))[0].shape[-2]
