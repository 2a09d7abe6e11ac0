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
An encoding whose bias depends on the offset alone and gives it per offset
(:meth:`~posenc.base.PositionalEncoding.bias_offsets`: T5, KERPLE, dynamic position
bias) goes to :func:`posenc.offset_bias.offset_bias_attention`, which never makes
the ``[H, Lq, Lk]`` bias or its gradient; one that evaluates its bias per block of query rows
(:meth:`~posenc.base.PositionalEncoding.bias_blocks`: FIRE) goes to
:func:`posenc.block_bias.block_bias_attention`. A decoding step (one query, no gradient) of an encoding with such a
form goes to :func:`posenc.native.decode_attention`: one pass over the keys, the values and the offset tables.

Those CPU kernels (the CPU flash op, the C code of :mod:`posenc.native`, the row loops of the blocked, offset-bias
and block-bias kernels) run only on CPU. On any other device (CUDA, MPS, XPU, ...) the plan is the *portable*
one: every call takes :func:`~torch.nn.functional.scaled_dot_product_attention` (the encoding's terms as its
additive mask) or the materialised formula, which exist wherever torch runs; see :func:`choose_kernel`. The
portable plan can be forced on CPU (``with posenc.attention.portable():`` or ``POSENC_PORTABLE=1``) to test
what another device would compute.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import native
from .base import (
    AttentionContext,
    PositionalEncoding,
    as_position_rows,
    check_positions,
    contiguous_positions,
    mark_arange,
)
from .block_bias import block_bias_attention
from .errors import ConfigError, PositionError
from .fused import RelativeForm, Rows, relative_attention
from .offset_bias import offset_bias_attention

PATHS = ("auto", "fast", "reference")

#: the kernels of the portable plan: they exist on every device torch runs on (see :func:`portable`)
PORTABLE_KERNELS = ("sdpa", "materialised")

_TRUE = ("1", "true", "yes", "on")
# the portable plan forced on CPU: ``POSENC_PORTABLE=1`` at import, or inside ``with portable():``
_forced: list[bool] = [os.environ.get("POSENC_PORTABLE", "0").strip().lower() in _TRUE]
if _forced[0]:
    native.enabled = False  # the portable plan runs no native C code either


def portable_forced() -> bool:
    """Whether the portable plan is forced on CPU (:func:`portable`, or ``POSENC_PORTABLE=1`` at import)."""
    return _forced[-1]


@contextmanager
def portable(enabled: bool = True) -> Iterator[None]:
    """Force the device-portable plan on CPU inside the ``with`` block (``enabled=False``: lift it).

    The plan then takes what it takes on a GPU or any other non-CPU device: only the kernels of
    :data:`PORTABLE_KERNELS` (SDPA with the encoding's terms as its additive mask, or the materialised
    formula), never the CPU flash op, the blocked / offset-bias / block-bias / decode kernels, or the C code
    of :mod:`posenc.native` (``posenc.native.enabled`` is ``False`` inside the block, so the encodings' own
    hooks take their PyTorch forms too). It is how the test suite checks, on a CPU-only machine, what a CUDA,
    MPS or XPU call computes (tests/test_portable.py). The setting is process-wide (not per thread), and nests.
    ``POSENC_PORTABLE=1`` in the environment forces it for the whole process (and turns the native code off);
    ``portable(False)`` lifts the forcing inside its block and leaves ``posenc.native.enabled`` as it was.

    Example::

        with posenc.attention.portable():
            out = attn(x)
        print(attn.last_plan)  # sdpa: ... (portable plan: forced on CPU)
    """
    before = native.enabled
    _forced.append(bool(enabled))
    if enabled:
        native.enabled = False
    try:
        yield
    finally:
        _forced.pop()
        native.enabled = before


