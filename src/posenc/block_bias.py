r"""Attention with a bias the encoding evaluates one block of query rows at a time: no ``[H, Lq, Lk]`` tensor.

Some biases depend on more than the offset ``j - i`` (FIRE's normaliser ``ψ(max{L, i})`` depends on the query
position), so :mod:`posenc.offset_bias` does not apply, yet they are cheap to evaluate for any block of pairs. An
encoding that says how (:meth:`~posenc.base.PositionalEncoding.bias_blocks`: a function of its tensors and a block
``(r0, r1, ke)`` returning the ``[H|1, r1 - r0, ke]`` bias of query rows ``r0 .. r1 - 1`` against keys ``0 .. ke - 1``)
is attended by :func:`block_bias_attention`:

.. math::
    z_i = \sum_j \operatorname{softmax}_j\big(s\, q_i \cdot k_j + b(i, j)\big)\, v_j

The forward runs the CPU flash kernel on each block of query rows with that block's bias as its mask, read where it
lies: a causal block is two flash calls, the keys before its diagonal square and the square with flash's own causal
mask, merged by their log-sum-exps (no copy of the bias to mask a triangle). The backward evaluates each block's bias
again under autograd, recomputes the block's probabilities for all heads of a sequence at once (batched products,
which threads split by head; the diagonal square's upper triangle masked in the scores, not in a copy of the bias),
and hands the block's ``∂L/∂bias`` (one buffer for every block, summed over the batch) to
:func:`torch.autograd.grad` for the encoding's tensors: the bias and its gradient exist
one block at a time (``[H, 128, Lk]``), never as ``[H, Lq, Lk]`` (at L = 4096 and 8 heads, 512 MB each per
layer and step), and a causal call evaluates the bias only where a query may look. Equal to the materialised formula up
to float rounding (tests/test_block_bias.py).

A bias given as a :class:`BlockFunction` (its gradient written out, registered by name with :func:`block_function`:
FIRE's) is attended by the custom op ``posenc::block_bias_attention`` (and its backward a second op), eager and
compiled alike: ``torch.compile`` records the op as one node for any length, where it could not trace the row loops
of an ``autograd.Function``. A plain function keeps the ``autograd.Function`` and its gradient by autograd (eager).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from .offset_bias import check_inputs

# query rows per block (forward and backward): the block's bias is [H, rows, Lk]
BLOCK_ROWS = 128

BlockFn = Callable[[Sequence[Tensor], int, int, int], Tensor]
BlockGrad = Callable[[Sequence[Tensor], int, int, int, Tensor, list], None]

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _block_forward(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scale: float, causal: bool) -> Tensor:
    """One block of query rows ``q [B, H, n, d]`` against ``k, v [B, H, ke, d]`` with ``bias [1, H|1, n, ke]``: its
    output ``[B, H, n, d]``.

    Causal (the block's last ``n`` keys its diagonal square): two flash calls, the keys before the square with the
    bias as it is, the square with flash's own (top-left) causal mask, which is the bottom-right one of the block;
    merged by their log-sum-exps. The bias is read where it lies, never copied to mask its upper triangle."""
    n, ke = q.shape[2], k.shape[2]
    if not causal:
        return _flash(q, k, v, 0.0, False, attn_mask=bias, scale=scale)[0]
    c = ke - n  # keys every row of the block sees
    o2, l2 = _flash(q, k[:, :, c:], v[:, :, c:], 0.0, True, attn_mask=bias[..., c:], scale=scale)
    if c == 0:
        return o2
    o1, l1 = _flash(q, k[:, :, :c], v[:, :, :c], 0.0, False, attn_mask=bias[..., :c], scale=scale)
    lse = torch.logaddexp(l1, l2)
    w1, w2 = (l1 - lse).exp_().to(q.dtype), (l2 - lse).exp_().to(q.dtype)
    return o1.mul_(w1[..., None]).addcmul_(o2, w2[..., None])


class BlockFunction(NamedTuple):
    """A bias evaluated per block with its gradient written out: what ``torch.compile`` keeps as one custom op.

    ``bias(params, r0, r1, ke)`` returns the ``[H|1, r1 - r0, ke]`` bias of query rows ``r0 .. r1 - 1`` against keys
    ``0 .. ke - 1`` (no autograd needed); ``grad(params, r0, r1, ke, dbias, grads)`` adds the block's share of each
    parameter's gradient, given the block's ``∂L/∂bias`` (``[H|1, r1 - r0, ke]``), to ``grads[i]`` (a zeroed tensor
    shaped like ``params[i]``, or ``None`` where that gradient is not wanted). Made by :func:`block_function`, which
    registers it under its name: the op ``posenc::block_bias_attention`` finds it by name (an op takes tensors,
    numbers and strings, never a Python function), and its implementation runs without autograd, hence the
    gradient by hand."""

    name: str
    bias: BlockFn
    grad: BlockGrad


_FUNCTIONS: dict[str, BlockFunction] = {}


def block_function(name: str, bias: BlockFn, grad: BlockGrad) -> BlockFunction:
    """Register a bias per block (:class:`BlockFunction`) under ``name`` (one per encoding; registering a name again
    replaces it, as a module reload does) and return it."""
    fn = BlockFunction(name, bias, grad)
    _FUNCTIONS[name] = fn
    return fn


def compilable(fn: object) -> bool:
    """Whether :func:`block_bias_attention` with ``fn`` is one custom op (a :class:`BlockFunction`), which
    ``torch.compile`` keeps; a plain function is attended through an ``autograd.Function`` that tracing cannot keep."""
    return isinstance(fn, BlockFunction)


def _forward(
    q: Tensor, k: Tensor, v: Tensor, fn: BlockFn, params: Sequence[Tensor], scale: float, causal: bool
) -> Tensor:
    """The forward: flash on each block of query rows with that block's bias (:func:`_block_forward`)."""
    lq, lk = q.shape[2], k.shape[2]
    out = torch.empty_like(q)
    for r0 in range(0, lq, BLOCK_ROWS):
        r1 = min(lq, r0 + BLOCK_ROWS)
        ke = min(lk, r1 + lk - lq) if causal else lk
        bias = fn(params, r0, r1, ke).to(q.dtype)[None]  # [1, H|1, b, ke]
        qb, kb, vb = q[:, :, r0:r1], k[:, :, :ke], v[:, :, :ke]
        out[:, :, r0:r1] = _block_forward(qb, kb, vb, bias, scale, causal)
    return out


# one block's bias for the backward: (r0, r1, ke) -> (the bias, detached, and a function that takes the block's
# ∂L/∂bias and adds the parameters' share of their gradients)
Evaluate = Callable[[int, int, int], tuple[Tensor, Callable[[Tensor], None]]]


def _by_autograd(fn: BlockFn, params: Sequence[Tensor], wants: Sequence[bool], grads: list[Tensor | None]) -> Evaluate:
    """The backward's block bias of a plain function: evaluated under autograd, its gradient by
    :func:`torch.autograd.grad`."""

    def evaluate(r0: int, r1: int, ke: int) -> tuple[Tensor, Callable[[Tensor], None]]:
        leaves = [p.detach().requires_grad_(w) for p, w in zip(params, wants)]
        with torch.enable_grad():
            bias = fn(leaves, r0, r1, ke)  # recorded for the encoding's gradients

        def finish(dbias: Tensor) -> None:
            idx = [i for i, w in enumerate(wants) if w]
            with torch.enable_grad():
                got = torch.autograd.grad(bias, [leaves[i] for i in idx], dbias.to(bias.dtype), allow_unused=True)
            for i, g in zip(idx, got):
                if g is not None:
                    grads[i].add_(g)  # type: ignore[union-attr]

        return bias.detach(), finish

    return evaluate


def _by_hand(fn: BlockFunction, params: Sequence[Tensor], grads: list[Tensor | None]) -> Evaluate:
    """The backward's block bias of a :class:`BlockFunction`: its gradient by its ``grad``."""

    def evaluate(r0: int, r1: int, ke: int) -> tuple[Tensor, Callable[[Tensor], None]]:
        return fn.bias(params, r0, r1, ke), lambda dbias: fn.grad(params, r0, r1, ke, dbias, grads)

    return evaluate


def _backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    scale: float,
    causal: bool,
    evaluate: Evaluate,
    wanted: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """``dq, dk, dv``; the parameters' gradients go where ``evaluate``'s functions put them (``wanted``: any)."""
    b, h, lq, _ = q.shape
    lk = k.shape[2]
    acc = torch.promote_types(q.dtype, torch.float32)
    delta = (dout * out).sum(-1, dtype=acc).to(q.dtype)  # [B, H, Lq]: rowsum(dO ∘ O)
    dout = dout.contiguous()
    dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
    upper = torch.ones(BLOCK_ROWS, BLOCK_ROWS, dtype=torch.bool, device=q.device).triu_(1) if causal else None
    # one buffer each for a block's probabilities (all heads of a sequence), their gradient and ∂L/∂bias: the pages
    # are mapped once per call
    size = h * min(BLOCK_ROWS, lq) * lk
    pbuf, gbuf = q.new_empty(size), q.new_empty(size)
    dbuf: Tensor | None = None
    for r0 in range(0, lq, BLOCK_ROWS):
        r1 = min(lq, r0 + BLOCK_ROWS)
        m = r1 - r0
        ke = min(lk, r1 + lk - lq) if causal else lk
        bias, finish = evaluate(r0, r1, ke)  # [H|1, b, ke]
        bd = bias.to(q.dtype)
        hb = bd.shape[0]
        dbias = None
        if wanted:
            if dbuf is None:
                dbuf = q.new_empty(hb * min(BLOCK_ROWS, lq) * lk)
            dbias = dbuf[: hb * m * ke].view(hb, m, ke)
        for bi in range(b):  # all heads of a sequence at once: batched products, which threads split by head
            qb, kb, vb, do = q[bi, :, r0:r1], k[bi, :, :ke], v[bi, :, :ke], dout[bi, :, r0:r1]
            p = pbuf[: h * m * ke].view(h, m, ke)
            torch.baddbmm(bd.expand(h, m, ke), qb, kb.transpose(1, 2), alpha=scale, out=p)
            if upper is not None:  # the diagonal square's keys past each query
                p[:, :, ke - m :].masked_fill_(upper[:m, :m], float("-inf"))
            torch.ops.aten._softmax.out(p, -1, False, out=p)  # in place (faster than exp(s - lse) from the forward)
            dv[bi, :, :ke].baddbmm_(p.transpose(1, 2), do)
            ds = torch.bmm(do, vb.transpose(1, 2), out=gbuf[: h * m * ke].view(h, m, ke))
            ds.sub_(delta[bi, :, r0:r1, None]).mul_(p)  # dS = P ∘ (dP − Δ)
            if dbias is not None:
                g = ds.sum(0, keepdim=True) if hb == 1 else ds
                if bi == 0:
                    dbias.copy_(g)
                else:
                    dbias.add_(g)
            torch.bmm(ds, kb, out=dq[bi, :, r0:r1]).mul_(scale)
            dk[bi, :, :ke].baddbmm_(ds.transpose(1, 2), qb, alpha=scale)
        if dbias is not None:
            finish(dbias)
    return dq, dk, dv


def _zeroed(params: Sequence[Tensor], wants: Sequence[bool]) -> list[Tensor | None]:
    return [torch.zeros_like(p) if w else None for p, w in zip(params, wants)]


class _BlockBiasAttention(torch.autograd.Function):
    """A plain block function (not a :class:`BlockFunction`): eager only, its gradient by autograd."""

    @staticmethod
    def forward(ctx, meta, q, k, v, *params):  # type: ignore[override]
        fn, scale, causal = meta
        out = _forward(q, k, v, fn, params, scale, causal)
        ctx.meta = meta
        ctx.save_for_backward(q, k, v, out, *params)
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        fn, scale, causal = ctx.meta
        q, k, v, out, *params = ctx.saved_tensors
        wants = [p.requires_grad and need for p, need in zip(params, ctx.needs_input_grad[4:])]
        grads = _zeroed(params, wants)
        evaluate = _by_autograd(fn, params, wants, grads)
        dq, dk, dv = _backward(dout, q, k, v, out, scale, causal, evaluate, any(wants))
        return (None, dq, dk, dv, *grads)


# ---------------------------------------------------------------- the custom op (what torch.compile keeps)
@torch.library.custom_op("posenc::block_bias_attention", mutates_args=())
def _op(q: Tensor, k: Tensor, v: Tensor, params: list[Tensor], name: str, scale: float, causal: bool) -> Tensor:
    return _forward(q, k, v, _FUNCTIONS[name].bias, params, scale, causal)


@torch.library.custom_op("posenc::block_bias_attention_backward", mutates_args=())
def _backward_op(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    params: list[Tensor],
    name: str,
    scale: float,
    causal: bool,
    wants: list[bool],
) -> list[Tensor]:
    """``[dq, dk, dv, *dparams]``, an empty tensor for a parameter whose gradient is not wanted."""
    grads = _zeroed(params, wants)
    evaluate = _by_hand(_FUNCTIONS[name], params, grads)
    dq, dk, dv = _backward(dout, q, k, v, out, scale, causal, evaluate, any(wants))
    return [dq, dk, dv, *(p.new_empty(0) if g is None else g for p, g in zip(params, grads))]


@_op.register_fake
def _(q, k, v, params, name, scale, causal):
    return torch.empty_like(q)


@_backward_op.register_fake
def _(dout, q, k, v, out, params, name, scale, causal, wants):
    grads = [torch.empty_like(p) if w else p.new_empty(0) for p, w in zip(params, wants)]
    return [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), *grads]


