r"""Attention with offset tables in one fused pass (:func:`offset_table_attention`), forward and backward, in C.

The offset-table family of relative encodings -- BERT's ``relative_key`` / ``relative_key_query``, Shaw and NEZHA
(keys and values), DeBERTa's c2p + p2c, TENER, Transformer-XL -- adds to ``q_i · k_j`` terms read from tables
indexed by the offset ``t = j - i + L_q - 1`` (:class:`posenc.fused.RelativeForm`):

.. math::
    s_{ij} = \text{scale}\,\big(q_i \cdot k_j + a_i \cdot T_t + c_j \cdot U_t\big) + \text{mask}_{ij}, \qquad
    z_i = \sum_j \operatorname{softmax}_j(s_{ij})\,\big(v_j + V_t\big)

(``a = q`` and ``T = R_k`` for a query term, ``c = k`` and ``U = R_q`` for BERT's key-query term or DeBERTa's p2c,
``V`` Shaw's ``a^V``; each table ``[P, H|1, d]`` over the ``P = L_q + L_k - 1`` offsets). The kernel takes four
query rows of one sequence and head at a time against all the keys they may see: their logits (a ``[4, L_k]`` row
block, never ``[L_q, L_k]``), the softmax, and ``P v`` plus ``P V``. A table term is computed on the band of
``L_k + 3`` offsets the four rows use (one product with the transposed table, read back skewed), a key term as four
dot products per key; a table whose first (last) offsets all hold one row -- a clip, DeBERTa's last bucket -- adds,
for the keys whose offsets all lie in that run, one number per query (or key) instead. Only the logsumexp of each
row is kept; the backward recomputes each row block's probabilities from it (flash-attention style) and forms
``dq, dk, dv``, the operands' and the tables' gradients:

.. math::
    dP = dO\,(v + V)^\top, \quad dS = P \circ (dP - \Delta), \quad \Delta_i = dO_i \cdot z_i, \\
    dq = s\,dS\,k, \quad dk = s\,dS^\top q, \quad da_i = s \textstyle\sum_j dS_{ij} T_t, \quad
    dT_t \mathrel{+}= s\,dS_{ij}\,a_i, \quad dV_t \mathrel{+}= P_{ij}\,dO_i, \ \ldots

A masked key (a ``False`` in ``allowed``, or past the causal diagonal) has probability exactly 0 and no gradient; a
query that sees no key at all gets a zero output and no gradient (posenc's attention then writes that row as every
path does, :func:`posenc.attention.core.finish_rows`). Non-finite keys hidden from a query are zeroed by the
attention before any kernel runs (:func:`~posenc.attention.core.quarantine_nonfinite`), this one included.

The products are register-blocked loops in GNU C's vector extensions (8 floats or 4 doubles a vector), compiled as
:mod:`posenc.native` compiles every kernel (portable flags, no ``-march=native``); the sums run in one fixed order,
so every build gives the same bits. Where the kernel does not apply -- no compiled kernels, not CPU, not
float32/float64, a head dimension that is not a multiple of two vectors (16 floats or 8 doubles; 32 / 16 in an
AVX-512 build), a bias, dropout, XLNet's segment term, more than one query or key term, a key term where
:data:`KEY_TERMS` is off, or :data:`ENABLED` off -- :func:`offset_table_attention` returns ``None`` and the
attention's ``blocked`` kernel (:func:`posenc.attention.blocked.blocked`, which asks :func:`form_attention` first)
keeps :func:`posenc.fused.relative_attention`'s PyTorch row blocks (the reference this kernel is tested against).
While ``torch.compile`` traces, the kernel is the custom op ``posenc::offset_table_attention`` (and its
``_backward``), which the compiled graph keeps whole. Imports torch and :mod:`posenc.native.loader` /
:mod:`posenc.native.threads`.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from . import loader
from .loader import _CTYPE
from .threads import _run, _split

# True: the attention's blocked kernel takes this one where it applies; False keeps posenc.fused.relative_attention's
# PyTorch blocks (the benchmark, benchmarks/bench_offset_table.py, compares the two in one run)
ENABLED = True
# a form with a key term (BERT's relative_key_query, DeBERTa's p2c) takes the kernel only where this is True too
KEY_TERMS = True
# rows of zeros before and after each table: the row blocks read up to 3 offsets beyond the ends (a block's last rows
# past Lq), and the vector loops whole vectors
PAD = 4
# a table's leading or trailing run of one row at least this long is added per query (or key), not per pair
MIN_RUN = 8
# query rows of the kernel's row block (OT_ROWS in the C source: its logits are the only [rows, Lk] buffer)
ROWS = 32


_LANES: dict[torch.dtype, int] = {}


def _lanes(dtype: torch.dtype) -> int:
    """The elements of one of the kernel's vectors in the loaded build (32 bytes, or 64 with AVX-512)."""
    if dtype not in _LANES:
        lib = loader._lib()
        assert lib is not None
        _LANES[dtype] = int(getattr(lib, f"posenc_offset_lanes_{_CTYPE[dtype]}")())
    return _LANES[dtype]