# the kernels an attention call may take (Plan.kernel), what each computes
KERNELS = {
    "sdpa": "torch's scaled_dot_product_attention (the flash kernel where there is no float mask)",
    "biased-sdpa": "flash forward with the bias as a constant mask; a blocked backward gives the bias its gradient",
    "decode": "posenc.native.decode_attention: one query, one pass over the keys, values and offset tables",
    "block-bias": "posenc.block_bias: flash on row blocks with the encoding's bias evaluated per block, and its "
    "gradient per block (no [H, Lq, Lk] bias or gradient)",
    "offset-bias": "posenc.offset_bias: flash on row blocks, the bias a strided view of its per-offset values; a "
    "blocked backward sums its gradient per offset (no [H, Lq, Lk] bias or gradient)",
    "blocked": "posenc.fused.relative_attention: row-blocked, offset tables skewed in place, no [B, H, Lq, Lk] tensor",
    "own-blocked": "the encoding's own row-blocked attention (blocked_attention; CoPE: its gates, their sums and "
    "interpolated positions per block of query rows, recomputed in the backward; no [B, H, Lq, Lk] tensor)",
    "materialised": "the logits as one [B, H, Lq, Lk] tensor, softmax, then the values (the formula as written)",
}


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
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scale: float, causal: bool = False) -> Tensor:  # type: ignore[override]
        bias = bias.contiguous()  # a permuted bias (e.g. [L, L, H] -> [1, H, L, L]) is read 1 + B times below
        out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=bias, scale=scale
        )
        ctx.save_for_backward(q, k, v, bias, out)
        ctx.scale, ctx.causal = scale, causal
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):  # type: ignore[override]
        q, k, v, bias, out = ctx.saved_tensors
        scale = ctx.scale
        b, h, lq, _ = q.shape
        lk = k.shape[2]
        bb_n, bh_n = bias.shape[0], bias.shape[1]
        causal = ctx.causal  # (Lq == Lk) query i sees keys 0 .. i: a block of rows skips the keys past its diagonal
        full = bb_n == b and bh_n == h and not causal  # one bias entry per (batch, head): written, not accumulated
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
                    ke = r1 if causal else lk
                    # the probabilities of these query rows: softmax of the recomputed scores (equal to
                    # exp(s - lse), but its vectorised exp is ~10x faster where a bias makes scores underflow)
                    s = torch.addmm(bias[bb, hb, r0:r1, :ke], qh[r0:r1], kt[:, :ke], alpha=scale)
                    if causal:  # the block's own diagonal square: query r0 + i sees keys up to r0 + i
                        s[:, r0:].masked_fill_(_upper(r1 - r0, s.device), float("-inf"))
                    p = torch.softmax(s, dim=-1)
                    dvh[:ke].addmm_(p.t(), doh[r0:r1])
                    ds = torch.mm(doh[r0:r1], vt[:, :ke])
                    ds.sub_(delta[bi, hi, r0:r1, None]).mul_(p)  # dS = P ∘ (dP − Δ)
                    if full:
                        dbias[bb, hb, r0:r1] = ds
                    else:
                        dbias[bb, hb, r0:r1, :ke] += ds
                    # dq = dS k·s, dk = dSᵀ q·s: the scale goes on the thin results (no scaled copies of q, k)
                    torch.mm(ds, kh[:ke], out=dq[bi, hi, r0:r1]).mul_(scale)
                    dkh[:ke].addmm_(ds.t(), qh[r0:r1], alpha=scale)
        return dq, dk, dv, dbias, None, None


def check_int(name: str, value: Any, minimum: int = 1, *, optional: bool = False) -> None:
    """Raise :class:`ConfigError` unless ``value`` is an integer ``>= minimum`` (or ``None`` where ``optional``)."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")


def check_probability(name: str, value: Any) -> None:
    """Raise :class:`ConfigError` unless ``value`` is a number in ``[0, 1)`` (a dropout probability)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ConfigError(f"{name} must be a number in [0, 1), got {value!r}")


def _check_encoding(encoding: Any, head_dim: int) -> None:
    if encoding is not None and not isinstance(encoding, PositionalEncoding):
        raise ConfigError(
            f"encoding must be a posenc.PositionalEncoding (e.g. posenc.get('rope', head_dim={head_dim})) or "
            f"None, got {type(encoding).__name__} {encoding!r}"
        )


def _upper(n: int, device: torch.device) -> Tensor:
    """``[n, n]``, ``True`` above the diagonal (the keys a causal row may not see)."""
    return torch.ones(n, n, dtype=torch.bool, device=device).triu_(1)


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


@dataclass(frozen=True)
class Plan:
    """Which kernel one attention call takes, and why (:meth:`MultiHeadAttention.plan`).

    Attributes:
        kernel: one of :data:`KERNELS`.
        reason: the rule of :func:`choose_kernel` that picked it, in words.
        contiguous: whether the positions are ``start + arange`` per row with one key-minus-query start (the skew,
            Toeplitz and blocked forms apply) rather than arbitrary (gather forms).
        terms: what the encoding adds to the logits on this call: ``"form"`` (offset tables for the blocked
            kernel), ``"logits"`` and/or ``"bias"`` (tensors), or nothing.
        dropout: the attention dropout applied on this call.
        portable: whether the call was planned without the CPU kernels (a non-CPU device, ``torch.compile``
            tracing, or :func:`portable` forced on CPU): the kernel is then one of :data:`PORTABLE_KERNELS`.
        grouped: whether the call kept grouped-query keys as they are (fewer key/value heads than query heads, each
            serving ``H / Hkv`` query heads: the query heads of a group are folded onto its key head, no copy of the
            keys; :meth:`AttentionCore.attend`). ``False`` also where grouped keys were repeated to ``H`` heads.
    """

    kernel: str
    reason: str
    contiguous: bool
    terms: tuple[str, ...] = ()
    dropout: float = 0.0
    portable: bool = False
    grouped: bool = False

    def __str__(self) -> str:
        pos = "contiguous" if self.contiguous else "arbitrary"
        terms = "+".join(self.terms) or "none"
        where = ", portable plan" if self.portable else ""
        where += ", grouped keys folded" if self.grouped else ""
        return f"{self.kernel}: {self.reason} (positions {pos}, terms {terms}, dropout {self.dropout:g}{where})"


