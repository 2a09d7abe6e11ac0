"""The KV cache of incremental decoding: :class:`KVCache` and the growing storage behind each of its layers.

The cache keeps the rules of its use (one model's, one batch, positions that continue after the cached ones) in
:meth:`KVCache._extend`, which the attention calls once per layer and step. Imports only :mod:`posenc.base` and
:mod:`posenc.errors`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..base import AttentionContext
from ..errors import ConfigError, PositionError


class _KVBuffer:
    """Storage for one layer of a :class:`KVCache`: ``[B, H, capacity, Dh]`` keys and values, ``[B', capacity]``
    positions and, where the encoding keeps per-key state (``ctx.key_state``: FoX's running sums), ``[B, H,
    capacity, C]`` of it, of which the slots ``start .. filled`` are in use (``start`` moves on in a local layer's
    rolling cache, which drops its oldest keys: :meth:`drop_to`)."""

    __slots__ = ("k", "v", "pos", "state", "start", "filled")

    def __init__(self, pk: Tensor, pv: Tensor, ppos: Tensor, pstate: Tensor | None, capacity: int):
        n = pk.shape[2]
        self.k = pk.new_empty(pk.shape[0], pk.shape[1], capacity, pk.shape[3])
        self.v = pv.new_empty(pv.shape[0], pv.shape[1], capacity, pv.shape[3])
        self.pos = ppos.new_empty(ppos.shape[0], capacity)
        # channel-major ([B, H, C, capacity], handed out as [B, H, n, C] views): each channel of the state is one
        # contiguous run over the keys, which a decoding step reads in one pass (FoX's row of decays)
        self.state = (
            None if pstate is None else pstate.new_empty(*pstate.shape[:2], pstate.shape[3], capacity).transpose(2, 3)
        )
        self.k[:, :, :n] = pk
        self.v[:, :, :n] = pv
        self.pos[:, :n] = ppos
        if self.state is not None and pstate is not None:
            self.state[:, :, :n] = pstate
        self.start = 0
        self.filled = n

    def holds(self, pk: Tensor, pv: Tensor, ppos: Tensor, pstate: Tensor | None, added: int) -> bool:
        """Whether ``pk, pv, ppos`` (and ``pstate``) are the views this buffer last handed out and ``added`` more
        slots fit."""
        a, n = self.start, self.filled
        if (pstate is None) != (self.state is None):
            return False
        views = [(pk, self.k[:, :, a:n]), (pv, self.v[:, :, a:n]), (ppos, self.pos[:, a:n])]
        if pstate is not None and self.state is not None:
            views.append((pstate, self.state[:, :, a:n]))
        return n + added <= self.k.shape[2] and all(
            t.shape == b.shape and t.stride() == b.stride() and t.data_ptr() == b.data_ptr() and t.dtype == b.dtype
            for t, b in views
        )

    def _views(self, a: int, n: int) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        state = self.state[:, :, a:n] if self.state is not None else None
        return self.k[:, :, a:n], self.v[:, :, a:n], self.pos[:, a:n], state

    def write(
        self, k: Tensor, v: Tensor, k_pos: Tensor, state: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        n, m, a = self.filled, k.shape[2], self.start
        self.k[:, :, n : n + m] = k
        self.v[:, :, n : n + m] = v
        self.pos[:, n : n + m] = k_pos
        if self.state is not None and state is not None:
            self.state[:, :, n : n + m] = state
        self.filled = n + m
        return self._views(a, n + m)

    def drop_to(self, keep: int) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """Keep only the last ``keep`` slots in use; their views."""
        self.start = self.filled - keep
        return self._views(self.start, self.filled)


@dataclass
class KVCache:
    """Keys, values and key positions of earlier steps, one entry per layer.

    Keys are stored *after* the ``rotate`` hook, so a cached step is never
    rotated twice; positions are stored with them, so a hook always sees the
    true positions of every key.

    A local layer (a sliding window or chunks, :mod:`posenc.schedule`) keeps only the keys a later query may still
    see: the last ``W - 1`` of a window of ``W``, the current chunk's of a chunk. Its entry then holds fewer keys
    than the layer has taken in: :meth:`seen` counts those, :meth:`cached` what is held. The positions stay the
    tokens' true positions (never places in the rolling storage).

    An encoding that keeps state per key (``ctx.key_state``, set by its ``rotate`` hook: FoX's running sums of
    log-gates) has it stored beside the keys, in storage of its own (:meth:`state`), so that the keys stay
    contiguous for the attention's kernels.
    """

    layers: dict[int, tuple[Tensor, Tensor, Tensor, Tensor | None]] = field(default_factory=dict)
    # layer -> id() of the attention module that filled it: a cache is one model's, and another model reading it
    # (even of the same sizes) is refused instead of attending to foreign keys
    owners: dict[int, int] = field(default_factory=dict, repr=False)
    # layer -> the preallocated storage behind that layer's entry (see :meth:`_append`)
    _buffers: dict[int, _KVBuffer] = field(default_factory=dict, repr=False, compare=False)
    # layer -> the sizes of the attention module that filled it, in words (named when another module reads it)
    _sizes: dict[int, str] = field(default_factory=dict, repr=False, compare=False)
    # layer -> (the keys its entry held then, how many tokens it had taken in): more than it holds where it is local;
    # read only while the entry still holds those very keys (a cache copied field by field, or an entry stored by
    # hand, counts the keys it holds)
    _seen: dict[int, tuple[Tensor, int]] = field(default_factory=dict, repr=False, compare=False)
    # layer -> the per-key state of the keys its entry holds (``[B, H, n, C]``), for an encoding that keeps one
    states: dict[int, Tensor] = field(default_factory=dict, repr=False)

    def get(self, layer: int) -> tuple[Tensor, Tensor, Tensor, Tensor | None] | None:
        return self.layers.get(layer)

    def state(self, layer: int) -> Tensor | None:
        """The per-key state the encoding of ``layer`` keeps with its cached keys (``ctx.key_state``: FoX's running
        sums, ``[B, H, n, C]``), or ``None`` (an encoding that keeps none, or a layer not filled yet)."""
        return self.states.get(layer) if layer in self.layers else None

    def seen(self, layer: int) -> int:
        """How many tokens ``layer`` has taken in (0 for a layer not filled yet); its entry may hold fewer."""
        entry = self.layers.get(layer)
        if entry is None:
            return 0
        got = self._seen.get(layer)
        return got[1] if got is not None and got[0] is entry[0] else entry[0].shape[-2]

    def cached(self, layer: int) -> int:
        """How many keys ``layer``'s entry holds (at most its window, or its chunk, where it is local)."""
        entry = self.layers.get(layer)
        return 0 if entry is None else entry[0].shape[-2]

    def _fork(self) -> KVCache:
        """A copy whose entries are these (not copied) and whose later steps write storage of their own."""
        return KVCache(
            dict(self.layers),
            dict(self.owners),
            _sizes=dict(self._sizes),
            _seen=dict(self._seen),
            states=dict(self.states),
        )

    def _extend(
        self,
        layer: int,
        owner: int,
        sizes: str,
        k: Tensor,
        v: Tensor,
        ctx: AttentionContext,
        span: Any = None,
    ) -> tuple[Tensor, Tensor]:
        """All keys and values so far: the cached ones of ``layer`` followed by ``k, v`` (stored, with
        ``ctx.k_pos`` and ``ctx.k_segments`` extended the same way). ``owner`` is the ``id()`` of the attention
        module calling, ``sizes`` its sizes in words: a layer filled by another module is refused, as are keys of
        another batch, shape, dtype or device, and positions that do not continue after the cached ones.

        ``span`` (a :class:`posenc.schedule.Span`, or ``None``: global): what is stored is then only the keys a
        later query may still see (:meth:`~posenc.schedule.Span.keep`); this call still gets them all."""
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
        state = ctx.key_state
        if state is not None and state.shape[:3] != k.shape[:3]:
            raise ConfigError(
                f"the encoding's per-key state (ctx.key_state) is {tuple(state.shape)} for keys {tuple(k.shape)}; it "
                "must be [batch, heads, keys, channels], one row per new key"
            )
        pstate = self.state(layer)  # None where the layer's encoding keeps none (FoX refuses a cache without its own)
        seen = self.seen(layer) + k.shape[2]
        if past is not None:
            k, v, ctx.k_pos, state = self._append(layer, past, pstate, k, v, ctx.k_pos, state)
            if pseg is not None and ctx.k_segments is not None and pseg.shape[0] == ctx.k_segments.shape[0]:
                ctx.k_segments = torch.cat([pseg, ctx.k_segments], dim=1)
        ctx.key_state = state  # the state of every key of the call, the cached ones first
        held = k.shape[2]
        keep = held if span is None else span.keep(seen, held)
        if keep < held:
            self._store_suffix(layer, k, v, ctx.k_pos, ctx.k_segments, keep, state)
        else:
            self.update(layer, k, v, ctx.k_pos, ctx.k_segments, state)
        self._seen[layer] = (self.layers[layer][0], seen)
        self.owners[layer] = owner
        self._sizes[layer] = sizes
        return k, v

    def _store_suffix(
        self,
        layer: int,
        k: Tensor,
        v: Tensor,
        k_pos: Tensor,
        k_segments: Tensor | None,
        keep: int,
        state: Tensor | None = None,
    ) -> None:
        """Store only the last ``keep`` keys (a local layer's rolling cache): in the layer's buffer when ``k`` is its
        view (the buffer's start moves on), else as copies, so that the dropped keys' storage is freed."""
        buf = self._buffers.get(layer)
        seg = k_segments[:, k_segments.shape[1] - keep :] if k_segments is not None else None
        if buf is not None and buf.holds(k, v, k_pos, state, 0):
            bk, bv, bpos, bstate = buf.drop_to(keep)
            self.update(layer, bk, bv, bpos, seg, bstate)
            return
        n = k.shape[2]
        self.update(
            layer,
            k[:, :, n - keep :].clone(),
            v[:, :, n - keep :].clone(),
            k_pos[:, k_pos.shape[1] - keep :].clone(),
            None if seg is None else seg.clone(),
            None if state is None else state[:, :, n - keep :].clone(),
        )

    def _append(
        self,
        layer: int,
        past: tuple[Tensor, Tensor, Tensor, Tensor | None],
        pstate: Tensor | None,
        k: Tensor,
        v: Tensor,
        k_pos: Tensor,
        state: Tensor | None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """The cached keys, values, positions (and per-key state) followed by the new ones (not stored:
        :meth:`update` does).

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
            or (pstate is not None and (pstate.shape[2] != n or state is None or pstate.dtype != state.dtype))
            or (state is not None and state.requires_grad and torch.is_grad_enabled())
        ):
            joined = None if pstate is None or state is None else torch.cat([pstate, state], dim=2)
            return torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2), torch.cat([ppos, k_pos], dim=1), joined
        buf = self._buffers.get(layer)
        if buf is None or not buf.holds(pk, pv, ppos, pstate, m):
            # grows by half: amortised O(m)
            buf = _KVBuffer(pk, pv, ppos, pstate, max(n + m + 64, 3 * (n + m) // 2))
            self._buffers[layer] = buf
        return buf.write(k, v, k_pos, state)

    def update(
        self,
        layer: int,
        k: Tensor,
        v: Tensor,
        k_pos: Tensor,
        k_segments: Tensor | None = None,
        state: Tensor | None = None,
    ) -> None:
        """Store all keys so far (rotated), their values, positions, segment ids (if any) and the encoding's per-key
        state (if it keeps one: :meth:`state`)."""
        self.layers[layer] = (k, v, k_pos, k_segments)
        if state is None:
            self.states.pop(layer, None)
        else:
            self.states[layer] = state

    def length(self) -> int:
        """Number of positions the cache has taken in (0 when empty): the first layer's :meth:`seen` (a local layer
        holds fewer keys: :meth:`cached`)."""
        if not self.layers:
            return 0
        return self.seen(next(iter(self.layers)))
