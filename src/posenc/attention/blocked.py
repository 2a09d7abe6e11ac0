"""The kernels of an encoding's offset-table form (:meth:`~posenc.base.PositionalEncoding.relative_form`):
``blocked`` (:func:`posenc.native.form_attention`, the native fused pass, where it applies, else
:func:`posenc.fused.relative_attention`, one block of query rows at a time, no ``[B, H, Lq, Lk]`` tensor) and
``decode`` (:func:`posenc.native.decode_attention`: one query, one pass over the keys, the values and the offset
tables), with :func:`decodable`, what the decode kernel computes.

Imports :mod:`posenc.native` and :mod:`posenc.fused` (kernels) and this package's call and plan records.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from .. import native
from ..fused import RelativeForm, Rows, relative_attention
from .call import _Call, beyond_causal, repeat_kv
from .kernels import Plan


def blocked(call: _Call, plan: Plan, form: RelativeForm | None, add: Tensor | None, scale: float) -> Tensor:
    """The ``blocked`` kernel: the form's terms (or, without a form, ``add``: the encoding's terms after the
    temperature, for dropout on CPU), row block by row block: the native fused pass
    (:func:`posenc.native.form_attention`) where it applies, else :func:`posenc.fused.relative_attention`."""
    form = form if form is not None else RelativeForm(q=call.q, k=call.k)
    allowed = beyond_causal(call)
    kw = dict(bias=add, dropout=plan.dropout, causal=call.causal)
    fast = native.form_attention(form, call.v, scale, allowed, **kw)
    return fast if fast is not None else relative_attention(form, call.v, scale, allowed, **kw)


def decode(call: _Call, plan: Plan, form: RelativeForm, scale: float) -> Tensor:
    """One query: :func:`posenc.native.decode_attention` with the form's terms (:func:`blocked` if it declines).

    Grouped-query keys (``plan.grouped``: a transformers model's cache, fewer key/value heads than query heads) stay
    as they are: the kernel reads key head ``h // group`` for query head ``h``; only where it declines are they
    repeated, for :func:`blocked`."""
    query_term = key_table = value_table = add = None
    if form.query_terms:
        a, table = form.query_terms[0]
        query_term = (a[:, :, 0], *_rows(table))  # offset t(0, j) = j: row j of the table, or index[j]
    if form.key_terms:
        key_table = _rows(form.key_terms[0][1])
    if form.value_table is not None:  # Shaw's and NEZHA's a^V: the probabilities summed per table row
        value_table = _rows(form.value_table)
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
        form.q[:, :, 0],
        form.k,
        call.v,
        scale,
        query_term=query_term,
        key_table=key_table,
        value_table=value_table,
        add=add,
    )
    if out is None:
        if plan.grouped:  # the blocked kernel takes one key head per query head
            call = repeat_kv(call)
            keys = [(call.k if c is form.k else c, u) for c, u in form.key_terms]
            form = replace(form, k=call.k, key_terms=keys)
        return blocked(call, plan, form, None, scale)
    return out[:, :, None]


def _rows(table: Tensor | Rows) -> tuple[Tensor, Tensor | None]:
    """A table of the form as the decode kernel takes it: ``(table, index)`` (``index`` ``None``: row ``j``)."""
    return (table.table, table.index) if isinstance(table, Rows) else (table, None)


def decodable(form: RelativeForm) -> bool:
    """Whether :func:`posenc.native.decode_attention` computes this form: at most one query term, at most one key term
    whose operand is the keys, and a value table (Shaw's and NEZHA's a^V) or none."""
    return len(form.query_terms) <= 1 and len(form.key_terms) <= 1 and all(c is form.k for c, _ in form.key_terms)
