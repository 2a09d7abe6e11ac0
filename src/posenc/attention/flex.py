"""The ``flex`` kernel: :func:`torch.nn.attention.flex_attention.flex_attention` with a ``score_mod`` made from the
encoding's own fast forms, and a :class:`~torch.nn.attention.flex_attention.BlockMask` for the call's mask.

An encoding's maths is written once, in its own file, as the fast forms the CPU kernels already read; this file turns
them into what flex_attention takes, so that no encoding needs a list of kernels and no kernel a list of encodings:

* a bias per offset (:meth:`~posenc.base.PositionalEncoding.bias_offsets`: ALiBi, KERPLE, T5's buckets, the dynamic
  bias, the contextual bucket bias): ``score + vals[h, j - i + Lq - 1]``;
* logits as offset tables (:meth:`~posenc.base.PositionalEncoding.relative_form`: Shaw's keys, NEZHA,
  relative_key(_query), Transformer-XL, XLNet, TENER, DeBERTa's c2p/p2c): each query term ``a_i · T[t]`` and key term
  ``c_j · U[t]`` becomes a per-query (per-key) table of products ``[B, H, L, R]`` over the table's ``R`` rows,
  computed once, which the score_mod indexes by the offset's row (a clipped or bucketed table has few rows; an
  unclipped one, Transformer-XL's, has one per offset: ``[B, H, L, Lq + Lk - 1]``, still without the ``L × L × d``
  of the formula);
* an encoding's own score_mod (:meth:`~posenc.base.PositionalEncoding.flex_score`), for a bias that is neither
  (FIRE's MLP of normalised offsets).

What does not fit keeps its kernel, and :func:`why_not` says why: a values term (Shaw's and NEZHA's ``a^V`` needs
the probabilities), XLNet's segment term (it reads a second mask), CoPE's gates (they read ``q·kᵀ``), arbitrary
positions (the forms are offset tables of ``start + arange`` rows), dropout (flex has none).

On a CPU, flex_attention runs its unfused reference forward (and refuses a backward); under :func:`torch.compile`
it runs fused. On CUDA each call goes through a compiled flex_attention. Imports :mod:`posenc.base`,
:mod:`posenc.errors`, :mod:`posenc.fused` (the form's types) and this package's call record.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from ..base import PositionalEncoding
from ..errors import ConfigError
from ..fused import RelativeForm, Rows
from .call import _Call

ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


@dataclass
class FlexForm:
    """What the flex kernel runs: the content query and key (``q̃``, ``k̃``: Transformer-XL's ``q + u``), and the
    score_mod adding the encoding's terms to ``scale · q̃·k̃`` (``None``: nothing to add)."""

    q: Tensor
    k: Tensor
    score_mod: ScoreMod | None
    source: str  # which fast form it came from (the plan's reason names it)


def available() -> bool:
    """Whether this torch has flex_attention (2.5 and later)."""
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


# ---------------------------------------------------------------- the forms
OffsetIndex = Callable[[Tensor, Tensor, Tensor], Tensor]  # (b, q_idx, kv_idx) -> the offset's index t


def _row_offsets(lq: int) -> OffsetIndex:
    """``t = j - i + Lq - 1`` from the row indices (positions ``start + arange`` per row: the fast forms' offsets)."""

    def index(b: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return kv_idx - q_idx + (lq - 1)

    return index


def _position_offsets(q_pos: Tensor, k_pos: Tensor, lq: int) -> OffsetIndex:
    """``t = p_j - p_i + Lq - 1`` from the positions themselves (packed documents, whose positions restart)."""
    per_q, per_k = q_pos.shape[0] > 1, k_pos.shape[0] > 1

    def index(b: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return k_pos[b if per_k else 0, kv_idx] - q_pos[b if per_q else 0, q_idx] + (lq - 1)

    return index


def _offset_context(call: _Call) -> tuple[Any, OffsetIndex] | None:
    """The context the encoding's offset forms are asked with, and how a pair finds its offset in them.

    Contiguous positions: the call's own context, offsets from the row indices. Other integer positions whose
    offsets ``p_j - p_i`` all lie in ``[-(Lq - 1), Lk - 1]`` (packed documents, positions restarting at 0 in each):
    the forms of ``arange`` positions of the same lengths (which cover exactly those offsets), read at each pair's
    own offset; a form that depends on the offset alone (its contract) gives the same numbers. Else ``None``."""
    ctx = call.ctx
    lq, lk = call.q.shape[2], call.k.shape[2]
    if ctx.contiguous:
        return ctx, _row_offsets(lq)
    q_pos, k_pos = ctx.q_pos, ctx.k_pos
    if q_pos.is_floating_point() or k_pos.is_floating_point() or torch.compiler.is_compiling():
        return None
    low = int((k_pos.min(dim=-1).values - q_pos.max(dim=-1).values).min())
    high = int((k_pos.max(dim=-1).values - q_pos.min(dim=-1).values).max())
    if low < -(lq - 1) or high > lk - 1:
        return None
    device = q_pos.device
    proxy = replace(
        ctx,
        q_pos=torch.arange(lq, device=device)[None],
        k_pos=torch.arange(lk, device=device)[None],
        contiguous=True,
        cache={},
    )
    return proxy, _position_offsets(q_pos, k_pos, lq)


def bias_score_mod(vals: Tensor, offset: OffsetIndex) -> ScoreMod:
    """``score + vals[h, t]`` for a bias given per offset, ``vals`` ``[H|1, Lq + Lk - 1]``."""
    per_head = vals.shape[0] > 1

    def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return score + vals[h if per_head else 0, offset(b, q_idx, kv_idx)]

    return score_mod


def _table_products(x: Tensor, table: Rows | Tensor) -> tuple[Tensor, Tensor | None]:
    """``x [B, H, L, d]`` times each row of the table: ``[B, H, L, R]``, and the offsets' row index (``None``: the
    table has one row per offset)."""
    rows, index = (table.table, table.index) if isinstance(table, Rows) else (table, None)
    return torch.einsum("bhld,rhd->bhlr", x, rows.to(x.dtype)), index


def form_score_mod(form: RelativeForm, offset: OffsetIndex, scale: float) -> ScoreMod | None:
    """The score_mod of an offset-table form without values or segments: ``scale · (Σ a_i · T[t] + Σ c_j · U[t])``,
    each term read from its per-query (per-key) table of products."""
    terms: list[tuple[Tensor, Tensor | None, bool]] = []  # (products, row index, is a key term)
    for a, table in form.query_terms:
        prod, index = _table_products(a, table)
        terms.append((prod * scale, index, False))
    for c, table in form.key_terms:
        prod, index = _table_products(c, table)
        terms.append((prod * scale, index, True))
    if not terms:
        return None

    def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        t = offset(b, q_idx, kv_idx)
        for prod, index, by_key in terms:
            row = t if index is None else index[t]
            score = score + prod[b if prod.shape[0] > 1 else 0, h, kv_idx if by_key else q_idx, row]
        return score

    return score_mod


def flex_form(enc: PositionalEncoding | None, call: _Call, scale: float) -> FlexForm | None:
    """The flex form of this call's encoding, or ``None`` (:func:`why_not` says why)."""
    q, k, ctx = call.q, call.k, call.ctx
    hooks = enc.hooks() if enc is not None else frozenset()
    if enc is None or not hooks & {"logits", "bias", "values", "probabilities"}:
        return FlexForm(q, k, None, "no encoding terms")
    own = enc.flex_score(q, k, ctx)
    if own is not None:
        q2, k2, mod = own
        return FlexForm(q2, k2, mod, "its own score_mod (flex_score)")
    if "values" in hooks or "probabilities" in hooks or enc.logits_read_scores:
        return None
    alone = ("bias" in hooks) != ("logits" in hooks)
    if not alone or ("logits" in hooks and not enc.offers_relative_form()):
        return None
    got = _offset_context(call)
    if got is None:
        return None
    fctx, offset = got
    if "bias" in hooks:
        vals = enc.bias_offsets(fctx)
        if vals is None:
            return None
        mod = bias_score_mod(vals.to(q.dtype), offset)
        return FlexForm(q, k, mod, "a score_mod from its bias per offset (bias_offsets)")
    form = enc.relative_form(q, k, fctx)
    if form is None or form.value_table is not None or form.segment is not None:
        return None
    mod = form_score_mod(form, offset, scale)
    return FlexForm(form.q, form.k, mod, "a score_mod from its offset tables (relative_form)")


def why_not(enc: PositionalEncoding | None, call: _Call | None = None) -> str:
    """Why an encoding has no flex form on this call, in words (the plan's reason where flex was wanted)."""
    if enc is None:
        return "no encoding"
    hooks = enc.hooks()
    if "values" in hooks:
        return "a values term (a^V) needs the probabilities, which a score_mod cannot give"
    if "probabilities" in hooks:
        return "it gives its own attention weights instead of softmax, which flex_attention computes"
    if enc.logits_read_scores:
        return "its logits read q·kᵀ itself (CoPE's gates), which a score_mod cannot"
    if "logits" in hooks and "bias" in hooks:
        return "logits and a bias together (no fast form combines them)"
    if "logits" in hooks and not enc.offers_relative_form():
        return "its logits have no offset-table form (relative_form) for a score_mod to read"
    return (
        "no flex form on this call: offsets beyond the call's lengths or float positions (the forms are offset "
        "tables), or a segment term (XLNet's segments)"
    )


# ---------------------------------------------------------------- the mask
def block_mask(call: _Call, cache: dict[Any, Any] | None = None) -> Any:
    """The call's mask as a BlockMask on the call's device (``None``: every key may be attended), kept in ``cache``
    by what it depends on: the causal pattern by its sizes; any other mask (padding, packed documents, a window or
    chunk) by the tensor it reads. Blocks a mask removes whole are skipped by the kernel."""
    from torch.nn.attention.flex_attention import create_block_mask

    q, k = call.q, call.k
    b, h, lq, lk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    allowed = call.allowed
    if allowed is None:
        return None
    causal_only = call.causal and not call.any_padding
    key: tuple[Any, ...] = (
        ("flex-mask", "causal", lq, lk, q.device) if causal_only else ("flex-mask", id(allowed), b, h, lq, lk)
    )
    got = cache.get(key) if cache is not None else None
    if got is not None:
        return got
    if causal_only:
        shift = lk - lq

        def mask_mod(bi: Tensor, hi: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return kv_idx <= q_idx + shift

        made = create_block_mask(mask_mod, None, None, lq, lk, device=q.device)
    else:
        m = allowed
        per_b, per_h, per_q = m.shape[0] > 1, m.shape[1] > 1, m.shape[2] > 1  # [B|1, H|1, Lq|1, Lk]

        def mask_mod(bi: Tensor, hi: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return m[bi if per_b else 0, hi if per_h else 0, q_idx if per_q else 0, kv_idx]

        made = create_block_mask(mask_mod, b if per_b else None, h if per_h else None, lq, lk, device=q.device)
    if cache is not None:
        cache[key] = made
        cache[("flex-mask-source", key)] = allowed  # keeps the id from being reused within the forward
    return made


# ---------------------------------------------------------------- the kernel
_compiled: dict[str, Any] = {}


def _flex_attention() -> Callable[..., Tensor]:
    """flex_attention itself, compiled once per process where it runs on CUDA (eager it is the unfused reference)."""
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention


def _runner(device: torch.device) -> Callable[..., Tensor]:
    fn = _flex_attention()
    if device.type != "cuda" or torch.compiler.is_compiling():
        return fn
    if "cuda" not in _compiled:
        _compiled["cuda"] = torch.compile(fn, dynamic=False)
    return _compiled["cuda"]


def flex(call: _Call, form: FlexForm, scale: float) -> Tensor:
    """``softmax(scale · q̃·k̃ + terms + mask) v`` through flex_attention: ``[B, H, Lq, Dh]``.

    On a CPU it runs forward only (flex_attention refuses a backward there): a call that records gradients for
    anything it reads gets a clear error rather than failing in the backward."""
    q, k, v = form.q, form.k, call.v
    if q.device.type == "cpu" and torch.is_grad_enabled() and not torch.compiler.is_compiling():
        if q.requires_grad or k.requires_grad or v.requires_grad:
            raise ConfigError(
                "path='flex' on a CPU runs forward only: flex_attention has no backward on CPU. Run it under "
                "torch.no_grad() (or inference_mode), on a CUDA device, or take path='auto'"
            )
    mask = block_mask(call, call.ctx.cache)
    run = _runner(q.device)
    if torch.compiler.is_compiling():
        if q.device.type == "cpu":
            # Inductor's CPU flex template reads a 4-D layout from each input; a head-split view of a projection's
            # 2-D output fails its lowering ("not enough values to unpack"): hand it 4-D buffers
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        return run(q, k, v, score_mod=form.score_mod, block_mask=mask, scale=scale)
    with warnings.catch_warnings():
        # eager flex on a CPU is its unfused reference (what the CPU tests compare): the warning says so each call
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        return run(q, k, v, score_mod=form.score_mod, block_mask=mask, scale=scale)
