"""Attention after the projections: :class:`AttentionCore` plans each call and runs the kernel the plan names.

The plan is :mod:`posenc.attention.plan`'s; the kernels are one file per family (:mod:`~posenc.attention.sdpa`,
:mod:`~posenc.attention.blocked`, :mod:`~posenc.attention.own`, :mod:`~posenc.attention.materialised`). Imports
:mod:`posenc.base`, :mod:`posenc.errors`, :mod:`posenc.fused` (the form's type) and this package's files.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn

from ..base import AttentionContext, PositionalEncoding
from ..errors import ConfigError
from ..fused import RelativeForm
from .blocked import blocked, decode
from .call import _Call, repeat_kv
from .checks import check_encoding, check_int, check_probability
from .flex import flex
from .kernels import Plan
from .materialised import materialised
from .own import block_bias, offset_bias, own_blocked
from .plan import Facts, plan_call
from .sdpa import sdpa

PATHS = ("auto", "fast", "reference", "flex")


def _all_finite(*tensors: Tensor) -> bool:
    """Whether every entry of ``tensors`` is finite: one sum per tensor (NaN or inf anywhere make it non-finite; a
    sum that overflows only sends the call to :func:`quarantine_nonfinite`'s exact check)."""
    with torch.no_grad():
        total = sum(t.detach().sum(dtype=torch.float32) for t in tensors)
    return bool(torch.isfinite(total))


def quarantine_nonfinite(call: _Call) -> tuple[_Call, Tensor] | None:
    """Keep a non-finite key from reaching the queries that may not see it: ``None`` where nothing needs it, else the
    call with each key (and query) row that holds NaN or inf in ``k`` or ``v`` (``q``) set to zero, and the
    ``[B, H, Lq, 1]`` rows that do see such a key (or are such a query), whose output is then NaN.

    Softmax gives a hidden key probability 0, but ``0 · NaN`` is NaN, and every kernel (torch's flash SDPA as well)
    multiplies a block of probabilities that holds hidden keys by their values; zeroing the poisoned rows first keeps
    the other queries' outputs bit for bit what they are with any finite values in those rows. Only calls where some
    key is hidden from some query (a mask, or causal with several queries) pay the check, one sum over q, k and v;
    calls without a non-finite entry then run as before. Under ``torch.compile`` there is no branch on data: every
    such call zeroes the rows that need it (none, mostly: elementwise work that inductor fuses) and, for a causal
    call without a mask, finds the poisoned queries from each head's first non-finite key, ``O(L)`` not ``O(L^2)``.
    """
    q, k, v = call.q, call.k, call.v
    lq = q.shape[2]
    if call.allowed is None and not (call.causal and lq > 1):
        return None  # every query sees every key: a NaN reaches exactly the outputs it should
    if torch.compiler.is_compiling():
        return _quarantine_branch_free(call)
    if lq == 1 and call.allowed is not None:  # a decoding step: only the keys it may not see need the check
        cols = (~call.allowed).flatten(0, -2).any(0).nonzero().flatten()
        if not len(cols) or _all_finite(q, k.index_select(2, cols), v.index_select(2, cols)):
            return None
    elif _all_finite(q, k, v):
        return None
    bad_k = ~(torch.isfinite(k).all(-1) & torch.isfinite(v).all(-1))  # [B, Hkv, Lk]
    bad_q = ~torch.isfinite(q).all(-1)  # [B, H, Lq]
    if not bool(bad_k.any() | bad_q.any()):
        return None  # only a sum that overflowed: nothing is poisoned
    return _quarantine(call, bad_k, bad_q)


def _quarantine_branch_free(call: _Call) -> tuple[_Call, Tensor]:
    """:func:`quarantine_nonfinite` without a branch on the data (under ``torch.compile``): the same zeroed rows and
    the same poisoned queries, found as masks whatever the values.

    A row's sum (in float32) is non-finite where the row holds NaN or inf: a sum a row, fused with the zeroing by
    inductor, costs nothing measurable where ``isfinite(...).all(-1)`` cost 15 % of a compiled causal step. A finite
    row whose sum overflows float32 (entries near 1e38) counts as poisoned: loud (NaN), never silent."""
    q, k, v = call.q, call.k, call.v
    f32 = torch.float32
    bad_k = ~torch.isfinite(k.sum(-1, dtype=f32) + v.sum(-1, dtype=f32))  # [B, Hkv, Lk]
    bad_q = ~torch.isfinite(q.sum(-1, dtype=f32))  # [B, H, Lq]
    return _quarantine(call, bad_k, bad_q)


def _quarantine(call: _Call, bad_k: Tensor, bad_q: Tensor) -> tuple[_Call, Tensor]:
    """The call with the poisoned key rows ``bad_k`` ``[B, Hkv, Lk]`` and query rows ``bad_q`` ``[B, H, Lq]`` set to
    zero, and the ``[B, H, Lq, 1]`` queries that see such a key (or are one). With no mask (causal), a query is
    poisoned from each head's first bad key on: ``O(L)``, not ``O(L^2)``. No branch on data."""
    q, k, v = call.q, call.k, call.v
    lq, lk = q.shape[2], k.shape[2]
    g = q.shape[1] // k.shape[1]
    heads = bad_k.repeat_interleave(g, dim=1) if g > 1 else bad_k  # [B, H, Lk]
    if call.allowed is None:  # causal: query i sees keys j <= i + lk - lq, so it is poisoned past the first bad key
        j = torch.arange(lk, device=q.device)
        first = torch.where(heads, j, lk).amin(-1, keepdim=True)  # [B, H, 1]
        i = torch.arange(lq, device=q.device) + (lk - lq)
        rows = i >= first
    else:
        seen = call.allowed
        if call.causal:
            i = torch.arange(lq, device=q.device)[:, None]
            seen = seen & (torch.arange(lk, device=q.device)[None, :] <= i + (lk - lq))[None, None]
        rows = (seen & heads[:, :, None, :]).any(-1)
    rows = rows | bad_q
    keep = ~bad_k[..., None]
    zero = torch.zeros((), dtype=k.dtype, device=k.device)
    call = replace(call, q=q.masked_fill(bad_q[..., None], 0.0), k=k.where(keep, zero), v=v.where(keep, zero))
    return call, rows[..., None]


def finish_rows(out: Tensor, call: _Call, poisoned: Tensor | None) -> Tensor:
    """A kernel's output ``[B, H, Lq, Dh]`` as every path returns it: the queries that see a poisoned key (or are one,
    ``poisoned`` from :func:`quarantine_nonfinite`) NaN, as without the quarantine, and a query that may see no key at
    all (left padding) zero."""
    if poisoned is not None:
        out = out.masked_fill(poisoned, float("nan"))
    if call.allowed is not None and call.any_padding:
        out = out.masked_fill(~call.allowed.any(dim=-1, keepdim=True), 0.0)
    return out


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
        path: ``"auto"`` (fast where possible), ``"fast"``, ``"reference"`` or ``"flex"`` (flex_attention with
            the encoding's score_mod on any device: forward only on a CPU; a clear error where it cannot run).
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
        check_encoding(encoding, head_dim)
        self.n_heads, self.head_dim = n_heads, head_dim
        self.dropout = dropout
        self.path = path
        self.layer = layer
        if encoding is not None:  # an encoding built for other sizes fails here, not at the first call
            encoding.check_sizes(n_heads=n_heads, head_dim=head_dim)
        self.encoding = encoding
        hooks = encoding.hooks() if encoding is not None else frozenset()
        self._has = {h: h in hooks for h in ("rotate", "logits", "bias", "values", "probabilities")}
        self.last_plan: Plan | None = None

    def _keeps_groups(self, call: _Call, return_weights: bool) -> bool:
        """Whether a call with grouped keys (``Hkv < H``) may run on them as they are: one query (a decoding step,
        where repeating the cache's keys per step would cost as much as the attention itself), no weights asked
        for, no dropout, not the reference path, and an encoding that acts by a ``bias`` alone, or by a rotation
        alone (applied to q and k before the core: plain attention by now), or not at all (the kernel is then SDPA
        with the query heads of each group folded onto its key head), or one that offers an offset-table form (the
        decode kernel reads key head ``h // group`` for query head ``h``; :meth:`attend` repeats the keys where the
        plan is not that kernel)."""
        enc = self.encoding
        step = (
            call.q.shape[2] == 1
            and not call.ctx.reference
            and not return_weights
            and not (self.training and self.dropout > 0)
        )
        if self._has["probabilities"]:  # the encoding's own weights: the materialised kernel, on repeated keys
            return False
        if not step or (enc is not None and enc.logits_read_scores) or self.path == "flex":
            return False
        return not (self._has["logits"] or self._has["values"]) or (enc is not None and enc.offers_relative_form())

    def _plan(
        self, call: _Call, return_weights: bool, scale: float | None = None
    ) -> tuple[Plan, RelativeForm | None, Any]:
        """Step 5: the facts of this call (:class:`~posenc.attention.plan.Facts`), then
        :func:`~posenc.attention.plan.plan_call`: the plan, and the encoding's form or own kernel input it uses."""
        dropout = self.dropout if self.training else 0.0
        facts = Facts.of(call, self.encoding, self._has, self.fused, dropout, return_weights, self.path == "flex")
        plan, form, own = plan_call(facts, self.encoding, call, scale)
        if self._has["probabilities"] and plan.kernel != "own-blocked":  # its own weights, not blocked by itself:
            return self._own_probabilities(plan), None, None  # only the materialised kernel hands it the logits
        return plan, form, own

    def _own_probabilities(self, plan: Plan) -> Plan:
        """``plan``, or the ``materialised`` kernel where the encoding gives its own attention weights (its
        ``probabilities`` hook): the one kernel that hands the hook the logits."""
        if not self._has["probabilities"] or plan.kernel == "materialised":
            return plan
        reason = "the encoding gives its own attention weights instead of softmax (probabilities hook)"
        return replace(plan, kernel="materialised", reason=reason)  # as portable as the plan it replaces

    def _probabilities(self) -> Callable[[Tensor, AttentionContext], Tensor | None] | None:
        """The encoding's ``probabilities`` hook (``logits, ctx -> weights or None``), or ``None``."""
        return self.encoding.probabilities if self._has["probabilities"] and self.encoding is not None else None

    # ---------------------------------------------------------------- the encoding's terms
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

    def _values(self) -> Callable[[Tensor, AttentionContext], Tensor | None] | None:
        """The encoding's ``values`` hook (``probabilities, ctx -> a^V or None``), or ``None``."""
        return self.encoding.values if self._has["values"] and self.encoding is not None else None

    def _sdpa(self, call: _Call, plan: Plan, scale: float) -> Tensor:
        """The SDPA kernels, after folding the encoding's content term into q where it offers that."""
        q = call.q
        if self.encoding is not None and self._has["logits"] and not call.ctx.reference:
            folded = self.encoding.content_query(q, call.ctx)  # (q + c) · k_j: logits() then leave c · k_j out
            if folded is not None:
                q = folded
                call.ctx.content_folded = True
        return sdpa(call, plan, q, self._additive(call, scale), scale)

    # ---------------------------------------------------------------- the call
    def attend(
        self, call: _Call, return_weights: bool = False, scale: float | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """Steps 5-6: plan and run the kernel. ``[B, H, Lq, Dh]`` (and the probabilities when asked for).

        ``scale`` overrides the encoding's temperature (a transformers model's own ``scaling``). Grouped keys
        (``Hkv < H``) stay grouped where :meth:`_keeps_groups` allows; otherwise each key/value head is repeated
        for its ``H / Hkv`` query heads first, and the call runs as any other. A key hidden from a query reaches
        no part of its output, even where it holds NaN or inf (:func:`quarantine_nonfinite`)."""
        quarantined = quarantine_nonfinite(call)
        poisoned = None
        if quarantined is not None:
            call, poisoned = quarantined
        if call.k.shape[1] != call.q.shape[1] and not self._keeps_groups(call, return_weights):
            call = repeat_kv(call)
        if scale is None:
            enc = self.encoding
            scale = enc.scale(self.head_dim) if enc is not None else self.head_dim**-0.5
        plan, form, own = self._plan(call, return_weights, scale)
        if plan.grouped and (self._has["logits"] or self._has["values"]) and plan.kernel != "decode":
            call = repeat_kv(call)  # an encoding's logits on grouped keys: only the decode kernel reads them so
            plan, form, own = self._plan(call, return_weights, scale)
        self.last_plan = plan
        weights = None
        if plan.kernel == "flex":
            out = flex(call, own, scale)
        elif plan.kernel == "decode":
            assert form is not None
            out = decode(call, plan, form, scale)
        elif plan.kernel == "blocked":  # without a form (dropout on CPU): the encoding's terms as one tensor
            out = blocked(call, plan, form, None if form is not None else self._additive(call, scale), scale)
        elif plan.kernel == "offset-bias":
            assert own is not None
            out = offset_bias(call, own, scale)
        elif plan.kernel == "block-bias":
            out = block_bias(call, own, scale)
        elif plan.kernel == "own-blocked":
            out = own_blocked(call, own, scale)
        elif plan.kernel == "materialised":
            out, weights = materialised(
                call, scale, plan.dropout, self._terms, self._values(), probabilities=self._probabilities()
            )
        else:
            out = self._sdpa(call, plan, scale)
        return finish_rows(out, call, poisoned), weights