def choose_kernel(
    *,
    reference: bool,
    return_weights: bool,
    has_form: bool,
    one_query: bool = False,
    scores_once: bool = False,
    has_offsets: bool = False,
    has_blocks: bool = False,
    has_own: bool = False,
    needs_values: bool,
    has_terms: bool,
    learned_bias: bool,
    dropout: float,
    on_cpu: bool,
    compiling: bool,
) -> tuple[str, str]:
    """The one place that picks a kernel: the first rule that holds, top to bottom.

    ``on_cpu`` says whether the CPU kernels may run: the tensors are on CPU and the portable plan is not forced
    (:func:`portable`). They are the CPU flash op (biased-sdpa, offset-bias, block-bias and SDPA's causal call
    with a bias), the C code of :mod:`posenc.native` (decode) and the row loops of the blocked kernels, which
    would launch one small kernel per block on a GPU. Without them (``on_cpu=False``: CUDA, MPS, XPU, ...)
    a call takes SDPA or the materialised formula, both of which exist on every device (:data:`PORTABLE_KERNELS`).

    ================================================  ==============  ==================================
    condition                                         kernel          why
    ================================================  ==============  ==================================
    ``path="reference"`` or ``return_weights``        materialised    the formula as written / the weights
    one query, no gradient, a form that fits it (1)   decode          keys, values, tables read once
    the encoding's own row-blocked attention (1)      own-blocked     no ``[B, H, L, L]`` tensor (CoPE)
    one query whose logits read ``q·kᵀ`` (CoPE)        materialised    ``q·kᵀ`` computed once, shared
    an offset-table form (relative encodings) (1)     blocked         no ``L × L`` or ``L × L × d`` tensor
    a bias given per offset (no dropout, no pad) (1)  offset-bias     no ``[H, L, L]`` bias or gradient
    a bias given per block of rows (the same) (1)     block-bias      no ``[H, L, L]`` bias or gradient
    a ``values`` hook without a form                  materialised    a^V needs the probabilities
    dropout (1) (2)                                   blocked         CPU SDPA has no fused dropout
    a learned bias (1) (2)                            biased-sdpa     flash forward, blocked backward
    the encoding's logits or bias as tensors          sdpa            SDPA with the terms as its mask
    anything else                                     sdpa            SDPA's own kernel (flash)
    ================================================  ==============  ==================================

    (1) CPU kernels only (``on_cpu``). Elsewhere the rule is skipped and a later one holds: a relative encoding's
    hooks give their logits (and a^V) as tensors, so it takes ``sdpa`` with them as the additive mask, or
    ``materialised`` for a^V; a bias per offset or per block is laid out as a tensor for ``sdpa``; dropout is SDPA's
    own (fused on GPUs); a learned bias gets its gradient from SDPA's backward (the memory-efficient kernel on
    CUDA). (2) Not while ``torch.compile`` traces. ``flex_attention`` with a ``score_mod`` would suit the bias
    family on GPUs, but its backward does not run on CPU, so the portable plan could not be tested against the
    reference path here; it is not used.
    """
    cpu = on_cpu and not compiling
    if reference:
        return "materialised", "path='reference' follows the formulas literally"
    if return_weights:
        return "materialised", "return_weights needs the probabilities"
    if one_query and on_cpu:
        return "decode", "one query (a decoding step): one pass over the keys with the offset tables (native)"
    if has_own and on_cpu:
        return "own-blocked", "the encoding attends one block of query rows at a time (blocked_attention)"
    if scores_once:
        return "materialised", "one query whose logits read q·kᵀ: computed once and handed to them (ctx.scores)"
    if has_form and on_cpu:
        return "blocked", "the encoding gave its logits as offset tables (relative_form)"
    if has_offsets and on_cpu:
        return "offset-bias", "the encoding gave its bias per offset (bias_offsets)"
    if has_blocks and on_cpu:
        return "block-bias", "the encoding evaluates its bias per block of query rows (bias_blocks)"
    if needs_values:
        return "materialised", (
            "a values hook needs the probabilities (no offset-table form on this call: none offered, "
            "fewer pairs than fused_min_pairs, or positions not start + arange)"
        )
    if dropout and cpu:
        return "blocked", "attention dropout on CPU (SDPA's CPU kernels would materialise it)"
    if learned_bias and cpu:
        return "biased-sdpa", "a bias with a gradient (SDPA's math path would keep [B, H, Lq, Lk] tensors)"
    if has_terms:
        if not on_cpu:
            return "sdpa", "the encoding's terms as SDPA's additive mask (portable: no CPU kernels on this call)"
        return "sdpa", "the encoding's terms as SDPA's additive mask"
    return "sdpa", "no extra terms: SDPA's own kernel"


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