def _setup(ctx, inputs, output) -> None:
    q, k, v, params, name, scale, causal = inputs
    ctx.save_for_backward(q, k, v, output, *params)
    ctx.numbers = (name, scale, causal)


def _grad(ctx, dout: Tensor):
    q, k, v, out, *params = ctx.saved_tensors
    name, scale, causal = ctx.numbers
    wants = [p.requires_grad for p in params] if ctx.needs_input_grad[3] else [False] * len(params)
    dq, dk, dv, *dparams = _backward_op(dout, q, k, v, out, params, name, scale, causal, wants)
    return dq, dk, dv, [g if w else None for g, w in zip(dparams, wants)], None, None, None


_op.register_autograd(_grad, setup_context=_setup)


def block_bias_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    fn: BlockFn | BlockFunction,
    params: Sequence[Tensor],
    scale: float,
    causal: bool = False,
) -> Tensor:
    """``softmax(scale · q kᵀ + B) v`` with the bias ``B`` evaluated block by block by ``fn``: ``[B, H, Lq, d]``.

    Args:
        q, k, v: ``[B, H, Lq|Lk, d]`` (CPU; float32 or float64).
        fn: ``fn(params, r0, r1, ke)`` -> the ``[H|1, r1 - r0, ke]`` bias of query rows ``r0 .. r1 - 1`` against
            keys ``0 .. ke - 1``, differentiable in ``params`` (it is called again under autograd in the backward);
            or a :class:`BlockFunction`, its gradient written out (one custom op, which ``torch.compile`` keeps).
        params: the tensors ``fn`` reads; their gradients flow back.
        scale: the temperature of ``q kᵀ`` (the bias is added after it).
        causal: query ``i`` sees keys ``j <= i + Lk - Lq`` only (bottom-right aligned; needs ``Lk >= Lq``).
    """
    check_inputs(q, k, v, causal, "block_bias_attention")
    if isinstance(fn, BlockFunction):
        return _op(q, k, v, list(params), fn.name, float(scale), bool(causal))
    return _BlockBiasAttention.apply((fn, float(scale), bool(causal)), q, k, v, *params)


__all__ = ["block_bias_attention", "block_function", "compilable", "BlockFunction", "BLOCK_ROWS"]
