"""FIRE's bias in one pass (:func:`fire_bias`): the kernel of :mod:`posenc.native` for the piecewise-linear form of
FIRE's MLP (:meth:`posenc.bias.fire.FIRE.piecewise_linear`), forward and backward. Imports torch and
:mod:`posenc.native.loader` / :mod:`posenc.native.threads`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import loader
from .loader import _CTYPE
from .threads import _run, _split


class _FireBias(torch.autograd.Function):
    """``out[h, p] = A[g_p, h] x_p + B[g_p, h]`` with ``g_p`` the piece of ``x_p`` among the sorted knots."""

    @staticmethod
    def forward(ctx, x: Tensor, knots: Tensor, slope: Tensor, intercept: Tensor) -> Tensor:  # type: ignore[override]
        lib = loader._lib()
        assert lib is not None
        x, knots = x.contiguous(), knots.contiguous()
        a, b = slope.contiguous(), intercept.contiguous()
        n, heads = x.numel(), a.shape[1]
        out = torch.empty((heads, *x.shape), dtype=x.dtype)
        fn = getattr(lib, f"posenc_fire_forward_{_CTYPE[x.dtype]}")
        args = (x.data_ptr(), knots.data_ptr(), knots.numel(), a.data_ptr(), b.data_ptr(), out.data_ptr(), n, heads)
        _run([(fn, *args, p0, p1) for p0, p1 in _split(n, n * heads)])
        ctx.save_for_backward(x, knots, a)
        return out

    @staticmethod
    def backward(ctx, gout: Tensor):  # type: ignore[override]
        x, knots, a = ctx.saved_tensors
        dx, da, db = _grad(x, knots, a, gout)
        return dx, None, da, db


def _grad(x: Tensor, knots: Tensor, a: Tensor, gout: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``∂x, ∂A, ∂B`` from ``∂L/∂out`` (``[H, *x.shape]``), in one pass over the pairs (contiguous ``x``, ``knots``,
    ``a``)."""
    lib = loader._lib()
    assert lib is not None
    n, heads = x.numel(), a.shape[1]
    g = gout.reshape(heads, n)
    if g.stride(1) != 1:
        g = g.contiguous()
    dx = torch.empty_like(x)
    parts = _split(n, n * heads)
    da = torch.zeros((len(parts), *a.shape), dtype=torch.float64)
    db = torch.zeros((len(parts), *a.shape), dtype=torch.float64)
    fn = getattr(lib, f"posenc_fire_backward_{_CTYPE[x.dtype]}")
    head = (x.data_ptr(), knots.data_ptr(), knots.numel(), a.data_ptr(), g.data_ptr(), g.stride(0), dx.data_ptr())
    _run([(fn, *head, da[i].data_ptr(), db[i].data_ptr(), heads, p0, p1) for i, (p0, p1) in enumerate(parts)])
    return dx, da.sum(0).to(a.dtype), db.sum(0).to(a.dtype)


def _applies(x: Tensor, knots: Tensor, slope: Tensor, intercept: Tensor) -> bool:
    """Whether the kernel runs on these tensors (compiled, enabled, CPU, one float dtype, matching shapes) and it is
    not ``torch.compile`` tracing."""
    if not loader.enabled or torch.compiler.is_compiling() or loader._lib() is None:
        return False
    ts = (x, knots, slope, intercept)
    if any(t.device.type != "cpu" or t.dtype != x.dtype for t in ts) or x.dtype not in _CTYPE:
        return False
    return knots.dim() == 1 and slope.shape == intercept.shape and slope.shape[0] == knots.numel() + 1


def fire_bias(x: Tensor, knots: Tensor, slope: Tensor, intercept: Tensor) -> Tensor | None:
    r"""FIRE's bias from its MLP in piecewise-linear form, in one pass: ``[H, *x.shape]``.

    .. math::
        b_h(x) = A_{s(x), h}\, x + B_{s(x), h}, \qquad s(x) = \#\{	ext{knots} < x\}

    (``knots [m]`` sorted, ``slope`` ``A`` and ``intercept`` ``B`` ``[m + 1, H]``; see
    :meth:`posenc.bias.fire.FIRE.piecewise_linear`). The backward gives ``∂x``, ``∂A`` and ``∂B`` in one pass
    over the pairs (sums over a piece's pairs accumulate in float64). Returns ``None`` where the kernel does not
    apply (no compiled kernel, not CPU, mixed or other dtypes, ``torch.compile`` tracing): the caller keeps
    its PyTorch form.
    """
    if not _applies(x, knots, slope, intercept):
        return None
    return _FireBias.apply(x, knots, slope, intercept)


def fire_bias_grad(
    x: Tensor, knots: Tensor, slope: Tensor, intercept: Tensor, gout: Tensor
) -> tuple[Tensor, ...] | None:
    """The backward of :func:`fire_bias` by itself (no autograd): ``(∂x, ∂A, ∂B)`` from ``gout = ∂L/∂out``
    (``[H, *x.shape]``), or ``None`` where the kernel does not apply (as :func:`fire_bias`)."""
    if not _applies(x, knots, slope, intercept) or gout.dtype != x.dtype or gout.shape != (slope.shape[1], *x.shape):
        return None
    return _grad(x.contiguous(), knots.contiguous(), slope.contiguous(), gout)