class AttentionCore(nn.Module):
    """Attention after the projections: an encoding's hooks, the plan, and the kernels.

    :class:`MultiHeadAttention` adds its own projections and positions in front of it;
    :mod:`posenc.hf` puts one inside each attention layer of a transformers model, whose own
    projections (and KV cache) then feed it. :meth:`attend` takes the prepared q, k, v and their
    :class:`~posenc.base.AttentionContext` (a :class:`_Call`) and returns ``[B, H, Lq, Dh]``.

    Args:
        n_heads, head_dim: the shape of q (k and v have the same number of heads).
        encoding: the encoding whose hooks shape the attention (``None``: no position).
        dropout: dropout on the attention probabilities while training.
        path: ``"auto"`` (fast where possible), ``"fast"`` or ``"reference"``.
        layer: this layer's index (the key of its entry in a :class:`KVCache`).
    """

    # use the row-blocked kernel of :mod:`posenc.fused` for encodings that give a ``relative_form``
    # (CPU, fast path); set to False to compare with the hook-by-hook fast path
    fused: bool = True

    def __init__(
        self,
        n_heads: int,
        head_dim: int,
        encoding: PositionalEncoding | None = None,
        *,
        dropout: float = 0.0,
        path: str = "auto",
        layer: int = 0,
    ):
        super().__init__()
        if path not in PATHS:
            raise ConfigError(f"path must be one of {PATHS}, got {path!r}")
        check_int("n_heads", n_heads)
        check_int("head_dim", head_dim)
        check_int("layer", layer, 0)
        check_probability("dropout", dropout)
        _check_encoding(encoding, head_dim)
        self.n_heads, self.head_dim = n_heads, head_dim
        self.dropout = dropout
        self.path = path
        self.layer = layer
        if encoding is not None:  # an encoding built for other sizes fails here, not at the first call
            encoding.check_sizes(n_heads=n_heads, head_dim=head_dim)
        self.encoding = encoding
        hooks = encoding.hooks() if encoding is not None else frozenset()
        self._has = {h: h in hooks for h in ("rotate", "logits", "bias", "values")}
        self.last_plan: Plan | None = None

    def _keeps_groups(self, call: _Call, return_weights: bool) -> bool:
        """Whether a call with grouped keys (``Hkv < H``) runs on them as they are: one query (a decoding step,
        where repeating the cache's keys per step would cost as much as the attention itself), an encoding that
        acts by a ``bias`` alone (or not at all: it never reads the keys), no weights asked for, no dropout, not the
        reference path. The kernel is then SDPA with the query heads of each group folded onto its key head."""
        enc = self.encoding
        return (
            call.q.shape[2] == 1
            and not (self._has["rotate"] or self._has["logits"] or self._has["values"])
            and (enc is None or not enc.logits_read_scores)
            and not call.ctx.reference
            and not return_weights
            and not (self.training and self.dropout > 0)
        )

    def _plan(self, call: _Call, return_weights: bool) -> tuple[Plan, RelativeForm | None, Any]:
        """Step 5: ask the encoding for its fast form where one may apply, then :func:`choose_kernel`.

        Returns the plan, the encoding's offset-table form (``relative_form``) and its bias per offset
        (``bias_offsets``) or per block (``bias_blocks``), each ``None`` unless the plan uses it."""
        enc, ctx, q, k = self.encoding, call.ctx, call.q, call.k
        reference = ctx.reference
        p_drop = self.dropout if self.training else 0.0
        # the CPU kernels (CPU flash op, native code, row-blocked loops): CPU tensors, the portable plan not forced
        on_cpu = q.device.type == "cpu" and not portable_forced()
        compiling = torch.compiler.is_compiling()
        # grouped keys kept as they are (:meth:`_keeps_groups`): SDPA with the groups folded, no other kernel
        grouped = k.shape[1] != q.shape[1]
        form = None
        fast_form = (
            enc is not None
            and not grouped
            and self.fused
            and not reference
            and not return_weights
            and not self._has["bias"]
            and on_cpu
            and not compiling
        )
        # one query without gradients (a decoding step): the one-pass native kernel, where the form fits it
        one_query = (
            fast_form
            and q.shape[2] == 1
            and p_drop == 0
            and q.dtype in (torch.float32, torch.float64)
            and q.shape[-1] <= native.DECODE_MAX_HEAD_DIM
            and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or _learnable(enc)))
            and enc.offers_relative_form()
            and native.available()
        )
        big = enc is not None and (p_drop > 0 or q.shape[2] * k.shape[2] >= max(1, enc.fused_min_pairs))
        if fast_form and (big or one_query):
            form = enc.relative_form(q, k, ctx)
        decode = one_query and form is not None and _decodable(form)
        if form is not None and not decode and not big:
            form = None  # asked for the decode kernel only, and it does not fit: the hooks as usual
        # what the encoding's own CPU kernels (a bias per offset or per block, CoPE's row blocks) all need
        own_kernel_ok = (
            enc is not None
            and not grouped
            and not self._has["values"]
            and not reference
            and not return_weights
            and p_drop == 0
            and on_cpu
            and not compiling
            and q.dtype in (torch.float32, torch.float64)
            and q.shape[2] * k.shape[2] >= max(1, enc.fused_min_pairs)
        )
        offsets = blocks = None
        if (
            own_kernel_ok
            and self._has["bias"]
            and not self._has["logits"]
            and (call.allowed is None or (call.causal and not call.any_padding))
        ):
            offsets = enc.bias_offsets(ctx)
            if offsets is None:
                blocks = enc.bias_blocks(ctx)
        own = None  # the encoding's own row-blocked attention (CoPE), from Lq·Lk >= fused_min_pairs
        if (
            own_kernel_ok
            and self._has["logits"]
            and not self._has["bias"]
            and q.shape[2] > 1
            and hasattr(enc, "blocked_attention")
        ):
            own = enc.blocked_attention(ctx)
        has_logits = enc is not None and self._has["logits"] and form is None
        has_bias = enc is not None and self._has["bias"]
        learnable = _learnable(enc)
        grads = torch.is_grad_enabled() and (
            (has_bias and learnable) or (has_logits and (learnable or q.requires_grad or k.requires_grad))
        )
        kernel, reason = choose_kernel(
            reference=reference,
            return_weights=return_weights,
            has_form=form is not None,
            one_query=decode,
            scores_once=(
                enc is not None and enc.logits_read_scores and self._has["logits"] and q.shape[2] == 1 and not compiling
            ),
            has_offsets=offsets is not None,
            has_blocks=blocks is not None,
            has_own=own is not None,
            needs_values=self._has["values"] and form is None,
            has_terms=has_logits or has_bias,
            learned_bias=grads,
            dropout=p_drop,
            on_cpu=on_cpu,
            compiling=compiling,
        )
        terms = tuple(t for t, on in (("form", form is not None), ("logits", has_logits), ("bias", has_bias)) if on)
        plan = Plan(kernel, reason, ctx.contiguous, terms, p_drop, portable=not on_cpu or compiling, grouped=grouped)
        return plan, form, offsets if offsets is not None else blocks if blocks is not None else own

    # ---------------------------------------------------------------- the kernels
    def _terms(self, call: _Call) -> tuple[Tensor | None, Tensor | None]:
        """The encoding's ``logits`` (before the temperature) and ``bias`` (after) as tensors, or ``None``."""
        enc = self.encoding
        if enc is None:
            return None, None
        extra = enc.logits(call.q, call.k, call.ctx) if self._has["logits"] else None
        post = enc.bias(call.ctx) if self._has["bias"] else None
        return extra, post

    def _additive(self, call: _Call, scale: float) -> Tensor | None:
        """``scale · logits + bias``: one additive term after the temperature, or ``None``."""
        extra, post = self._terms(call)
        add = extra * scale if extra is not None else None
        if post is not None:
            add = post if add is None else add + post
        return add

    def _run_blocked(self, call: _Call, plan: Plan, form: RelativeForm | None, scale: float) -> Tensor:
        add = None if form is not None else self._additive(call, scale)
        form = form if form is not None else RelativeForm(q=call.q, k=call.k)
        # a mask that is only the causal one goes as causal=True (each block then skips the keys it cannot see)
        allowed = None if call.causal and not call.any_padding else call.allowed
        return relative_attention(form, call.v, scale, allowed, bias=add, dropout=plan.dropout, causal=call.causal)

    def _run_decode(self, call: _Call, plan: Plan, form: RelativeForm, scale: float) -> Tensor:
        """One query: :func:`posenc.native.decode_attention` with the form's terms (blocked if it declines)."""
        query_term = key_table = add = None
        if form.query_terms:
            a, table = form.query_terms[0]
            t, idx = (table.table, table.index) if isinstance(table, Rows) else (table, None)
            query_term = (a[:, :, 0], t, idx)  # offset t(0, j) = j: row j of the table, or index[j]
        if form.key_terms:
            table = form.key_terms[0][1]
            key_table = (table.table, table.index) if isinstance(table, Rows) else (table, None)
        if form.segment is not None:  # XLNet: e[same] (a logit: scaled)
            e, same = form.segment
            e0, e1 = e[:, :, 0, 0:1], e[:, :, 0, 1:2]  # [B, H, 1]: the same segment or not
            add = torch.where(same[:, None, 0, :], e0, e1) * scale  # [B, H, Lk]
        if call.allowed is not None:
            mask = torch.zeros(call.allowed.shape, dtype=call.q.dtype, device=call.q.device)
            mask = mask.masked_fill_(~call.allowed, float("-inf"))
            mask = mask[:, :, 0]
            add = mask if add is None else add + mask
        out = native.decode_attention(
            form.q[:, :, 0], form.k, call.v, scale, query_term=query_term, key_table=key_table, add=add
        )
        if out is None:
            return self._run_blocked(call, plan, form, scale)
        return out[:, :, None]

    def _run_sdpa(self, call: _Call, plan: Plan, scale: float) -> Tensor:
        q, k, v, allowed = call.q, call.k, call.v, call.allowed
        if self.encoding is not None and self._has["logits"] and not call.ctx.reference:
            folded = self.encoding.content_query(q, call.ctx)  # (q + c) · k_j: logits() then leave c · k_j out
            if folded is not None:
                q = folded
                call.ctx.content_folded = True
        add = self._additive(call, scale)
        if plan.grouped:  # one query on grouped keys (_keeps_groups): the mask says every key it may not see
            mask = allowed if add is None else add.to(q.dtype)
            if add is not None and allowed is not None:
                mask = mask.masked_fill(~allowed, torch.finfo(q.dtype).min)
            return _grouped_sdpa(q, k, v, mask, scale)
        is_causal = False
        if add is None:
            attn_mask = None if call.plain_causal else allowed
            is_causal = call.plain_causal
        else:
            attn_mask = add.to(q.dtype)
            # CPU flash takes a float mask *and* is_causal (skipping the blocks past the diagonal); SDPA's public
            # entry refuses the pair, so a causal Lq == Lk call with a bias goes to the kernel itself
            flash_causal = call.causal and q.shape[2] == k.shape[2] and _cpu_flash(q, plan)
            if allowed is not None and not (flash_causal and not call.any_padding):
                attn_mask = attn_mask.masked_fill(~allowed, torch.finfo(q.dtype).min)
            if flash_causal:
                if plan.kernel == "biased-sdpa" and _use_biased_sdpa(q, attn_mask, plan.dropout, False):
                    return _BiasedSDPA.apply(q, k, v, attn_mask, scale, True)
                out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    q, k, v, 0.0, True, attn_mask=attn_mask.expand(q.shape[0], -1, -1, -1), scale=scale
                )
                return out
        if plan.kernel == "biased-sdpa" and _use_biased_sdpa(q, attn_mask, plan.dropout, is_causal):
            assert attn_mask is not None
            return _BiasedSDPA.apply(q, k, v, attn_mask, scale)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=plan.dropout, is_causal=is_causal, scale=scale
        )

    def _run_materialised(self, call: _Call, plan: Plan, scale: float) -> tuple[Tensor, Tensor]:
        q, k, v, ctx = call.q, call.k, call.v, call.ctx
        scores = torch.matmul(q, k.transpose(-1, -2))
        ctx.scores = scores  # for a logits hook that reads q·kᵀ (logits_read_scores): computed once
        extra, post = self._terms(call)
        if extra is not None:
            scores = scores + extra
        scores = scores * scale
        if post is not None:
            scores = scores + post
        if call.allowed is not None:
            scores = scores.masked_fill(~call.allowed, torch.finfo(scores.dtype).min)
        weights = torch.softmax(scores, dim=-1)
        probs = F.dropout(weights, plan.dropout) if plan.dropout else weights
        out = torch.matmul(probs, v)
        if self._has["values"] and self.encoding is not None:
            av = self.encoding.values(probs, ctx)
            if av is not None:
                out = out + av
        return out, weights

    def attend(
        self, call: _Call, return_weights: bool = False, scale: float | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """Steps 5-6: plan and run the kernel. ``[B, H, Lq, Dh]`` (and the probabilities when asked for).

        ``scale`` overrides the encoding's temperature (a transformers model's own ``scaling``). Grouped keys
        (``Hkv < H``) stay grouped where :meth:`_keeps_groups` allows; otherwise each key/value head is repeated
        for its ``H / Hkv`` query heads first, and the call runs as any other."""
        if call.k.shape[1] != call.q.shape[1] and not self._keeps_groups(call, return_weights):
            call = repeat_kv(call)
        plan, form, offsets = self._plan(call, return_weights)
        self.last_plan = plan
        if scale is None:
            enc = self.encoding
            scale = enc.scale(self.head_dim) if enc is not None else self.head_dim**-0.5
        weights = None
        if plan.kernel == "decode":
            assert form is not None
            out = self._run_decode(call, plan, form, scale)
        elif plan.kernel == "blocked":
            out = self._run_blocked(call, plan, form, scale)
        elif plan.kernel == "offset-bias":
            assert offsets is not None
            out = offset_bias_attention(call.q, call.k, call.v, offsets, scale, causal=call.causal)
        elif plan.kernel == "block-bias":
            fn, params = offsets  # (bias_blocks)
            out = block_bias_attention(call.q, call.k, call.v, fn, params, scale, causal=call.causal)
        elif plan.kernel == "own-blocked":  # (blocked_attention) a mask that is only the causal one goes as causal
            allowed = None if call.causal and not call.any_padding else call.allowed
            out = offsets(call.q, call.k, call.v, scale, call.causal, allowed)
        elif plan.kernel == "materialised":
            out, weights = self._run_materialised(call, plan, scale)
        else:
            out = self._run_sdpa(call, plan, scale)
        if call.allowed is not None and call.any_padding:
            # a query that may see no key at all (left padding) gets a zero output on every kernel
            out = out.masked_fill(~call.allowed.any(dim=-1, keepdim=True), 0.0)
        return out, weights


class MultiHeadAttention(AttentionCore):
    """Multi-head attention into which any :class:`~posenc.base.PositionalEncoding` plugs.

    One call runs six named steps: :meth:`_positions` (query and key positions, and whether they are contiguous),
    :meth:`_project_rotate` (q, k, v and the ``rotate`` hook), :meth:`_extend_cache` (a KV cache), :meth:`_mask`,
    :meth:`_plan` (the kernel, chosen by :func:`choose_kernel` alone) and the kernel itself. :meth:`plan` says
    which kernel a call takes and why; ``last_plan`` holds the plan of the latest call.

    Args:
        d_model: model width.
        n_heads: number of heads.
        encoding: the encoding whose hooks shape the attention (``None``: no position).
        head_dim: width of one head (default ``d_model // n_heads``).
        dropout: dropout on the attention probabilities (every kernel applies it; none falls back for it).
        bias: whether the q/k/v/o projections have a bias.
        path: ``"auto"`` (fast where possible), ``"fast"`` or ``"reference"``.
        layer: this layer's index (the key of its entry in a :class:`KVCache`).
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
    ):
        check_int("d_model", d_model)
        check_int("n_heads", n_heads)
        check_int("head_dim", head_dim, optional=True)
        if head_dim is None:
            if d_model % n_heads:
                raise ConfigError(f"d_model={d_model} is not divisible by n_heads={n_heads}; pass head_dim")
            head_dim = d_model // n_heads
        _check_encoding(encoding, head_dim)
        if encoding is not None:  # all three sizes in the message (the core checks n_heads and head_dim again)
            encoding.check_sizes(d_model=d_model, n_heads=n_heads, head_dim=head_dim)
        super().__init__(n_heads, head_dim, encoding, dropout=dropout, path=path, layer=layer)
        self.d_model = d_model
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
        """q, k, v ``[B, H, L, Dh]`` with the ``rotate`` hook applied to q and the new keys."""
        q = self._split(self.q_proj(x))
        k = self._split(self.k_proj(src))
        v = self._split(self.v_proj(src))
        if self.encoding is not None and self._has["rotate"]:
            q, k = self.encoding.rotate(q, k, ctx)
        return q, k, v

    def _extend_cache(
        self, k: Tensor, v: Tensor, ctx: AttentionContext, kv_cache: KVCache | None
    ) -> tuple[Tensor, Tensor]:
        """Prepend the cached keys / values / positions (and store the extended ones)."""
        if kv_cache is None:
            return k, v
        past = kv_cache.get(self.layer)
        owner = kv_cache.owners.get(self.layer)
        if past is not None and owner is not None and owner != id(self):
            pk = past[0]
            theirs = kv_cache._sizes.get(self.layer) or f"n_heads={pk.shape[1]}, head_dim={pk.shape[3]}"
            raise ConfigError(
                f"this KVCache's layer {self.layer} was filled by another attention module ({theirs}) and is read "
                f"by one of {self._sizes()} (another model?); a cache belongs to the model that filled it: start "
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
            k, v, ctx.k_pos = kv_cache._append(self.layer, past, k, v, ctx.k_pos)
            if pseg is not None and ctx.k_segments is not None and pseg.shape[0] == ctx.k_segments.shape[0]:
                ctx.k_segments = torch.cat([pseg, ctx.k_segments], dim=1)
        kv_cache.update(self.layer, k, v, ctx.k_pos, ctx.k_segments)
        kv_cache.owners[self.layer] = id(self)
        kv_cache._sizes[self.layer] = self._sizes()
        return k, v

    def _sizes(self) -> str:
        """This module's sizes in words (the width first), for messages about a KV cache of another model."""
        return f"d_model={self.d_model}, n_heads={self.n_heads}, head_dim={self.head_dim}"

    def _prepare(
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
    ) -> _Call:
        """Steps 1-4: positions, projections and rotation, cache, mask."""
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
        past = kv_cache.get(self.layer) if kv_cache is not None else None
        n_past = 0 if past is None else past[0].shape[-2]
        q_pos, k_pos = self._positions(x, src, positions, key_positions, key_value is not None, n_past, cache)
        ctx = AttentionContext(
            q_pos=q_pos,
            k_pos=k_pos,
            n_heads=self.n_heads,
            head_dim=self.head_dim,
            layer=self.layer,
            reference=self.path == "reference",
            cache=cache,
            q_segments=segment_ids,
            k_segments=key_segment_ids if key_segment_ids is not None else segment_ids,
            attention=self,
            caching=kv_cache is not None,
        )
        q, k, v = self._project_rotate(x, src, ctx)
        k, v = self._extend_cache(k, v, ctx, kv_cache)
        # once per forward and pair of position tensors (memoised in the shared cache), after the cache has
        # prepended its keys' positions: the decision every hook and the plan read
        ctx.contiguous = contiguous_positions(ctx.q_pos, ctx.k_pos, cache)
        lk = k.shape[2]
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
        if allowed is not None and allowed.shape[1] not in (1, self.n_heads):
            raise ConfigError(
                f"mask has {allowed.shape[1]} heads but this attention has n_heads={self.n_heads}; "
                "give it 1 or n_heads entries in that dimension"
            )
        ctx.mask = allowed
        padding = attention_mask is not None or document_ids is not None or mask is not None
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
            kv_cache = KVCache(dict(kv_cache.layers), dict(kv_cache.owners))
        grad = torch.is_grad_enabled()
        with torch.no_grad():
            call = self._prepare(x, kv_cache=kv_cache, **kwargs)
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
        call = self._prepare(
            x,
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
        out, weights = self.attend(call, return_weights)
        b, lq = x.shape[:2]
        out = self.o_proj(out.transpose(1, 2).reshape(b, lq, self.inner))
        if return_weights:
            assert weights is not None
            return out, weights
        return out


def check_groups(n_heads: int, kv_heads: int) -> int:
    """``H / Hkv``: how many query heads each key/value head serves (a :class:`ConfigError` if it is not whole)."""
    if kv_heads < 1 or n_heads % kv_heads:
        raise ConfigError(
            f"grouped-query attention needs the query heads ({n_heads}) to be a multiple of the key/value heads "
            f"({kv_heads})"
        )
    return n_heads // kv_heads


def repeat_kv(call: _Call) -> _Call:
    """``call`` with each key/value head repeated for the ``H / Hkv`` query heads it serves (transformers'
    ``repeat_kv`` order: query head ``h`` reads key head ``h // (H / Hkv)``)."""
    g = check_groups(call.q.shape[1], call.k.shape[1])
    return replace(call, k=call.k.repeat_interleave(g, dim=1), v=call.v.repeat_interleave(g, dim=1))


def _grouped_sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    """SDPA of ``q`` ``[B, H, Lq, D]`` on grouped keys ``[B, Hkv, Lk, D]`` without repeating them: the ``H / Hkv``
    query heads of a group become rows of one ``[B, Hkv, (H / Hkv)·Lq, D]`` query (a view), the mask
    ``[B|1, H|1, Lq, Lk]`` is laid out the same way. Not causal: only for calls whose mask says all there is to
    say (:meth:`AttentionCore._keeps_groups`: one query)."""
    b, h, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    g = check_groups(h, hkv)
    if mask is not None:
        mb = mask.shape[0]
        mask = mask.expand(mb, h, lq, lk).reshape(mb, hkv, g * lq, lk)
    out = F.scaled_dot_product_attention(q.reshape(b, hkv, g * lq, d), k, v, attn_mask=mask, scale=scale)
    return out.reshape(b, h, lq, d)


def _cpu_flash(q: Tensor, plan: Plan) -> bool:
    """Whether the CPU flash kernel can run this call directly (eager, CPU, float, no dropout, not portable)."""
    return (
        not plan.portable
        and q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)
        and plan.dropout == 0.0
        and not torch.compiler.is_compiling()
    )


def _decodable(form: RelativeForm) -> bool:
    """Whether :func:`posenc.native.decode_attention` computes this form: at most one query term, at most one key term
    whose operand is the keys, no value table (Shaw's and NEZHA's a^V)."""
    return (
        len(form.query_terms) <= 1
        and len(form.key_terms) <= 1
        and all(c is form.k for c, _ in form.key_terms)
        and form.value_table is None
    )


def _learnable(enc: PositionalEncoding | None) -> bool:
    """Whether the encoding has a parameter that needs a gradient (its terms are then not constants)."""
    return enc is not None and any(p.requires_grad for p in enc.parameters())
