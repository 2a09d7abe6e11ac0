"""One attention call as the steps before the kernel hand it on (:class:`_Call`), and :func:`repeat_kv`.

:class:`~posenc.attention.MultiHeadAttention` makes a ``_Call`` from its input; :mod:`posenc.hf` makes one from a
transformers model's own projections. Imports only :mod:`posenc.base` and the checks of this package.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch import Tensor

from ..base import AttentionContext
from .checks import check_groups


@dataclass
class _Call:
    """What the steps of one :meth:`MultiHeadAttention.forward` hand each other. ``k`` and ``v`` may have fewer
    heads than ``q`` (grouped-query attention: ``H / Hkv`` query heads per key head), from :mod:`posenc.hf`."""

    q: Tensor
    k: Tensor
    v: Tensor
    ctx: AttentionContext
    allowed: Tensor | None
    plain_causal: bool  # the mask is exactly the causal one over Lq == Lk (SDPA's is_causal)
    causal: bool  # a causal mask (bottom-right aligned, Lk >= Lq) is part of ``allowed``: kernels may skip past it
    any_padding: bool  # a key-padding / document / custom mask is in play (fully masked rows possible)


def repeat_kv(call: _Call) -> _Call:
    """``call`` with each key/value head repeated for the ``H / Hkv`` query heads it serves (transformers'
    ``repeat_kv`` order: query head ``h`` reads key head ``h // (H / Hkv)``)."""
    g = check_groups(call.q.shape[1], call.k.shape[1])
    return replace(call, k=call.k.repeat_interleave(g, dim=1), v=call.v.repeat_interleave(g, dim=1))


def beyond_causal(call: _Call) -> Tensor | None:
    """The call's mask for a kernel that takes ``causal=call.causal`` beside it: ``None`` where the mask is only the
    causal one (each block of query rows then skips the keys it cannot see), else the whole mask."""
    return None if call.causal and not call.any_padding else call.allowed