@torch.compiler.assume_constant_result
def _ready(dtype: torch.dtype) -> int:
    """The lanes of the kernel's vectors for ``dtype``, or 0 where the kernel is off (switched off, no build, another
    dtype). A constant while ``torch.compile`` traces (the loader's ctypes calls are not traced)."""
    if not (ENABLED and loader.enabled) or dtype not in _CTYPE or loader._lib() is None:
        return 0
    return _lanes(dtype)


def _round(n: int, m: int) -> int:
    return -(-n // m) * m


def _runs(index: Tensor | None, p: int) -> tuple[int, int]:
    """``(lead, trail)``: offsets ``[0, lead)`` use the row of offset 0 and ``[trail, P)`` that of offset ``P - 1``
    (a run shorter than :data:`MIN_RUN` counts as none: ``0`` / ``P``). Without an index (an expanded table), no
    runs. Called inside the custom ops, on the real index (also in a compiled graph, where the lengths are data)."""
    if index is None or p == 0:
        return 0, p
    first, last = index[0], index[-1]
    other = index != first
    lead = int(other.to(torch.uint8).argmax()) if bool(other.any()) else p
    other = index.flip(0) != last
    tail = int(other.to(torch.uint8).argmax()) if bool(other.any()) else p
    lead = lead if lead >= MIN_RUN else 0
    trail = p - tail if tail >= MIN_RUN else p
    return lead, max(trail, lead)


def _padded(table: Tensor, index: Tensor | None) -> Tensor:
    """The table at the ``P`` offsets, head first and padded with :data:`PAD` zero rows each side: ``[H|1, P + 8, d]``
    (recorded by autograd: the expanded table's gradient reaches the given rows through ``index_select``)."""
    if index is not None:
        table = table.index_select(0, index)
    return F.pad(table.permute(1, 0, 2), (0, 0, PAD, PAD)).contiguous()


# ------------------------------------------------------------------------------------------------ the C calls
def _geometry(q: Tensor, k: Tensor) -> tuple[int, int, int, int, int, int]:
    b, h, lq, d = q.shape
    lk = k.shape[2]
    w = _lanes(q.dtype)
    ld = _round(lk + 8, 2 * w) + 2 * w  # a row block's logits (and the keys transposed)
    ldt = _round(lq + lk - 1 + 2 * PAD, 2 * w) + 2 * w  # a table transposed
    return b, h, lq, lk, ld, ldt


def _ints(q, k, tabs, runs, mask, causal, n0, n1, ld, ldt) -> list[int]:
    b, h, lq, d = q.shape
    lk = k.shape[2]
    heads = [0 if t is None or t.shape[0] == 1 else t.stride(0) for t in tabs]
    ms = (0, 0, 0)
    if mask is not None:
        ms = tuple(mask.stride(i) if mask.shape[i] > 1 else 0 for i in range(3))  # type: ignore[assignment]
    return [n0, n1, h, lq, lk, d, int(causal), *heads, *runs, *ms, ld, ldt]


def _ptr(t: Tensor | None) -> int | None:
    return t.data_ptr() if t is not None else None


def _call(name: str, dtype: torch.dtype, jobs: list[tuple[list, list[int]]], scale: float) -> None:
    lib = loader._lib()
    assert lib is not None
    fn = getattr(lib, f"posenc_offset_{name}_{_CTYPE[dtype]}")
    calls = []
    keep = []
    for ptrs, ints in jobs:
        pa = (ctypes.c_void_p * len(ptrs))(*ptrs)
        ia = (ctypes.c_int64 * len(ints))(*ints)
        keep.append((pa, ia))
        calls.append((fn, pa, ia, ctypes.c_double(scale)))
    _run(calls)


def _mask(allowed: Tensor | None) -> Tensor | None:
    """``allowed [B|1, H|1, Lq|1, Lk]`` as bytes with a contiguous last dimension, or ``None``."""
    if allowed is None:
        return None
    m = allowed if allowed.dtype == torch.bool else allowed.to(torch.bool)
    return m if m.stride(-1) == 1 else m.contiguous()


def _forward(q, k, v, a, T, c, U, V, allowed, runs, scale, causal) -> tuple[Tensor, Tensor]:
    b, h, lq, lk, ld, ldt = _geometry(q, k)
    d = q.shape[-1]
    out = torch.empty_like(q)
    lse = torch.empty(b, h, lq, dtype=q.dtype)
    mask = _mask(allowed)
    parts = _split(b * h, b * h * lq * lk * d)
    ws = torch.zeros(len(parts), 2 * d * ld + 2 * d * ldt + (ROWS + 16) * ld + ROWS * d, dtype=q.dtype)
    jobs = []
    for i, (n0, n1) in enumerate(parts):
        ptrs = [_ptr(x) for x in (q, k, v, a, T, c, U, V, mask, out, lse)] + [ws[i].data_ptr()]
        jobs.append((ptrs, _ints(q, k, (T, U, V), runs, mask, causal, n0, n1, ld, ldt)))
    _call("forward", q.dtype, jobs, scale)
    return out, lse


def _backward(dout, out, lse, q, k, v, a, T, c, U, V, allowed, runs, scale, causal) -> tuple:
    b, h, lq, lk, ld, ldt = _geometry(q, k)
    d = q.shape[-1]
    dout = dout.contiguous()
    delta = (dout * out).sum(-1)  # rowsum(dO ∘ O), the softmax backward's Δ
    mask = _mask(allowed)
    parts = _split(b * h, b * h * lq * lk * d)
    dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
    da = torch.empty_like(a) if a is not None else None
    dc = torch.zeros_like(c) if c is not None else None
    # each part its own table gradients (the parts run at once), summed after
    dtabs = [None if t is None else torch.zeros(len(parts), *t.shape, dtype=t.dtype) for t in (T, U, V)]
    ws = torch.zeros(len(parts), 3 * d * ld + 3 * d * ldt + (2 * ROWS + 16) * ld + 2 * ROWS * d, dtype=q.dtype)
    jobs = []
    for i, (n0, n1) in enumerate(parts):
        ptrs = [_ptr(x) for x in (q, k, v, a, T, c, U, V, mask, dout, lse, delta, dq, dk, dv, da)]
        ptrs += [_ptr(dtabs[0][i] if dtabs[0] is not None else None), _ptr(dc)]
        ptrs += [_ptr(g[i] if g is not None else None) for g in dtabs[1:]] + [ws[i].data_ptr()]
        jobs.append((ptrs, _ints(q, k, (T, U, V), runs, mask, causal, n0, n1, ld, ldt)))
    _call("backward", q.dtype, jobs, scale)
    dT, dU, dV = (None if g is None else g.sum(0) if g.shape[0] > 1 else g[0] for g in dtabs)
    return dq, dk, dv, da, dT, dc, dU, dV


# ------------------------------------------------------------------------------------------------ the custom ops
_SCHEMA = (
    "Tensor q, Tensor k, Tensor v, Tensor? a, Tensor? T, Tensor? c, Tensor? U, Tensor? V, Tensor? allowed, "
    "Tensor? ti, Tensor? ui, Tensor? vi, float scale, bool causal"
)


def _all_runs(q: Tensor, k: Tensor, ti: Tensor | None, ui: Tensor | None, vi: Tensor | None) -> list[int]:
    """The runs of the three tables (:func:`_runs`) from their indices (``None``: an expanded table, or no table),
    ``[lead, trail] * 3``: found here, inside the op, so that a compiled graph (where the index is data) keeps them."""
    p = q.shape[2] + k.shape[2] - 1
    return [n for index in (ti, ui, vi) for n in _runs(index, p)]


def _op_forward(q, k, v, a, T, c, U, V, allowed, ti, ui, vi, scale, causal) -> tuple[Tensor, Tensor]:
    return _forward(q, k, v, a, T, c, U, V, allowed, _all_runs(q, k, ti, ui, vi), scale, causal)


def _op_backward(dout, out, lse, q, k, v, a, T, c, U, V, allowed, ti, ui, vi, scale, causal) -> list[Tensor]:
    runs = _all_runs(q, k, ti, ui, vi)
    grads = _backward(dout, out, lse, q, k, v, a, T, c, U, V, allowed, runs, scale, causal)
    return [g if g is not None else q.new_empty(0) for g in grads]


_op = torch.library.custom_op(
    "posenc::offset_table_attention", _op_forward, mutates_args=(), schema=f"({_SCHEMA}) -> (Tensor, Tensor)"
)
_backward_op = torch.library.custom_op(
    "posenc::offset_table_attention_backward",
    _op_backward,
    mutates_args=(),
    schema=f"(Tensor dout, Tensor out, Tensor lse, {_SCHEMA}) -> Tensor[]",
)


@_op.register_fake
def _(q, k, v, a, T, c, U, V, allowed, ti, ui, vi, scale, causal):
    return torch.empty_like(q), q.new_empty(q.shape[:3])


@_backward_op.register_fake
def _(dout, out, lse, q, k, v, a, T, c, U, V, allowed, ti, ui, vi, scale, causal):
    like = (q, k, v, a, T, c, U, V)
    return [torch.empty_like(t) if t is not None else q.new_empty(0) for t in like]


def _setup(ctx, inputs, output) -> None:
    q, k, v, a, T, c, U, V, allowed, ti, ui, vi, scale, causal = inputs
    ctx.numbers = (scale, causal)
    ctx.present = tuple(t is not None for t in (a, T, c, U, V))
    ctx.save_for_backward(output[0], output[1], q, k, v, a, T, c, U, V, allowed, ti, ui, vi)


def _grad(ctx, dout: Tensor, dlse: Tensor | None):
    out, lse, q, k, v, a, T, c, U, V, allowed, ti, ui, vi = ctx.saved_tensors
    scale, causal = ctx.numbers
    grads = _backward_op(dout, out, lse, q, k, v, a, T, c, U, V, allowed, ti, ui, vi, scale, causal)
    dq, dk, dv, *rest = grads
    da, dT, dc, dU, dV = (g if here else None for g, here in zip(rest, ctx.present))
    return dq, dk, dv, da, dT, dc, dU, dV, None, None, None, None, None, None


_op.register_autograd(_grad, setup_context=_setup)


# ------------------------------------------------------------------------------------------------ the entry
def offset_table_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    *,
    query_term: tuple[Tensor, Tensor, Tensor | None] | None = None,
    key_term: tuple[Tensor, Tensor, Tensor | None] | None = None,
    value_table: tuple[Tensor, Tensor | None] | None = None,
    allowed: Tensor | None = None,
    causal: bool = False,
) -> Tensor | None:
    r"""``softmax(scale · (q kᵀ + a · T_t + c · U_t) + mask) (v + V_t)`` in one fused pass: ``[B, H, Lq, d]``.

    .. math::
        z_i = \sum_j \operatorname{softmax}_j\!\big(\text{scale}\,(q_i \cdot k_j + a_i \cdot T_{t} + c_j \cdot U_{t})
        + m_{ij}\big)\,(v_j + V_{t}), \qquad t = j - i + L_q - 1

    Args:
        q, k, v: ``[B, H, Lq|Lk, d]``.
        query_term: ``(a [B, H, Lq, d], T, index)``: ``T`` ``[P, H|1, d]`` per offset (``index`` ``None``) or
            ``[R, H|1, d]`` rows looked up by ``index [P]`` (long).
        key_term: ``(c [B, H, Lk, d], U, index)``, likewise.
        value_table: ``(V, index)``, likewise: Shaw's ``a^V``.
        allowed: a boolean ``[B|1, H|1, Lq|1, Lk]`` mask (``True``: may attend), or ``None``.
        causal: query ``i`` sees keys ``j <= i + Lk - Lq`` only (needs ``Lk >= Lq``).

    Gradients flow to every tensor but ``allowed`` and the indices. Returns ``None`` where the kernel does not
    apply (see the module's notes): the caller keeps its PyTorch path.
    """
    if q.dim() != 4 or q.device.type != "cpu":
        return None
    lanes = _ready(q.dtype)
    b, h, lq, d = q.shape
    lk = k.shape[2]
    if not lanes or d == 0 or d % (2 * lanes) or lq == 0 or lk == 0 or (causal and lk < lq):
        return None
    if k.shape != (b, h, lk, d) or v.shape != k.shape:
        return None
    p = lq + lk - 1
    tensors: list[Tensor | None] = [None] * 5  # a, T, c, U, V
    indices: list[Tensor | None] = [None] * 3  # the tables' indices: the op finds their runs (_all_runs)
    if key_term is not None and not KEY_TERMS:
        return None
    for slot, term, length in ((0, query_term, lq), (1, key_term, lk)):
        if term is None:
            continue
        x, table, index = term
        if x.shape != (b, h, length, d) or not _table_fits(table, index, p, h, d):
            return None
        tensors[2 * slot] = x
        tensors[2 * slot + 1] = table
        indices[slot] = index
    if value_table is not None:
        table, index = value_table
        if not _table_fits(table, index, p, h, d):
            return None
        indices[2] = value_table[1]
    every = [q, k, v, *(t for t in tensors if t is not None)] + ([value_table[0]] if value_table else [])
    if any(t.dtype != q.dtype or t.device != q.device for t in every):
        return None
    if allowed is not None and (allowed.dim() != 4 or allowed.shape[-1] != lk or allowed.shape[2] not in (1, lq)):
        return None
    if allowed is not None and (allowed.shape[0] not in (1, b) or allowed.shape[1] not in (1, h)):
        return None
    # [B|1, H|1, Lq|1, Lk] as it is: the kernel steps a dimension of size 1 by 0 (no [B, H, Lq, Lk] copy)
    mask = allowed.to(torch.bool).contiguous() if allowed is not None else None
    a, c = tensors[0], tensors[2]
    T = _padded(query_term[1], query_term[2]) if query_term is not None else None
    U = _padded(key_term[1], key_term[2]) if key_term is not None else None
    V = _padded(*value_table) if value_table is not None else None
    cont = [t.contiguous() if t is not None else None for t in (q, k, v, a, c)]
    ti, ui, vi = (i.contiguous() if i is not None else None for i in indices)
    out, _ = _op(cont[0], cont[1], cont[2], cont[3], T, cont[4], U, V, mask, ti, ui, vi, float(scale), bool(causal))
    return out


