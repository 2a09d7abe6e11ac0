r"""Attention with a bias that depends on the offset only, from its ``Lq + Lk - 1`` values: no ``[H, Lq, Lk]`` tensor.

T5's buckets, KERPLE, dynamic position bias, ALiBi and the seed articles' bucketed bias add, at positions made with
``arange``, a term that depends only on ``j - i``:

.. math::
    z_i = \sum_j \operatorname{softmax}_j\big(s\, q_i \cdot k_j + b_h[j - i + L_q - 1]\big)\, v_j

with ``b_h`` one value per offset (``[H|1, P]``, ``P = L_q + L_k - 1``,
:meth:`~posenc.base.PositionalEncoding.bias_offsets`). Laid out as a Toeplitz matrix the bias is ``H·Lq·Lk``
numbers, and its gradient another ``H·Lq·Lk`` that are then summed along each diagonal: at ``L = 2048`` and
8 heads 128 MB each, written and read once per layer and step, and mapped afresh (page faults) each time.

:func:`offset_bias_attention` never makes either. The rows of ``W = b.unfold(-1, Lk, 1)`` (``W[r, j] = b[r + j]``)
are the bias rows of the queries ``i = Lq - 1 - r``, in *reverse* query order, so a block of query rows taken in
reverse order has its bias block as a strided view of ``b`` (strides ``(1, 1)``), which the CPU flash kernel
reads as its additive mask. The forward is that flash kernel on blocks of query rows (a causal block sees only
keys up to its last row; causality is the bias ``-∞`` at offsets past the diagonal, itself an offset-only term).
The backward recomputes each block's probabilities, in the same reversed order, and adds the block's
``∂L/∂bias`` to ``∂L/∂b`` per offset: in reverse row order the offsets of a block are its *anti*-diagonals, which
a ``[b, Lk + b - 1]`` buffer with row stride ``Lk + b`` lines up in columns (a copy and a column sum; the buffer
stays in cache). Equal to the materialised formula up to float rounding (tests/test_offset_bias.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .errors import ConfigError
from .ops import attention_op, extra_grad

# query rows per block of the forward's flash calls (each recomputes nothing; the block only bounds the wasted
# upper triangle of a causal diagonal square: 256 rows waste ~6 % at L = 2048)
FORWARD_ROWS = 256
# bytes of one block of scores in the backward (about an L2 cache): sets its block height
BACKWARD_BYTES = 2 * 2**20


def _masked(vals: Tensor, lq: int, lk: int, causal: bool) -> Tensor:
    """``vals`` with the offsets a causal query may not see (``j - i > Lk - Lq``, index ``> Lk - 1``) at ``min``."""
    if not causal:
        return vals.contiguous()
    out = vals.clone()
    out[:, lk:] = torch.finfo(vals.dtype).min
    return out


def _forward(q: Tensor, k: Tensor, v: Tensor, vals: Tensor, scale: float, causal: bool) -> Tensor:
    """The forward: flash on blocks of query rows in reverse order, each block's bias a strided view of ``vals``."""
    b, h, lq, _ = q.shape
    lk = k.shape[2]
    rows = _masked(vals, lq, lk, causal).unfold(-1, lk, 1)  # [H|1, Lq, Lk]: row r is the bias of query Lq - 1 - r
    out = torch.empty_like(q)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    for r0 in range(0, lq, FORWARD_ROWS):
        r1 = min(lq, r0 + FORWARD_ROWS)
        ke = min(lk, r1 + lk - lq) if causal else lk
        mask = rows[None, :, lq - r1 : lq - r0, :ke]
        o, _ = flash(q[:, :, r0:r1].flip(2), k[:, :, :ke], v[:, :, :ke], 0.0, False, attn_mask=mask, scale=scale)
        out[:, :, r0:r1] = o.flip(2)
    return out


