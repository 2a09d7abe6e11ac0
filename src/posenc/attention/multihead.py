"""The multi-head attention module: :class:`MultiHeadAttention` puts its projections, positions, KV cache and mask
in front of :class:`~posenc.attention.core.AttentionCore`.

Imports :mod:`posenc.base`, :mod:`posenc.errors` and this package's files.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..base import (
    AttentionContext,
    PositionalEncoding,
    as_position_rows,
    check_positions,
    contiguous_positions,
    mark_arange,
)
from ..errors import ConfigError, PositionError
from ..schedule import Span, qk_norm_kind
from .cache import KVCache
from .call import _Call
from .checks import check_encoding, check_int
from .core import AttentionCore
from .kernels import Plan
from .masks import build_mask, span_mask, span_needed


@dataclass
class _Inputs:
    """The keyword inputs of one :meth:`MultiHeadAttention.forward` (or :meth:`~MultiHeadAttention.plan`) besides
    ``x`` and ``return_weights``, which :meth:`MultiHeadAttention._prepare` reads (described in ``forward``)."""

    positions: Tensor | None = None
    key_value: Tensor | None = None
    key_positions: Tensor | None = None
    memory: Tensor | None = None
    causal: bool = False
    attention_mask: Tensor | None = None
    document_ids: Tensor | None = None
    mask: Tensor | None = None
    segment_ids: Tensor | None = None
    key_segment_ids: Tensor | None = None
    kv_cache: KVCache | None = None
    cache: dict | None = None


#: the ``eps`` of both kinds of :class:`QKNorm` (Qwen3's ``rms_norm_eps`` and Llama 4's ``L2Norm``)
QK_NORM_EPS = 1e-6


class QKNorm(nn.Module):
    """QK-norm: RMS-normalise the last dimension of q or k (one head's ``head_dim`` values; ``[B, H, L, head_dim]``,
    so each head by itself), as a layer with ``#qk`` or ``#qk-l2`` in its :mod:`posenc.schedule`
    (``LayerSpec.qk_norm``), or a model built with ``qk_norm=``, gives its :class:`MultiHeadAttention` (one for q,
    one for k):

    * ``"rms"``: ``x * rsqrt(mean(x², -1) + eps) * weight``, ``weight`` a learnable vector of ``head_dim`` values
      initialised to 1 and shared by the heads (Qwen3 and Gemma 3 on every layer; Gemma 3 writes the weight as
      ``1 + w`` with ``w`` initialised to 0, the same function; OLMo 2 normalises all heads' q together instead);
    * ``"l2"``: ``x * rsqrt(mean(x², -1) + eps)``, no parameter (Llama 4's ``L2Norm``, on its RoPE layers).

    The mean and the root are taken in float32 at least (float64 stays float64), and the result is cast back to the
    input's dtype before the weight multiplies it, as Qwen3's RMSNorm does.

    The attention applies it before the positional encoding (RoPE's rotation, a bias, a relative term): the
    encoding sees the normalised q and k, and a KV cache keeps the keys normalised and encoded. Llama 4 normalises
    after RoPE instead; for the weightless form the two orders agree, since a rotation ``R`` keeps every vector's
    length and so ``mean(x², -1)``: ``norm(R x) = R x / rms(R x) = R (x / rms(x)) = R norm(x)``. With a weight
    they differ (the weight scales dimensions that the rotation then mixes in pairs); posenc applies the weight
    before the rotation, as Qwen3 and Gemma 3 do.

    Args:
        kind: ``"rms"`` or ``"l2"``.
        head_dim: the width of one head (the weight's size).
        eps: added to the mean square before the root.
    """

    def __init__(self, kind: str, head_dim: int, eps: float = QK_NORM_EPS):
        super().__init__()
        if kind not in ("rms", "l2"):
            raise ConfigError(f"a QKNorm's kind is 'rms' or 'l2', got {kind!r}")
        self.kind, self.head_dim, self.eps = kind, head_dim, eps
        self.weight: nn.Parameter | None = nn.Parameter(torch.ones(head_dim)) if kind == "rms" else None

    def forward(self, x: Tensor) -> Tensor:
        """``x`` ``[..., head_dim]`` normalised over its last dimension (and scaled by ``weight`` for ``"rms"``)."""
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return out if self.weight is None else out * self.weight

    def extra_repr(self) -> str:
        return f"{self.kind}, head_dim={self.head_dim}, eps={self.eps}"


class MultiHeadAttention(AttentionCore):
    """Multi-head attention into which any :class:`~posenc.base.PositionalEncoding` plugs.

    One call runs six named steps: :meth:`_positions` (query and key positions, and whether they are contiguous),
    :meth:`_project_rotate` (q, k, v, the QK-norm and the ``rotate`` hook), :meth:`_extend_cache` (a KV cache), the mask
    (:func:`~posenc.attention.masks.build_mask`), :meth:`_plan` (the kernel, chosen by
    :func:`~posenc.attention.plan.choose_kernel` alone) and the kernel itself. :meth:`plan` says
    which kernel a call takes and why; ``last_plan`` holds the plan of the latest call.

    Args:
        d_model: model width.
        n_heads: number of heads.
        encoding: the encoding whose hooks shape the attention (``None``: no position).
        head_dim: width of one head (default ``d_model // n_heads``).
        dropout: dropout on the attention probabilities (every kernel applies it; none falls back for it).
        bias: whether the q/k/v/o projections have a bias.
        path: ``"auto"`` (fast where possible), ``"fast"``, ``"reference"`` or ``"flex"`` (see :class:`AttentionCore`).
        layer: this layer's index (the key of its entry in a :class:`KVCache`).
        span: which keys a query sees (:mod:`posenc.schedule`): ``None`` / ``"global"`` (all), ``("window", W)``
            (the last ``W``, its own included) or ``("chunk", C)`` (its chunk of ``C`` tokens). The span is one more
            boolean mask, so the call keeps its kernel (SDPA with the mask for RoPE and NoPE); a local layer's KV
            cache keeps only the keys a later query may see.
        qk_norm: ``None``, ``"rms"`` (RMSNorm of each head's q and k with a learnable weight of ``head_dim``
            values, Qwen3 / Gemma 3) or ``"l2"`` (weightless, Llama 4): applied right after the projections and
            before the encoding's hooks, so the encoding (and a KV cache) sees normalised q and k
            (:class:`QKNorm`). Position vectors that an encoding projects with this module's own
            ``q_proj`` / ``k_proj`` (DeBERTa's ``share_att_key``, contextual buckets) are not normalised.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        encoding: PositionalEncoding | None = None,
        *,
        head_dim: int | None = None,
        dropout: float = 0.0,
        bias: bool = True,
        path: str = "auto",
        layer: int = 0,
        span: Span | tuple[str, int] | str | None = None,
        qk_norm: str | None = None,
    ):
        check_int("d_model", d_model)
        check_int("n_heads", n_heads)
        check_int("head_dim", head_dim, optional=True)
        if head_dim is None:
            if d_model % n_heads:
                raise ConfigError(f"d_model={d_model} is not divisible by n_heads={n_heads}; pass head_dim")
            head_dim = d_model // n_heads
        check_encoding(encoding, head_dim)
        kind = qk_norm_kind(qk_norm)
        if encoding is not None:  # all three sizes in the message (the core checks n_heads and head_dim again)
            encoding.check_sizes(d_model=d_model, n_heads=n_heads, head_dim=head_dim)
        super().__init__(n_heads, head_dim, encoding, dropout=dropout, path=path, layer=layer)
        self.d_model = d_model
        given = Span.of(span)
        self.span: Span | None = None if given.is_global else given
        self.inner = n_heads * head_dim
        self.q_proj = nn.Linear(d_model, self.inner, bias=bias)
        if encoding is not None and not encoding.key_projection:
            if self.inner != d_model:
                raise ConfigError(
                    f"{encoding.info.name} uses K = H without a key projection, which needs "
                    f"n_heads * head_dim == d_model, got {self.inner} != {d_model}"
                )
            self.k_proj: nn.Module = nn.Identity()
        else:
            self.k_proj = nn.Linear(d_model, self.inner, bias=bias)
        self.v_proj = nn.Linear(d_model, self.inner, bias=bias)
        self.o_proj = nn.Linear(self.inner, d_model, bias=bias)
        #: ``None``, ``"rms"`` or ``"l2"``: the norm of each head's q and k (``q_norm``, ``k_norm``)
        self.qk_norm = kind
        self.q_norm: QKNorm | None = QKNorm(kind, head_dim) if kind is not None else None
        self.k_norm: QKNorm | None = QKNorm(kind, head_dim) if kind is not None else None

    def _split(self, x: Tensor) -> Tensor:
        b, n, _ = x.shape
        return x.view(b, n, self.n_heads, self.head_dim).transpose(1, 2)

    # ------------------------------------------------------------------ the steps
    def _positions(
        self,
        x: Tensor,
        src: Tensor,
        positions: Tensor | None,
        key_positions: Tensor | None,
        cross: bool,
        n_past: int,
        cache: dict,
    ) -> tuple[Tensor, Tensor]:
        """Query positions ``[B|1, Lq]`` and the new keys' positions ``[B|1, Lk_new]``, validated."""
        b, lq = x.shape[:2]
        n_new_keys = src.shape[1]
        offset = n_past + (0 if cross else n_new_keys - lq)
        if positions is None:
            q_pos = mark_arange(cache, torch.arange(offset, offset + lq, device=x.device)[None, :])
        else:
            q_pos = as_position_rows(positions, lq)
            check_positions(q_pos, what="query positions", integer=False)
        if key_positions is not None:
            k_pos = as_position_rows(key_positions, n_new_keys)
            check_positions(k_pos, what="key positions", integer=False)
        elif cross:
            k_pos = mark_arange(cache, torch.arange(n_new_keys, device=x.device)[None, :])
        elif positions is None:
            k_pos = mark_arange(cache, torch.arange(n_past, n_past + n_new_keys, device=x.device)[None, :])
        elif n_new_keys == lq:
            k_pos = q_pos
        else:
            raise PositionError(
                "with memory and explicit query positions, pass key_positions for all "
                f"{n_new_keys} keys (memory + sequence)"
            )
        for what, rows, given in (("positions", q_pos, positions), ("key_positions", k_pos, key_positions)):
            if rows.shape[0] not in (1, b):
                shape = tuple(given.shape) if isinstance(given, Tensor) else tuple(rows.shape)
                raise PositionError(
                    f"{what} have batch size {rows.shape[0]} (shape {shape}) but x has batch size {b}; "
                    f"give one row of positions for the whole batch ([L] or [1, L]) or one per sequence ([{b}, L])"
                )
        return q_pos, k_pos

    def _project_rotate(self, x: Tensor, src: Tensor, ctx: AttentionContext) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v ``[B, H, L, Dh]``, with the QK-norm (if any) and then the ``rotate`` hook applied to q and the new
        keys."""
        q = self._split(self.q_proj(x))
        k = self._split(self.k_proj(src))
        v = self._split(self.v_proj(src))
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.encoding is not None and self._has["rotate"]:
            q, k = self.encoding.rotate(q, k, ctx)
        return q, k, v

    def _extend_cache(
        self, k: Tensor, v: Tensor, ctx: AttentionContext, kv_cache: KVCache | None
    ) -> tuple[Tensor, Tensor]:
        """Prepend the cached keys / values / positions (and store the extended ones): :meth:`KVCache._extend`."""
        if kv_cache is None:
            return k, v
        return kv_cache._extend(self.layer, id(self), self._sizes(), k, v, ctx, self.span)

    def _sizes(self) -> str:
        """This module's sizes in words (the width first), for messages about a KV cache of another model."""
        return f"d_model={self.d_model}, n_heads={self.n_heads}, head_dim={self.head_dim}"

    def _prepare(self, x: Tensor, inputs: _Inputs) -> _Call:
        """Steps 1-4: positions, projections and rotation, cache, mask."""
        positions, key_value, key_positions = inputs.positions, inputs.key_value, inputs.key_positions
        memory, causal, kv_cache, cache = inputs.memory, inputs.causal, inputs.kv_cache, inputs.cache
        attention_mask, document_ids, mask = inputs.attention_mask, inputs.document_ids, inputs.mask
        self._check_input(x, "x")
        b, lq, _ = x.shape
        cache = {} if cache is None else cache
        src = x if key_value is None else key_value
        if key_value is not None:
            self._check_input(key_value, "key_value", batch=b)
        if kv_cache is not None and not isinstance(kv_cache, KVCache):
            raise ConfigError(f"kv_cache must be a posenc.KVCache, got {type(kv_cache).__name__}")
        if memory is not None:
            if not isinstance(memory, Tensor) or memory.dim() != 3 or memory.shape[0] != b:
                shape = tuple(memory.shape) if isinstance(memory, Tensor) else type(memory).__name__
                raise ConfigError(
                    f"memory must be [batch={b}, M, d_model={self.d_model}], got {shape}; "
                    "it must come from a model with the same width"
                )
            self._check_input(memory, "memory", batch=b, empty_ok=True)
            src = torch.cat([memory, src], dim=1)
        if self.span is not None and key_value is not None:
            raise ConfigError(
                f"this attention has a {self.span.kind} span ({self.span}), which orders queries and keys in one "
                "sequence; cross-attention (key_value=) has no such order: build it with span=None"
            )
        # tokens taken in before this call (the default positions go on from there), and how many of them a local
        # layer's cache still holds: the keys of this call are the sequence's tokens from n_past - n_cached on
        n_past = kv_cache.seen(self.layer) if kv_cache is not None else 0
        n_cached = kv_cache.cached(self.layer) if kv_cache is not None else 0
        q_pos, k_pos = self._positions(x, src, positions, key_positions, key_value is not None, n_past, cache)
        ctx = AttentionContext(
            q_pos=q_pos,
            k_pos=k_pos,
            n_heads=self.n_heads,
            head_dim=self.head_dim,
            layer=self.layer,
            reference=self.path == "reference",
            cache=cache,
            q_segments=inputs.segment_ids,
            k_segments=inputs.key_segment_ids if inputs.key_segment_ids is not None else inputs.segment_ids,
            attention=self,
            caching=kv_cache is not None,
        )
        # the mask before the rotate hook, so that every hook may read it (SSMax counts the keys each query sees):
        # the keys are the cached ones followed by this call's
        lk = n_cached + src.shape[1]
        allowed = build_mask(
            batch=b,
            lq=lq,
            lk=lk,
            device=x.device,
            causal=causal and lq > 1,  # one query (a decoding step) sees every key: an all-True mask is none
            attention_mask=attention_mask,
            document_ids=document_ids,
            mask=mask,
        )
        local = self.span is not None and span_needed(
            self.span.kind, self.span.size or 1, lq=lq, lk=lk, key_start=n_past - n_cached
        )
        if local:
            allowed = self._span_mask(lq, lk, n_past - n_cached, causal, x.device, cache, allowed)
        if allowed is not None and allowed.shape[1] not in (1, self.n_heads):
            raise ConfigError(
                f"mask has {allowed.shape[1]} heads but this attention has n_heads={self.n_heads}; "
                "give it 1 or n_heads entries in that dimension"
            )
        ctx.mask, ctx.n_keys = allowed, lk
        held = kv_cache.get(self.layer) if kv_cache is not None else None
        ctx.past_keys = held[0] if held is not None else None  # for a rotate hook that carries state with the keys
        ctx.past_key_state = kv_cache.state(self.layer) if kv_cache is not None else None
        q, k, v = self._project_rotate(x, src, ctx)
        k, v = self._extend_cache(k, v, ctx, kv_cache)
        # once per forward and pair of position tensors (memoised in the shared cache), after the cache has
        # prepended its keys' positions: the decision every hook and the plan read
        ctx.contiguous = contiguous_positions(ctx.q_pos, ctx.k_pos, cache)
        # a span is a mask beyond the causal one: kernels that would skip to the causal mask take the whole mask
        padding = attention_mask is not None or document_ids is not None or mask is not None or local
        return _Call(
            q,
            k,
            v,
            ctx,
            allowed,
            plain_causal=causal and not padding and lq == lk,
            causal=causal and lk >= lq,
            any_padding=padding,
        )

    def _span_mask(
        self, lq: int, lk: int, key_start: int, causal: bool, device: torch.device, cache: dict, allowed: Tensor | None
    ) -> Tensor:
        """``allowed`` and this layer's span mask (the span's mask kept in the forward's ``cache`` for the layers
        that share it)."""
        span = self.span
        assert span is not None and span.size is not None
        key = ("posenc:span", span.kind, span.size, lq, lk, key_start, causal, str(device))
        got = cache.get(key)
        if got is None:
            got = span_mask(span.kind, span.size, lq=lq, lk=lk, key_start=key_start, device=device, causal=causal)
            cache[key] = got
        return got if allowed is None else allowed & got

    def extra_repr(self) -> str:
        parts = ([] if self.span is None else [f"span={self.span}"]) + (
            [f"qk_norm={self.qk_norm!r}"] if self.qk_norm else []
        )
        return ", ".join(parts)

    def _check_input(self, t: Any, what: str, batch: int | None = None, empty_ok: bool = False) -> None:
        """A hidden-state input: a ``[batch, length, d_model]`` float tensor of the module's dtype and device."""
        if not isinstance(t, Tensor):
            raise ConfigError(f"{what} must be a tensor [batch, length, {self.d_model}], got {type(t).__name__}")
        if t.dim() != 3 or t.shape[-1] != self.d_model or (batch is not None and t.shape[0] != batch):
            b = "batch" if batch is None else f"batch={batch}"
            raise ConfigError(f"{what} must be [{b}, length, {self.d_model}] (d_model), got {tuple(t.shape)}")
        if not empty_ok and (t.shape[0] == 0 or t.shape[1] == 0):
            raise ConfigError(
                f"{what} has no tokens (shape {tuple(t.shape)}): posenc refuses empty input for every encoding; "
                "pass at least one sequence of at least one token"
            )
        weight = self.q_proj.weight
        if t.dtype != weight.dtype:
            raise ConfigError(
                f"{what} has dtype {t.dtype} but this attention's weights are {weight.dtype}; pass "
                f"{what}.to({weight.dtype}) or convert the module with .to({t.dtype})"
            )
        if t.device != weight.device:
            raise ConfigError(
                f"{what} is on {t.device} but this attention is on {weight.device}; move one of them (.to(device))"
            )

    # ---------------------------------------------------------------- public
    def plan(self, x: Tensor, *, return_weights: bool = False, **kwargs: Any) -> Plan:
        """The kernel that ``self(x, **kwargs)`` would take, and why (nothing is computed under autograd, and a
        ``kv_cache`` passed here is left unchanged)."""
        kv_cache = kwargs.pop("kv_cache", None)
        if kv_cache is not None:
            kv_cache = kv_cache._fork()
        grad = torch.is_grad_enabled()
        with torch.no_grad():
            call = self._prepare(x, _Inputs(**kwargs, kv_cache=kv_cache))
            if grad:  # as the call would see them: q and k need a gradient wherever the projections do
                call.q.requires_grad_(self.q_proj.weight.requires_grad)
                call.k.requires_grad_(self.q_proj.weight.requires_grad)
        return self._plan(call, return_weights)[0]

    def forward(
        self,
        x: Tensor,
        *,
        positions: Tensor | None = None,
        key_value: Tensor | None = None,
        key_positions: Tensor | None = None,
        memory: Tensor | None = None,
        causal: bool = False,
        attention_mask: Tensor | None = None,
        document_ids: Tensor | None = None,
        mask: Tensor | None = None,
        segment_ids: Tensor | None = None,
        key_segment_ids: Tensor | None = None,
        kv_cache: KVCache | None = None,
        cache: dict | None = None,
        return_weights: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Attend from ``x`` ``[B, Lq, D]`` to itself (or to ``key_value``).

        Args:
            positions: query positions ``[Lq]`` or ``[B, Lq]``; default ``arange`` continuing
                after any memory / cached keys.
            key_value: a different source for keys and values (cross-attention).
            key_positions: positions of the keys of ``key_value`` / ``memory`` + ``x``.
            memory: ``[B, M, D]`` hidden states of an earlier segment, prepended to the keys
                and values (Transformer-XL recurrence); pass them detached.
            causal, attention_mask, document_ids, mask: see :func:`build_mask`;
                ``attention_mask`` and ``document_ids`` cover all keys (memory/cache included).
            segment_ids, key_segment_ids: segment ids for encodings that use them (XLNet).
            kv_cache: a :class:`KVCache`; new keys/values are appended to it.
            cache: a dict shared by the layers of one forward (for per-forward caching).
            return_weights: also return the attention probabilities (materialised kernel).
        """
        inputs = _Inputs(
            positions=positions,
            key_value=key_value,
            key_positions=key_positions,
            memory=memory,
            causal=causal,
            attention_mask=attention_mask,
            document_ids=document_ids,
            mask=mask,
            segment_ids=segment_ids,
            key_segment_ids=key_segment_ids,
            kv_cache=kv_cache,
            cache=cache,
        )
        call = self._prepare(x, inputs)
        out, weights = self.attend(call, return_weights)
        b, lq = x.shape[:2]
        out = self.o_proj(out.transpose(1, 2).reshape(b, lq, self.inner))
        if return_weights:
            assert weights is not None
            return out, weights
        return out