def form_attention(
    form: Any,
    v: Tensor,
    scale: float,
    allowed: Tensor | None = None,
    *,
    bias: Tensor | None = None,
    dropout: float = 0.0,
    causal: bool = False,
) -> Tensor | None:
    """:func:`offset_table_attention` of a :class:`posenc.fused.RelativeForm` (read by its fields: this package imports
    nothing of posenc's kernels), the arguments of :func:`posenc.fused.relative_attention`: at most one query term and
    one key term, a value table or none, no bias, no dropout, no segment term; ``None`` where it does not apply (the
    caller then takes ``relative_attention``, its PyTorch row blocks)."""
    if bias is not None or dropout or form.segment is not None:
        return None
    if len(form.query_terms) > 1 or len(form.key_terms) > 1:
        return None

    def split(table: Any) -> tuple[Tensor, Tensor | None]:  # a Rows (table, index) or a table per offset
        return (table[0], table[1]) if isinstance(table, tuple) else (table, None)

    qt = [(a, *split(t)) for a, t in form.query_terms]
    kt = [(c, *split(u)) for c, u in form.key_terms]
    vt = split(form.value_table) if form.value_table is not None else None
    return offset_table_attention(
        form.q,
        form.k,
        v,
        scale,
        query_term=qt[0] if qt else None,
        key_term=kt[0] if kt else None,
        value_table=vt,
        allowed=allowed,
        causal=causal,
    )


def _table_fits(table: Tensor, index: Tensor | None, p: int, h: int, d: int) -> bool:
    if table.dim() != 3 or table.shape[1] not in (1, h) or table.shape[2] != d:
        return False
    if index is None:
        return table.shape[0] == p
    return index.shape == (p,) and index.dtype == torch.long and index.device == table.device


__all__ = ["form_attention", "offset_table_attention", "ENABLED", "KEY_TERMS", "MIN_RUN"]