def _backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, vals: Tensor, out: Tensor, scale: float, causal: bool, dvals: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``dq, dk, dv`` and ``∂L/∂vals`` (empty unless ``dvals``), each block's probabilities recomputed."""
    b, h, lq, _ = q.shape
    lk = k.shape[2]
    vm = _masked(vals, lq, lk, causal)
    shared = vm.shape[0] == 1
    rows = vm.unfold(-1, lk, 1)
    acc = torch.promote_types(q.dtype, torch.float32)
    delta = (dout * out).sum(-1, dtype=acc).to(q.dtype)  # [B, H, Lq]: rowsum(dO ∘ O)
    dout = dout.contiguous()
    dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
    d_vals = extra_grad(vm, dvals)
    n = max(1, min(lq, BACKWARD_BYTES // max(lk * q.element_size(), 1)))
    blocks = [(r0, min(lq, r0 + n)) for r0 in range(0, lq, n)]
    bufs: dict[tuple[int, int], Tensor] = {}
    for bi in range(b):
        for hi in range(h):
            vh = 0 if shared else hi
            kh, kt, vt = k[bi, hi], k[bi, hi].t(), v[bi, hi].t()
            dkh, dvh = dk[bi, hi], dv[bi, hi]
            for r0, r1 in blocks:
                ke = min(lk, r1 + lk - lq) if causal else lk
                m = r1 - r0
                # this block's rows in reverse order: its bias is the view rows[lq - r1 : lq - r0]
                qr = q[bi, hi, r0:r1].flip(0)
                dor = dout[bi, hi, r0:r1].flip(0)
                s = torch.addmm(rows[vh, lq - r1 : lq - r0, :ke], qr, kt[:, :ke], alpha=scale)
                p = torch.softmax(s, dim=-1)  # its vectorised exp is fast where the bias makes scores underflow
                dvh[:ke].addmm_(p.t(), dor)
                ds = torch.mm(dor, vt[:, :ke])
                ds.sub_(delta[bi, hi, r0:r1].flip(0)[:, None]).mul_(p)  # dS = P ∘ (dP − Δ)
                if dvals:
                    # reversed row r, key j has offset index (Lq - r1) + r + j: anti-diagonals to columns
                    w = ke + m - 1
                    buf = bufs.get((m, ke))
                    if buf is None:  # zeroed once per shape: every copy writes the same places
                        buf = bufs[(m, ke)] = ds.new_zeros(m * w)
                    buf.as_strided((m, ke), (w + 1, 1)).copy_(ds)
                    d_vals[vh, lq - r1 : lq - r1 + w].add_(buf.view(m, w).sum(0))
                dq[bi, hi, r0:r1] = torch.mm(ds, kh[:ke]).flip(0).mul_(scale)
                dkh[:ke].addmm_(ds.t(), qr, alpha=scale)
    return dq, dk, dv, d_vals


# one custom op (and its backward another), so that torch.compile keeps the kernel
_op = attention_op("offset_bias_attention", _forward, _backward)


def check_inputs(q: Tensor, k: Tensor, v: Tensor, causal: bool, what: str, cpu: bool = True) -> None:
    """The checks shared by the block kernels: matching ``q, k, v``, enough keys for ``causal``, CPU tensors (unless
    ``cpu=False``: a kernel of PyTorch ops alone, stick-breaking's).

    Raises :class:`~posenc.errors.ConfigError` (a :class:`ValueError`) naming the shapes or lengths."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ConfigError(f"{what}: {name} must be a tensor [batch, heads, length, head_dim], got {shape}")
    b, h, lq, d = q.shape
    lk = k.shape[2]
    if k.shape != (b, h, lk, d) or v.shape != k.shape:
        raise ConfigError(
            f"{what}: q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} do not match; k and v must be "
            f"[{b}, {h}, Lk, {d}] (q's batch, heads and head_dim) with one length Lk"
        )
    if causal and lk < lq:
        raise ConfigError(f"{what}: causal needs at least as many keys as queries, got Lk={lk} < Lq={lq}")
    if cpu and q.device.type != "cpu":
        raise ConfigError(f"{what} runs the CPU flash kernel; got q on {q.device} (the portable plan takes SDPA there)")


def offset_bias_attention(q: Tensor, k: Tensor, v: Tensor, vals: Tensor, scale: float, causal: bool = False) -> Tensor:
    """``softmax(scale · q kᵀ + B) v`` with ``B[h, i, j] = vals[h, j - i + Lq - 1]``: ``[B, H, Lq, d]``.

    Args:
        q, k, v: ``[B, H, Lq|Lk, d]`` (CPU; float32 or float64, what the attention sends it).
        vals: ``[H|1, Lq + Lk - 1]``, the bias of every offset ``j - i`` from ``-(Lq - 1)`` to ``Lk - 1``
            (ascending); its gradient flows back.
        scale: the temperature of ``q kᵀ`` (the bias is added after it).
        causal: query ``i`` sees keys ``j <= i + Lk - Lq`` only (bottom-right aligned; needs ``Lk >= Lq``).
    """
    check_inputs(q, k, v, causal, "offset_bias_attention")
    b, h, lq, d = q.shape
    lk = k.shape[2]
    if not isinstance(vals, Tensor) or vals.dim() != 2 or vals.shape[0] not in (1, h) or vals.shape[1] != lq + lk - 1:
        shape = tuple(vals.shape) if isinstance(vals, Tensor) else type(vals).__name__
        raise ConfigError(
            f"offset_bias_attention: vals must be [{h}|1, Lq + Lk - 1 = {lq + lk - 1}] (a bias per head, or one for "
            f"all, per offset) for Lq={lq} queries and Lk={lk} keys, got {shape}"
        )
    return _op(q, k, v, vals.to(q.dtype), float(scale), bool(causal))


__all__ = ["check_inputs", "offset_bias_attention", "FORWARD_ROWS", "BACKWARD_BYTES"]
