"""Multi-head attention that composes an encoding's hooks and knows no paper by name.

    q, k      = rotate(x W_q, h W_k)                                  (rotary hook)
    A         = scale · (q kᵀ + logits(q, k)) + bias + mask           (logits / bias / scale hooks)
    z         = softmax(A) v + values(softmax(A))                     (values hook)

Two paths give the same numbers:

* the *reference* path materialises ``A`` exactly as written above, and hooks
  are asked to follow their paper literally (``ctx.reference = True``);
* the *fast* path hands ``A``'s extra terms to
  :func:`torch.nn.functional.scaled_dot_product_attention` as an additive mask
  (or no mask at all for rotary encodings), and hooks may use their
  O(L·d)-memory forms (skewing, gathers). An encoding with a ``values`` hook
  needs the probabilities, so it runs softmax itself but still with the fast
  hooks.

On CPU, an encoding that describes its logits (and values) as offset tables
(:meth:`~posenc.base.PositionalEncoding.relative_form`: Shaw, NEZHA, BERT
relative_key(_query), Transformer-XL, XLNet, TENER, DeBERTa) goes to
:func:`posenc.fused.relative_attention` instead, which computes the same numbers
one block of query rows at a time and never holds a ``[B, H, Lq, Lk]`` tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import AttentionContext, PositionalEncoding, as_position_rows, check_positions
from .errors import ConfigError, PositionError
from .fused import relative_attention

PATHS = ("auto", "fast", "reference")

# ctx.cache key: ``(q_pos, k_pos)`` that this attention made with ``arange`` (so contiguous without a check;
# relative encodings then skew without reading the positions, which torch.compile could not trace)
ARANGE_POSITIONS = "posenc:arange-positions"


# bytes of one block of scores in the backward of :class:`_BiasedSDPA` (about an L2 cache)
_CHUNK_BYTES = 2 * 2**20


class _BiasedSDPA(torch.autograd.Function):
    """``softmax(scale · q kᵀ + bias) v`` for a float ``bias`` that needs a gradient (a learnable encoding).

    :func:`~torch.nn.functional.scaled_dot_product_attention` sends such a mask to its math path, which keeps
    several ``[B, H, Lq, Lk]`` tensors for the backward (2.6–3.1× the time and 20–40× the memory of flash
    attention on CPU at L=2048). Here the forward is the CPU flash kernel with the bias as a constant mask,
    and the backward recomputes the probabilities (a softmax) block by block of query rows (each block stays
    in cache for its five uses), giving the usual gradients
    of q, k, v plus ``∂L/∂bias = P ∘ (dP − rowsum(dO ∘ O))`` summed over the dimensions the bias broadcasts
    over. Equal to the math path up to float rounding
    (tests/test_fastpath_speedups.py).
    """

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scale: float) -> Tensor:  # type: ignore[override]
        bias = bias.contiguous()  # a permuted bias (e.g. [L, L, H] -> [1, H, L, L]) is read 1 + B times below
        out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=bias, scale=scale
        )
        ctx.save_for_backward(q, k, v, bias, out)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):  # type: ignore[override]
        q, k, v, bias, out = ctx.saved_tensors
        scale = ctx.scale
        b, h, lq, _ = q.shape
        lk = k.shape[2]
        bb_n, bh_n = bias.shape[0], bias.shape[1]
        full = bb_n == b and bh_n == h  # one bias entry per (batch, head): written, not accumulated
        acc = torch.promote_types(q.dtype, torch.float32)
        delta = (dout * out).sum(-1, dtype=acc).to(q.dtype)  # [B, H, Lq]: rowsum(dO ∘ O)
        dout = dout.contiguous()  # q, k, v stay the (strided) views they are: BLAS reads rows of any stride
        dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        dbias = (torch.empty if full else torch.zeros)(bias.shape, dtype=bias.dtype, device=bias.device)
        # blocks of query rows small enough that a block of scores stays in cache between its five uses
        rows = max(1, min(lq, _CHUNK_BYTES // max(lk * q.element_size(), 1)))
        for bi in range(b):
            bb = bi if bb_n > 1 else 0
            for hi in range(h):
                hb = hi if bh_n > 1 else 0
                qh, kh, doh = q[bi, hi], k[bi, hi], dout[bi, hi]
                kt, vt = k[bi, hi].t(), v[bi, hi].t()
                dkh, dvh = dk[bi, hi], dv[bi, hi]
                for r0 in range(0, lq, rows):
                    r1 = min(lq, r0 + rows)
                    # the probabilities of these query rows: softmax of the recomputed scores (equal to
                    # exp(s - lse), but its vectorised exp is ~10x faster where a bias makes scores underflow)
                    p = torch.softmax(torch.addmm(bias[bb, hb, r0:r1], qh[r0:r1], kt, alpha=scale), dim=-1)
                    dvh.addmm_(p.t(), doh[r0:r1])
                    ds = torch.mm(doh[r0:r1], vt)
                    ds.sub_(delta[bi, hi, r0:r1, None]).mul_(p)  # dS = P ∘ (dP − Δ)
                    if full:
                        dbias[bb, hb, r0:r1] = ds
                    else:
                        dbias[bb, hb, r0:r1] += ds
                    # dq = dS k·s, dk = dSᵀ q·s: the scale goes on the thin results (no scaled copies of q, k)
                    torch.mm(ds, kh, out=dq[bi, hi, r0:r1]).mul_(scale)
                    dkh.addmm_(ds.t(), qh[r0:r1], alpha=scale)
        return dq, dk, dv, dbias, None


def _use_biased_sdpa(q: Tensor, mask: Tensor | None, p_drop: float, is_causal: bool) -> bool:
    return (
        mask is not None
        and mask.requires_grad
        and torch.is_grad_enabled()
        and p_drop == 0.0
        and not is_causal
        and q.device.type == "cpu"
        and mask.dim() == 4
        and q.dim() == 4
        and not torch.compiler.is_compiling()
    )


@dataclass
class KVCache:
    """Keys, values and key positions of earlier steps, one entry per layer.

    Keys are stored *after* the ``rotate`` hook, so a cached step is never
    rotated twice; positions are stored with them, so a hook always sees the
    true positions of every key.
    """

    layers: dict[int, tuple[Tensor, Tensor, Tensor, Tensor | None]] = field(default_factory=dict)

    def get(self, layer: int) -> tuple[Tensor, Tensor, Tensor, Tensor | None] | None:
        return self.layers.get(layer)

    def update(self, layer: int, k: Tensor, v: Tensor, k_pos: Tensor, k_segments: Tensor | None = None) -> None:
        """Store all keys so far (rotated), their values, positions and segment ids (if any)."""
        self.layers[layer] = (k, v, k_pos, k_segments)

    def length(self) -> int:
        """Number of cached key positions (0 when empty)."""
        if not self.layers:
            return 0
        return next(iter(self.layers.values()))[0].shape[-2]


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
        if attention_mask.shape != (batch, lk):
            raise ConfigError(
                f"attention_mask must have shape [batch, keys] = [{batch}, {lk}], got {tuple(attention_mask.shape)}"
            )
        _and(attention_mask.bool()[:, None, None, :])
    if document_ids is not None:
        if document_ids.shape != (batch, lk):
            raise ConfigError(f"document_ids must have shape [{batch}, {lk}], got {tuple(document_ids.shape)}")
        qd = document_ids[:, lk - lq :] if q_document_ids is None else q_document_ids
        _and((qd[:, :, None] == document_ids[:, None, :])[:, None])
    if mask is not None:
        if mask.dtype != torch.bool:
            raise ConfigError(f"mask must be boolean (True = may attend), got dtype {mask.dtype}")
        while mask.dim() < 4:
            mask = mask.unsqueeze(0) if mask.dim() < 3 else mask.unsqueeze(1)
        _and(mask)
    return out


class MultiHeadAttention(nn.Module):
    """Multi-head attention into which any :class:`~posenc.base.PositionalEncoding` plugs.

    Args:
        d_model: model width.
        n_heads: number of heads.
        encoding: the encoding whose hooks shape the attention (``None``: no position).
        head_dim: width of one head (default ``d_model // n_heads``).
        dropout: dropout on the attention probabilities.
        bias: whether the q/k/v/o projections have a bias.
        path: ``"auto"`` (fast where possible), ``"fast"`` or ``"reference"``.
    """

    # use the row-blocked kernel of :mod:`posenc.fused` for encodings that give a ``relative_form``
    # (CPU, fast path, no dropout); set to False to compare with the hook-by-hook fast path
    fused: bool = True

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
    ):
        super().__init__()
        if d_model <= 0 or n_heads <= 0:
            raise ConfigError(f"d_model and n_heads must be positive, got {d_model} and {n_heads}")
        if head_dim is None:
            if d_model % n_heads:
                raise ConfigError(f"d_model={d_model} is not divisible by n_heads={n_heads}; pass head_dim")
            head_dim = d_model // n_heads
        if path not in PATHS:
            raise ConfigError(f"path must be one of {PATHS}, got {path!r}")
        self.d_model, self.n_heads, self.head_dim = d_model, n_heads, head_dim
        self.inner = n_heads * head_dim
        self.dropout = dropout
        self.path = path
        self.layer = layer
        self.encoding = encoding
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
        hooks = encoding.hooks() if encoding is not None else frozenset()
        self._has = {h: h in hooks for h in ("rotate", "logits", "bias", "values")}

    def _split(self, x: Tensor) -> Tensor:
        b, n, _ = x.shape
        return x.view(b, n, self.n_heads, self.head_dim).transpose(1, 2)

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
            return_weights: also return the attention probabilities (reference path).
        """
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ConfigError(f"x must be [batch, length, {self.d_model}], got {tuple(x.shape)}")
        b, lq, _ = x.shape
        src = x if key_value is None else key_value
        if memory is not None:
            if memory.dim() != 3 or memory.shape[0] != b or memory.shape[-1] != self.d_model:
                raise ConfigError(
                    f"memory must be [batch={b}, M, d_model={self.d_model}], got {tuple(memory.shape)}; "
                    "it must come from a model with the same width"
                )
            src = torch.cat([memory, src], dim=1)
        past = kv_cache.get(self.layer) if kv_cache is not None else None
        n_past = 0 if past is None else past[0].shape[-2]
        n_new_keys = src.shape[1]
        offset = n_past + (src.shape[1] - lq if key_value is None else 0)

        if positions is None:
            q_pos = torch.arange(offset, offset + lq, device=x.device)[None, :]
        else:
            q_pos = as_position_rows(positions, lq)
            check_positions(q_pos, what="query positions", integer=False)
        if key_positions is None:
            if key_value is not None:
                new_k_pos = torch.arange(n_new_keys, device=x.device)[None, :]
            elif positions is None:
                new_k_pos = torch.arange(n_past, n_past + n_new_keys, device=x.device)[None, :]
            elif n_new_keys == lq:
                new_k_pos = q_pos
            else:
                raise PositionError(
                    "with memory and explicit query positions, pass key_positions for all "
                    f"{n_new_keys} keys (memory + sequence)"
                )
        else:
            new_k_pos = as_position_rows(key_positions, n_new_keys)
            check_positions(new_k_pos, what="key positions", integer=False)
        if q_pos.shape[0] not in (1, b) or new_k_pos.shape[0] not in (1, b):
            raise PositionError(f"positions must have batch size 1 or {b}")

        q = self._split(self.q_proj(x))
        k = self._split(self.k_proj(src))
        v = self._split(self.v_proj(src))
        reference = self.path == "reference"
        enc = self.encoding
        ctx = AttentionContext(
            q_pos=q_pos,
            k_pos=new_k_pos,
            n_heads=self.n_heads,
            head_dim=self.head_dim,
            layer=self.layer,
            reference=reference,
            cache={} if cache is None else cache,
            q_segments=segment_ids,
            k_segments=key_segment_ids if key_segment_ids is not None else segment_ids,
            attention=self,
            caching=kv_cache is not None,
        )
        if positions is None and key_positions is None:
            ctx.cache[ARANGE_POSITIONS] = (q_pos, new_k_pos)
        if enc is not None and self._has["rotate"]:
            q, k = enc.rotate(q, k, ctx)
        if past is not None:
            pk, pv, ppos, pseg = past
            k = torch.cat([pk, k], dim=2)
            v = torch.cat([pv, v], dim=2)
            if ppos.shape[0] != new_k_pos.shape[0]:
                nb = max(ppos.shape[0], new_k_pos.shape[0])
                ppos, new_k_pos = ppos.expand(nb, -1), new_k_pos.expand(nb, -1)
            ctx.k_pos = torch.cat([ppos, new_k_pos], dim=1)
            if pseg is not None and ctx.k_segments is not None and pseg.shape[0] == ctx.k_segments.shape[0]:
                ctx.k_segments = torch.cat([pseg, ctx.k_segments], dim=1)
        if kv_cache is not None:
            kv_cache.update(self.layer, k, v, ctx.k_pos, ctx.k_segments)
        lk = k.shape[2]

        allowed = build_mask(
            batch=b,
            lq=lq,
            lk=lk,
            device=x.device,
            causal=causal,
            attention_mask=attention_mask,
            document_ids=document_ids,
            mask=mask,
        )
        ctx.mask = allowed
        scale = enc.scale(self.head_dim) if enc is not None else self.head_dim**-0.5
        p_drop = self.dropout if self.training else 0.0
        form = None
        if (
            enc is not None
            and self.fused
            and not reference
            and not return_weights
            and p_drop == 0.0
            and not self._has["bias"]
            and q.device.type == "cpu"
            and lq * lk >= max(1, enc.fused_min_pairs)
            and not torch.compiler.is_compiling()
        ):
            form = enc.relative_form(q, k, ctx)
        extra = enc.logits(q, k, ctx) if form is None and enc is not None and self._has["logits"] else None
        post = enc.bias(ctx) if enc is not None and self._has["bias"] else None
        needs_probs = form is None and (return_weights or self._has["values"] or reference)

        if form is not None:
            out = relative_attention(form, v, scale, allowed)
            weights = None
        elif not needs_probs:
            add: Tensor | None = None
            if extra is not None:
                add = extra * scale
            if post is not None:
                add = post if add is None else add + post
            is_causal = False
            if add is None:
                if (
                    allowed is not None
                    and causal
                    and attention_mask is None
                    and document_ids is None
                    and mask is None
                    and lq == lk
                ):
                    attn_mask, is_causal = None, True
                else:
                    attn_mask = allowed
            else:
                attn_mask = add.to(q.dtype)
                if allowed is not None:
                    attn_mask = attn_mask.masked_fill(~allowed, torch.finfo(q.dtype).min)
            if _use_biased_sdpa(q, attn_mask, p_drop, is_causal):
                assert attn_mask is not None
                out = _BiasedSDPA.apply(q, k, v, attn_mask, scale)
            else:
                out = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=attn_mask, dropout_p=p_drop, is_causal=is_causal, scale=scale
                )
            weights = None
        else:
            scores = torch.matmul(q, k.transpose(-1, -2))
            if extra is not None:
                scores = scores + extra
            scores = scores * scale
            if post is not None:
                scores = scores + post
            if allowed is not None:
                scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
            weights = torch.softmax(scores, dim=-1)
            probs = F.dropout(weights, p_drop) if p_drop else weights
            out = torch.matmul(probs, v)
            if self._has["values"] and enc is not None:
                av = enc.values(probs, ctx)
                if av is not None:
                    out = out + av
        if allowed is not None and (attention_mask is not None or document_ids is not None or mask is not None):
            # a query that may see no key at all (left padding) gets a zero output on both paths
            out = out.masked_fill(~allowed.any(dim=-1, keepdim=True), 0.0)
        out = out.transpose(1, 2).reshape(b, lq, self.inner)
        out = self.o_proj(out)
        if return_weights:
            assert weights is not None
            return out, weights
        return out
