"""The encoding's own CPU kernels, which never make the ``[H, Lq, Lk]`` bias or its gradient: ``offset-bias`` (a bias
given per offset, :func:`posenc.offset_bias.offset_bias_attention`), ``block-bias`` (a bias evaluated per block of
query rows, :func:`posenc.block_bias.block_bias_attention`) and ``own-blocked`` (the encoding's own row-blocked
attention, CoPE's ``blocked_attention``).

Imports :mod:`posenc.offset_bias` and :mod:`posenc.block_bias` (kernels) and this package's call record.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ..block_bias import block_bias_attention
from ..offset_bias import offset_bias_attention
from .call import _Call, beyond_causal


def offset_bias(call: _Call, offsets: Any, scale: float) -> Tensor:
    """The ``offset-bias`` kernel: ``offsets`` is what the encoding's ``bias_offsets`` gave."""
    return offset_bias_attention(call.q, call.k, call.v, offsets, scale, causal=call.causal)


def block_bias(call: _Call, blocks: Any, scale: float) -> Tensor:
    """The ``block-bias`` kernel: ``blocks`` is what the encoding's ``bias_blocks`` gave, ``(fn, params)``."""
    fn, params = blocks
    return block_bias_attention(call.q, call.k, call.v, fn, params, scale, causal=call.causal)


def own_blocked(call: _Call, attend: Any, scale: float) -> Tensor:
    """The ``own-blocked`` kernel: ``attend`` is what the encoding's ``blocked_attention`` gave."""
    return attend(call.q, call.k, call.v, scale, call.causal, beyond_causal(call))
