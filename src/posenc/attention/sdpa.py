"""The SDPA family of kernels: ``sdpa`` (torch's :func:`~torch.nn.functional.scaled_dot_product_attention`, the
encoding's terms as its additive mask; on grouped keys without repeating them) and ``biased-sdpa`` (the CPU flash
forward with a learned bias, and a blocked backward that gives the bias its gradient: :func:`biased_sdpa`, the custom
ops ``posenc::biased_sdpa`` and ``posenc::biased_sdpa_backward``, which ``torch.compile`` keeps).

Imports :mod:`posenc.ops` (the custom-op registration) and this package's call and plan records.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..ops import attention_op, extra_grad
from .call import _Call
from .checks import check_groups
from .kernels import Plan

# bytes of one block of scores in the backward of :func:`biased_sdpa` (about an L2 cache)
_CHUNK_BYTES = 2 * 2**20


def _biased_forward(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scale: float, causal: bool) -> Tensor:
    """``softmax(scale · q kᵀ + bias) v`` for a float ``bias`` that needs a gradient (a learnable encoding).

    :func:`~torch.nn.functional.scaled_dot_product_attention` sends such a mask to its math path, which keeps
    several ``[B, H, Lq, Lk]`` tensors for the backward (2.6–3.1× the time and 20–40× the memory of flash
    attention on CPU at L=2048). Here the forward is the CPU flash kernel with the bias as a constant mask,
    and the backward (:func:`_biased_backward`) recomputes the probabilities (a softmax) block by block of query
    rows (each block stays in cache for its five uses), giving the usual gradients of q, k, v plus
    ``∂L/∂bias = P ∘ (dP − rowsum(dO ∘ O))`` summed over the dimensions the bias broadcasts over. Equal to the
    math path up to float rounding (tests/test_fastpath_speedups.py). ``bias`` is contiguous (:func:`biased_sdpa`).
    """
    out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=bias, scale=scale
    )
    return out


def _biased_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, bias: Tensor, out: Tensor, scale: float, causal: bool, dbias: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``dq, dk, dv`` and ``∂L/∂bias`` (empty unless ``dbias``) of :func:`_biased_forward`, the probabilities
    recomputed per block of query rows."""
    b, h, lq, _ = q.shape
    lk = k.shape[2]
    bb_n, bh_n = bias.shape[0], bias.shape[1]
    # causal (Lq == Lk): query i sees keys 0 .. i, so a block of rows skips the keys past its diagonal
    full = bb_n == b and bh_n == h and not causal  # one bias entry per (batch, head): written, not accumulated
    acc = torch.promote_types(q.dtype, torch.float32)
    delta = (dout * out).sum(-1, dtype=acc).to(q.dtype)  # [B, H, Lq]: rowsum(dO ∘ O)
    dout = dout.contiguous()  # q, k, v stay the (strided) views they are: BLAS reads rows of any stride
    dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
    d_bias = bias.new_empty(bias.shape) if full and dbias else extra_grad(bias, dbias)
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
                if full and dbias:
                    d_bias[bb, hb, r0:r1] = ds
                elif dbias:
                    d_bias[bb, hb, r0:r1, :ke] += ds
                # dq = dS k·s, dk = dSᵀ q·s: the scale goes on the thin results (no scaled copies of q, k)
                torch.mm(ds, kh[:ke], out=dq[bi, hi, r0:r1]).mul_(scale)
                dkh[:ke].addmm_(ds.t(), qh[r0:r1], alpha=scale)
    return dq, dk, dv, d_bias


# one custom op (and its backward another), so that torch.compile keeps the kernel
_biased_op = attention_op("biased_sdpa", _biased_forward, _biased_backward)


def biased_sdpa(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scale: float, causal: bool = False) -> Tensor:
    """The ``biased-sdpa`` kernel (:func:`_biased_forward`), one custom op ``posenc::biased_sdpa`` with its backward
    ``posenc::biased_sdpa_backward``, which ``torch.compile`` keeps as they are. ``bias`` ``[B|1, H|1, Lq, Lk]``."""
    # a permuted bias (e.g. [L, L, H] -> [1, H, L, L]) is read 1 + B times by the backward: made contiguous once
    return _biased_op(q, k, v, bias.contiguous(), float(scale), bool(causal))


class _BiasedSDPA:
    """:func:`biased_sdpa` under the name of the ``autograd.Function`` it was: ``_BiasedSDPA.apply(q, k, v, bias,
    scale, causal=False)`` (what :func:`sdpa` calls, so a test may count the calls)."""

    apply = staticmethod(biased_sdpa)


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
    )


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
    """Whether the CPU flash kernel can run this call directly (CPU, float, no dropout, not portable: while compiling,
    only for ``biased-sdpa``, whose plan is then not portable)."""
    return (
        not plan.portable
        and q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)
        and plan.dropout == 0.0
    )


def sdpa(call: _Call, plan: Plan, q: Tensor, add: Tensor | None, scale: float) -> Tensor:
    """The ``sdpa`` and ``biased-sdpa`` kernels: ``[B, H, Lq, Dh]``. ``q`` is the call's query (or the query with the
    encoding's content term folded in), ``add`` the encoding's terms after the temperature (``None``: none)."""
    k, v, allowed = call.k, call.v, call.allowed
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
        # `True if ... else False`: with dynamic shapes under torch.compile a comparison of lengths is a SymBool,
        # which SDPA refuses; the branch makes Dynamo guard on it and pass a constant
        q, k, v, attn_mask=attn_mask, dropout_p=plan.dropout, is_causal=True if is_causal else False, scale=scale
    )
