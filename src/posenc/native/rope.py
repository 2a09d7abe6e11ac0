"""The one-pass RoPE rotation of :mod:`posenc.native` (:func:`rope_rotate`) and its backward.

PyTorch has no single elementwise op for a rotary rotation: the rotate-half layout pairs dimension ``i`` with
``i + d/2``, so eager code needs four half-width passes (or temporaries and a ``cat``), each as slow as a full one.
The kernel reads ``x`` once (any strides with a contiguous last dimension), reads the broadcast ``cos`` / ``sin``
rows, and writes the output once -- with non-temporal stores where the output is larger than a cache. Imports
torch and :mod:`posenc.native.loader` / :mod:`posenc.native.threads`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import loader
from .threads import _run, _split

# outputs at least this large are written with non-temporal stores (about an L2 cache: smaller ones stay in cache)
NT_BYTES = 1 << 20
# outputs at least this large (glibc's largest mmap threshold) get their pages mapped in one madvise call
POPULATE_BYTES = 32 << 20


def _rope(x: Tensor, cos: Tensor, sin: Tensor, rotary_dim: int, half: bool, sign: float) -> Tensor:
    """The kernel on a 4-d ``x`` and phases that broadcast to it (checked by :func:`rope_rotate`)."""
    lib = loader._lib()
    assert lib is not None
    n0, n1, n2, d = shape = x.shape
    xst, cst, csh = x.stride(), cos.stride(), cos.shape
    # a dim of size 1 is never stepped (stride 0): a broadcast phase, or a single batch / head / position
    xs = (xst[0] if n0 > 1 else 0, xst[1] if n1 > 1 else 0, xst[2] if n2 > 1 else 0)
    cs = (cst[0] if csh[0] > 1 else 0, cst[1] if csh[1] > 1 else 0, cst[2] if csh[2] > 1 else 0)
    out = torch.empty(shape, dtype=x.dtype)
    rows = n0 * n1 * n2
    numel = rows * d
    nbytes = numel * x.element_size()
    nt = int(nbytes >= NT_BYTES)
    if nbytes >= POPULATE_BYTES:  # likely fresh pages from mmap: map them in one call, not a fault per page
        lib.posenc_populate(out.data_ptr(), nbytes)
    fn = lib.posenc_rope_f32 if x.dtype == torch.float32 else lib.posenc_rope_f64
    head = (x.data_ptr(), out.data_ptr(), cos.data_ptr(), sin.data_ptr(), n0, n1, n2, d, rotary_dim, *xs, *cs)
    _run([(fn, *head, r0, r1, int(half), sign, nt) for r0, r1 in _split(rows, numel)])
    return out


class _Rotate(torch.autograd.Function):
    """The rotation as one autograd node; its backward rotates the gradient back (by ``-θ``)."""

    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor, rotary_dim: int, half: bool, sign: float):  # type: ignore[override]
        ctx.save_for_backward(cos, sin)
        ctx.args = (rotary_dim, half, sign)
        return _rope(x, cos, sin, rotary_dim, half, sign)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        cos, sin = ctx.saved_tensors
        rotary_dim, half, sign = ctx.args
        g = grad if grad.stride(-1) == 1 else grad.contiguous()
        if torch.is_grad_enabled():  # create_graph=True: the backward itself is differentiated
            dx = _Rotate.apply(g, cos, sin, rotary_dim, half, -sign)
        else:
            dx = _rope(g, cos, sin, rotary_dim, half, -sign)
        return dx, None, None, None, None, None


def rope_rotate(x: Tensor, cos: Tensor, sin: Tensor, rotary_dim: int, interleaved: bool) -> Tensor | None:
    r"""Rotate ``x [B, H, L, d]`` (or ``[B, L, d]``) by the phases ``cos``, ``sin`` ``[B|1, H|1, L, r/2]``.

    .. math::
        \text{half: } (o_i, o_{i+h}) = (x_i c_i - x_{i+h} s_i,\; x_{i+h} c_i + x_i s_i), \qquad
        \text{interleaved: } (o_{2i}, o_{2i+1}) = (x_{2i} c_i - x_{2i+1} s_i,\; x_{2i+1} c_i + x_{2i} s_i)

    for ``i < r/2``; dimensions ``r .. d-1`` pass through. Returns ``None`` (the caller keeps its PyTorch
    path) where the kernel does not apply: no compiled kernel, not CPU, not float32/float64, phases that
    need gradients, ``torch.compile`` tracing, a last dimension that is not contiguous, or shapes that do
    not broadcast.
    """
    if not loader.enabled or cos.requires_grad or sin.requires_grad or torch.compiler.is_compiling():
        return None
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64) or loader._lib() is None:
        return None
    if x.dim() not in (3, 4) or cos.dim() != x.dim() or x.stride(-1) != 1:
        return None
    if cos.shape != sin.shape or cos.stride() != sin.stride() or cos.stride(-1) != 1:
        return None
    if cos.dtype != x.dtype or sin.dtype != x.dtype or cos.shape[-1] != rotary_dim // 2:
        return None
    if rotary_dim % 2 or not 0 < rotary_dim <= x.shape[-1]:
        return None
    if any(cs not in (1, xs) for xs, cs in zip(x.shape[:-1], cos.shape[:-1])):
        return None
    three = x.dim() == 3  # [B, L, d]: one head
    if three:
        x, cos, sin = x[:, None], cos[:, None], sin[:, None]
    if torch.is_grad_enabled() and x.requires_grad:
        out = _Rotate.apply(x, cos, sin, rotary_dim, not interleaved, 1.0)
    else:  # no graph to record: skip the autograd node's overhead (about 25 µs)
        out = _rope(x, cos, sin, rotary_dim, not interleaved, 1.0)
    return out[:, 0] if three else out
