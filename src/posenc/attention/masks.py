"""The mask of an attention call: :func:`build_mask` folds causality, key padding, packed documents and a custom
boolean mask into one boolean tensor (``True`` where a query may attend), checking each input; :func:`span_mask` is a
local layer's span (a sliding window or chunks: :mod:`posenc.schedule`).

Imports only :mod:`posenc.errors`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import ConfigError


def build_mask(
    *,
    batch: int,
    lq: int,
    lk: int,
    device: torch.device,
    causal: bool = False,
    attention_mask: Tensor | None = None,
    document_ids: Tensor | None = None,
    q_document_ids: Tensor | None = None,
    mask: Tensor | None = None,
) -> Tensor | None:
    """A boolean mask ``[B|1, 1|H, Lq, Lk]``, ``True`` where a query may attend, or ``None``.

    * ``causal``: query ``i`` (of the last ``Lq`` positions) sees keys ``0 .. i + Lk - Lq``
      (bottom-right aligned, so a KV cache or memory is visible to every query);
    * ``attention_mask``: ``[B, Lk]`` key padding, ``True``/1 for real tokens;
    * ``document_ids``: ``[B, Lk]`` ids of packed documents; a query sees only keys of its own
      document (``q_document_ids`` defaults to the last ``Lq`` of them);
    * ``mask``: any boolean mask broadcastable to ``[B, H, Lq, Lk]``.
    """
    out: Tensor | None = None

    def _and(m: Tensor) -> None:
        nonlocal out
        out = m if out is None else out & m

    if causal:
        i = torch.arange(lq, device=device)[:, None]
        j = torch.arange(lk, device=device)[None, :]
        _and((j <= i + (lk - lq))[None, None])
    if attention_mask is not None:
        if not isinstance(attention_mask, Tensor):
            raise ConfigError(f"attention_mask must be a tensor [batch, keys], got {type(attention_mask).__name__}")
        if attention_mask.shape != (batch, lk):
            raise ConfigError(
                f"attention_mask must have shape [batch, keys] = [{batch}, {lk}], got {tuple(attention_mask.shape)}"
            )
        if (
            attention_mask.dtype != torch.bool
            and not torch.compiler.is_compiling()
            and not bool(((attention_mask == 0) | (attention_mask == 1)).all())
        ):
            odd = attention_mask[(attention_mask != 0) & (attention_mask != 1)].flatten()[0].item()
            raise ConfigError(
                f"attention_mask must hold 1/True for real tokens and 0/False for padding, got a value {odd}; "
                "an additive mask (0 / -inf) is its opposite: pass (additive == 0) instead"
            )
        _and(attention_mask.bool()[:, None, None, :])
    if document_ids is not None:
        if not isinstance(document_ids, Tensor) or document_ids.is_floating_point():
            what = document_ids.dtype if isinstance(document_ids, Tensor) else type(document_ids).__name__
            raise ConfigError(f"document_ids must be an integer tensor [batch, keys], got {what}")
        if document_ids.shape != (batch, lk):
            raise ConfigError(f"document_ids must have shape [{batch}, {lk}], got {tuple(document_ids.shape)}")
        qd = document_ids[:, lk - lq :] if q_document_ids is None else q_document_ids
        _and((qd[:, :, None] == document_ids[:, None, :])[:, None])
    if mask is not None:
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
            what = mask.dtype if isinstance(mask, Tensor) else type(mask).__name__
            raise ConfigError(f"mask must be a boolean tensor (True = may attend), got {what}")
        shape = tuple(mask.shape)
        while mask.dim() < 4:
            mask = mask.unsqueeze(0) if mask.dim() < 3 else mask.unsqueeze(1)
        if mask.dim() != 4 or any(m not in (1, n) for m, n in zip(mask.shape, (batch, mask.shape[1], lq, lk))):
            raise ConfigError(
                f"mask must be broadcastable to [batch, heads, queries, keys] = [{batch}, heads, {lq}, {lk}] "
                f"([queries, keys], [batch|1, queries, keys] or [batch|1, heads|1, queries, keys]), got {shape}"
            )
        _and(mask)
    return out


def span_needed(kind: str, size: int, *, lq: int, lk: int, key_start: int) -> bool:
    """Whether a span hides any key from any query of a call (else no mask is needed): a window once the keys reach
    farther back than ``size`` from some query, chunks once the keys cross a chunk boundary."""
    if kind == "window":
        return lk > size
    return key_start // size != (key_start + lk - 1) // size


def span_mask(kind: str, size: int, *, lq: int, lk: int, key_start: int, device: torch.device, causal: bool) -> Tensor:
    """``[1, 1, Lq, Lk]``, ``True`` where a query may see a key under a local span (:mod:`posenc.schedule`).

    The keys are ``Lk`` consecutive tokens of the sequence from index ``key_start`` on; the queries are the last
    ``Lq`` of them (bottom-right aligned, as the causal mask: a KV cache's or memory's keys come first). ``kind``:

    * ``"window"``: query ``i`` sees key ``j`` when ``0 <= i - j < size`` (causal) or ``|i - j| < size``;
    * ``"chunk"``: when ``i // size == j // size`` (and ``j <= i`` when causal).
    """
    if kind not in ("window", "chunk"):
        raise ConfigError(f"a span mask is 'window' or 'chunk', got {kind!r}")
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigError(f"a {kind} span needs a size that is an integer >= 1, got {size!r}")
    j = torch.arange(lk, device=device)
    i = j[lk - lq :, None]
    if kind == "window":
        d = i - j[None, :]
        ok = (d < size) & (d >= 0) if causal else d.abs() < size
    else:
        ok = (i + key_start) // size == (j[None, :] + key_start) // size
        if causal:
            ok = ok & (j[None, :] <= i)
    return ok[None, None]
