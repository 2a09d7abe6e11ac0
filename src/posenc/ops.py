"""The CPU attention kernels as ``torch.library`` custom ops, so that ``torch.compile`` keeps them.

A kernel written as Python row loops (or an ``autograd.Function``) cannot be traced by Dynamo without unrolling
its loops for one length, so a compiled model used to fall back to SDPA with a materialised ``[B, H, L, L]`` mask.
Registered as a custom op, with a *fake* implementation (the output's shape, dtype and strides, from the inputs'
alone) and its backward a second custom op, the kernel is one node of the compiled graph, forward and backward,
for any length (``dynamic=True``: no recompile per length).

:func:`attention_op` registers a kernel of the signature the bias kernels share,
``(q, k, v, extra, scale, causal) -> out`` with one extra tensor (a bias per offset, a bias), and its backward
``(dout, q, k, v, extra, out, scale, causal, extra_grad) -> (dq, dk, dv, dextra)``. The forward and backward are
the eager kernels themselves: eager results are the same bits as before. Imports only torch (kernels layer).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

#: the namespace of posenc's custom ops (``torch.ops.posenc.<name>``)
NAMESPACE = "posenc"

Forward = Callable[[Tensor, Tensor, Tensor, Tensor, float, bool], Tensor]
Backward = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, float, bool, bool], tuple[Tensor, ...]]


def extra_grad(extra: Tensor, wanted: bool) -> Tensor:
    """The zeroed, contiguous gradient of the extra tensor, or an empty tensor where none is wanted (a custom op
    returns tensors, never ``None``)."""
    return extra.new_zeros(extra.shape) if wanted else extra.new_empty(0)


def attention_op(name: str, forward: Forward, backward: Backward) -> Callable[..., Tensor]:
    """Register ``posenc::<name>`` (``forward``) and ``posenc::<name>_backward`` (``backward``) with their fake
    implementations and autograd; returns the forward op (call it as ``op(q, k, v, extra, scale, causal)``).

    ``forward`` returns a new ``[B, H, Lq, d]`` tensor laid out like ``q`` (``torch.empty_like(q)``); ``backward``
    returns ``dq, dk, dv`` laid out like ``q, k, v`` and ``dextra`` as :func:`extra_grad` makes it. The extra
    tensor's gradient is computed only where autograd asks for it."""

    def run(q: Tensor, k: Tensor, v: Tensor, extra: Tensor, scale: float, causal: bool) -> Tensor:
        return forward(q, k, v, extra, scale, causal)

    def run_backward(
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        extra: Tensor,
        out: Tensor,
        scale: float,
        causal: bool,
        want: bool,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        dq, dk, dv, dextra = backward(dout, q, k, v, extra, out, scale, causal, want)
        return dq, dk, dv, dextra

    op = torch.library.custom_op(f"{NAMESPACE}::{name}", run, mutates_args=())
    backward_op = torch.library.custom_op(f"{NAMESPACE}::{name}_backward", run_backward, mutates_args=())

    @op.register_fake
    def _(q: Tensor, k: Tensor, v: Tensor, extra: Tensor, scale: float, causal: bool) -> Tensor:
        return torch.empty_like(q)

    @backward_op.register_fake
    def _(dout, q, k, v, extra, out, scale, causal, want):  # the schema is the op's: no annotations needed
        dextra = extra.new_empty(extra.shape if want else 0)  # laid out as extra_grad lays it out
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dextra

    def setup(ctx, inputs, output) -> None:
        q, k, v, extra, scale, causal = inputs
        ctx.save_for_backward(q, k, v, extra, output)
        ctx.scale, ctx.causal = scale, causal

    def grad(ctx, dout: Tensor):
        q, k, v, extra, out = ctx.saved_tensors
        want = ctx.needs_input_grad[3]
        dq, dk, dv, dextra = backward_op(dout, q, k, v, extra, out, ctx.scale, ctx.causal, want)
        return dq, dk, dv, dextra if want else None, None, None

    op.register_autograd(grad, setup_context=setup)
    return op


__all__ = ["NAMESPACE", "attention_op", "extra_grad"]
