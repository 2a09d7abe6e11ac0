"""The kernels of :mod:`posenc.native` for a decoding step: one query's key term against a looked-up table
(:func:`rows_dot`) and one query per sequence and head against its keys with an online softmax
(:func:`decode_attention`). Imports torch and :mod:`posenc.native.loader` / :mod:`posenc.native.threads`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import loader
from .loader import _CTYPE
from .threads import _run, _split

# the largest head dimension decode_attention takes (its per-row accumulator lives on the C stack)
DECODE_MAX_HEAD_DIM = 256


def rows_dot(k: Tensor, table: Tensor, index: Tensor) -> Tensor | None:
    r"""One query's key term in one pass: ``out[b, h, j] = Σ_e k[b, h, j, e] · table[index[j], (h,) e]``.

    .. math::
        o_{bhj} = k_{bhj} \cdot T_{\mathrm{index}_j}

    ``k [B, H, Lk, d]`` (any strides, last dimension contiguous: a KV cache's view), ``table [R, d]`` (shared by the
    heads) or ``[R, H, d]``, ``index [Lk]`` (long). Reads ``k`` and the rows once and writes ``[B, H, Lk]``: the
    PyTorch form gathers the rows (``[Lk, H, d]``), multiplies (another) and sums. Used where a decoding step takes
    the hooks rather than :func:`decode_attention` (DeBERTa with p2p, which has no offset-table form). Returns
    ``None`` where the kernel does not apply (no compiled kernel, not CPU, not float32/float64, a gradient to record,
    ``torch.compile``): the caller keeps its PyTorch form.
    """
    if not loader.enabled or torch.compiler.is_compiling() or loader._lib() is None:
        return None
    if k.device.type != "cpu" or k.dtype not in _CTYPE or table.dtype != k.dtype or k.dim() != 4:
        return None
    if torch.is_grad_enabled() and (k.requires_grad or table.requires_grad):
        return None
    b, h, lk, d = k.shape
    if table.dim() not in (2, 3) or table.shape[-1] != d or (table.dim() == 3 and table.shape[1] != h):
        return None
    if index.shape != (lk,) or index.dtype != torch.long or index.device.type != "cpu":
        return None
    if k.stride(-1) != 1 and d > 1:
        return None
    if table.stride(-1) != 1 and d > 1:
        table = table.contiguous()
    index = index.contiguous()
    if lk and (int(index.min()) < 0 or int(index.max()) >= table.shape[0]):
        raise IndexError(f"rows_dot: index out of range for a table of {table.shape[0]} rows")
    lib = loader._lib()
    assert lib is not None
    out = torch.empty(b, h, lk, dtype=k.dtype)
    th = table.stride(1) if table.dim() == 3 else 0
    fn = getattr(lib, f"posenc_rows_dot_{_CTYPE[k.dtype]}")
    head = (k.data_ptr(), k.stride(0), k.stride(1), k.stride(2), table.data_ptr(), table.stride(0), th)
    tail = (index.data_ptr(), out.data_ptr(), h, lk, d)
    _run([(fn, *head, *tail, n0, n1) for n0, n1 in _split(b * h, b * h * lk * d)])
    return out


def _rows_of(table: Tensor, index: Tensor | None, h: int, d: int, lk: int) -> tuple | None:
    """``(table, row stride, head stride, index)`` of a ``[R, H|1, d]`` table for the decode kernel, or ``None``."""
    if table.dim() != 3 or table.shape[1] not in (1, h) or table.shape[2] != d or table.stride(2) != 1:
        return None
    if index is not None:
        if index.shape != (lk,) or index.dtype != torch.long:
            return None
        index = index.contiguous()
        if lk and (int(index.min()) < 0 or int(index.max()) >= table.shape[0]):
            raise IndexError(f"decode_attention: a row index is out of range for a table of {table.shape[0]} rows")
    elif table.shape[0] < lk:
        return None
    th = table.stride(1) if table.shape[1] > 1 else 0
    return table, table.stride(0), th, index


def decode_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    *,
    query_term: tuple[Tensor, Tensor, Tensor | None] | None = None,
    key_table: tuple[Tensor, Tensor | None] | None = None,
    value_table: tuple[Tensor, Tensor | None] | None = None,
    add: Tensor | None = None,
) -> Tensor | None:
    r"""One query per sequence and head against its keys, in one pass with an online softmax: ``[B, H, d]``.

    .. math::
        s_j = \text{scale}\,(q \cdot k_j + a \cdot T_{t_j} + k_j \cdot U_{u_j}) + \text{add}_j, \qquad
        o = \sum_j \operatorname{softmax}(s)_j\, (v_j + W_{w_j})

    A decoding step of a relative encoding (:class:`~posenc.fused.RelativeForm` with one query): its query and key
    terms are read beside the keys, so the step reads the keys, the values and the looked-up rows once, where the
    SDPA kernel plus the terms as a mask read the keys two or three times. A table looked up by index with fewer
    rows than keys (Shaw's and NEZHA's ``2k + 1``, DeBERTa's buckets) costs less than a term per key: the query term
    ``a · T_r`` is taken once per row and looked up per key, and the value table (Shaw's and NEZHA's ``a^V``) is
    ``Σ_r (Σ_{w_j = r} p_j) W_r``: the probabilities summed per row in the pass, one ``[R, d]`` product after it.

    Args:
        q: ``[B, H, d]``; k, v: ``[B, H, Lk, d]`` (any strides, last dimension contiguous: a KV cache's views), or
            grouped-query keys ``[B, Hkv, Lk, d]`` with ``H`` a multiple of ``Hkv``: query head ``h`` reads key and
            value head ``h // (H / Hkv)`` (transformers' ``repeat_kv`` order), the cache never repeated.
        query_term: ``(a [B, H, d], T [R, H|1, d], t [Lk] long or None)``: adds ``a · T[t_j]`` (``T[j]`` without t).
        key_table: ``(U [R, H|1, d], u [Lk] long or None)``: adds ``k_j · U[u_j]``.
        value_table: ``(W [R, H|1, d], w [Lk] long or None)``: adds ``Σ_j p_j W[w_j]`` to the output (``W[j]``
            without w).
        add: ``[B|1, H|1, Lk]`` added after the scale (a mask: ``-inf`` drops the key).
    Returns ``None`` where the kernel does not apply (no compiled kernel, not CPU, not float32/float64, mixed
    dtypes, a gradient to record, ``d > 256``, ``torch.compile``).
    """
    if not loader.enabled or torch.compiler.is_compiling() or loader._lib() is None:
        return None
    if q.device.type != "cpu" or q.dtype not in _CTYPE or q.dim() != 3 or k.dim() != 4 or v.shape != k.shape:
        return None
    b, hk, lk, d = k.shape
    h = q.shape[1]
    if q.shape != (b, h, d) or d > DECODE_MAX_HEAD_DIM or hk == 0 or h % hk:
        return None
    ts = [q, k, v, add] + [t[i] for t, i in ((query_term, 0), (query_term, 1), (key_table, 0), (value_table, 0)) if t]
    if any(t is not None and (t.dtype != q.dtype or t.device != q.device) for t in ts):
        return None
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts):
        return None
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        return None
    none = (None, 0, 0)
    qa, tt, ti, tp = none, none, None, 0
    if query_term is not None:
        a, table, index = query_term
        if a.shape != (b, h, d) or a.stride(-1) != 1:
            return None
        got = _rows_of(table, index, h, d, lk)
        if got is None:
            return None
        qa = (a.data_ptr(), a.stride(0), a.stride(1))
        tt, ti = (got[0].data_ptr(), got[1], got[2]), got[3]
        tp = table.shape[0] if ti is not None and table.shape[0] < lk else 0  # a . T[r] once per row
    uu, ui = none, None
    if key_table is not None:
        got = _rows_of(key_table[0], key_table[1], h, d, lk)
        if got is None:
            return None
        uu, ui = (got[0].data_ptr(), got[1], got[2]), got[3]
    ww, wi, wn = none, None, 0
    if value_table is not None:
        got = _rows_of(value_table[0], value_table[1], h, d, lk)
        if got is None:
            return None
        ww, wi = (got[0].data_ptr(), got[1], got[2]), got[3]
        wn = value_table[0].shape[0] if wi is not None else 0  # the probabilities summed per row
    dd = none
    if add is not None:
        if add.dim() != 3 or add.shape[0] not in (1, b) or add.shape[1] not in (1, h) or add.shape[2] != lk:
            return None
        if add.stride(-1) != 1:
            add = add.contiguous()
        dd = (add.data_ptr(), add.stride(0) if add.shape[0] > 1 else 0, add.stride(1) if add.shape[1] > 1 else 0)
    lib = loader._lib()
    assert lib is not None
    out = torch.empty(b, h, d, dtype=q.dtype)
    scratch = torch.empty(b * h * (tp + wn), dtype=q.dtype) if tp + wn else None
    fn = getattr(lib, f"posenc_decode_{_CTYPE[q.dtype]}")
    head = (q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), *k.stride()[:3], v.data_ptr(), *v.stride()[:3])
    terms = (*qa, *tt, _ptr(ti), tp, *uu, _ptr(ui), *ww, _ptr(wi), wn, _ptr(scratch))
    tail = (*dd, out.data_ptr(), float(scale), h, lk, d, h // hk)
    _run([(fn, *head, *terms, *tail, n0, n1) for n0, n1 in _split(b * h, b * h * lk * d)])
    return out


def _ptr(t: Tensor | None) -> int | None:
    """The address of ``t`` for the C kernel, ``None`` (NULL) for no tensor."""
    return t.data_ptr() if t is not None else None
