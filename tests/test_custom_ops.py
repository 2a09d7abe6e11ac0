"""posenc's CPU kernels as ``torch.library`` custom ops (issue 25): registered right, and kept by ``torch.compile``.

* ``torch.library.opcheck`` on every op (its schema, its fake implementation against the real one, its autograd
  registration, AOTAutograd with dynamic shapes), on odd lengths, float32 and float64, causal or not, with
  gradients, and on the backward ops themselves.
* A compiled attention (``fullgraph=True, dynamic=True``) takes the kernel the eager plan takes where it is a custom
  op, gives the reference path's numbers, and is not compiled again for another length (300, 517).
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from torch.library import opcheck

import posenc
from posenc.attention import MultiHeadAttention
from posenc.attention.kernels import COMPILABLE_KERNELS
from posenc.base import AttentionContext, PositionalEncoding

OPS = ("offset_bias_attention", "biased_sdpa", "relative_attention", "block_bias_attention", "cope_attention")
LENGTHS = (300, 517)  # two lengths: one graph for both (error_on_recompile on the second)
TOL64 = dict(rtol=1e-9, atol=1e-9)


def _qkv(lq: int, lk: int, dtype: torch.dtype, grad: bool, seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 3, lq, 8, generator=g, dtype=dtype)
    k, v = (torch.randn(2, 3, lk, 8, generator=g, dtype=dtype) for _ in range(2))
    return q.requires_grad_(grad), k.requires_grad_(grad), v.requires_grad_(grad)


def _extra(op: str, lq: int, lk: int, heads: int, dtype: torch.dtype, grad: bool) -> Tensor:
    """The op's extra tensor: a bias per offset ``[H|1, Lq + Lk - 1]``, or a bias ``[1, H|1, Lq, Lk]``."""
    g = torch.Generator().manual_seed(1)
    shape = (heads, lq + lk - 1) if op == "offset_bias_attention" else (1, heads, lq, lk)
    return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_(grad)


CASES = [  # (op, Lq, Lk, heads of the extra tensor, causal)
    ("offset_bias_attention", 7, 7, 3, False),
    ("offset_bias_attention", 7, 7, 1, True),
    ("offset_bias_attention", 5, 13, 3, True),
    ("offset_bias_attention", 13, 6, 1, False),
    ("biased_sdpa", 7, 7, 3, False),
    ("biased_sdpa", 9, 9, 1, True),
    ("biased_sdpa", 5, 11, 3, False),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize(("op", "lq", "lk", "heads", "causal"), CASES)
def test_opcheck(op: str, lq: int, lk: int, heads: int, causal: bool, dtype: torch.dtype) -> None:
    # inputs that need gradients: opcheck's autograd-registration check runs only then (the others run either way)
    q, k, v = _qkv(lq, lk, dtype, True)
    extra = _extra(op, lq, lk, heads, dtype, True)
    forward = getattr(torch.ops.posenc, op).default
    opcheck(forward, (q, k, v, extra, 0.3, causal))
    out = forward(q, k, v, extra, 0.3, causal).detach()
    dout = torch.randn_like(out)
    backward = getattr(torch.ops.posenc, f"{op}_backward").default
    for want in (True, False):
        args = (dout, q.detach(), k.detach(), v.detach(), extra.detach(), out, 0.3, causal, want)
        opcheck(backward, args)


def test_every_op_is_registered_and_named_by_the_plan() -> None:
    import posenc.bias.cope  # noqa: F401  (each op is registered where its kernel lives)
    import posenc.block_bias  # noqa: F401
    import posenc.offset_bias  # noqa: F401

    for op in OPS:
        assert hasattr(torch.ops.posenc, op) and hasattr(torch.ops.posenc, f"{op}_backward")
    assert {"offset-bias", "biased-sdpa", "blocked", "block-bias", "own-blocked"} <= set(COMPILABLE_KERNELS)


RELATIVE = {  # the terms of a form, as the op takes them: (query terms, key terms, compact tables, value table ...)
    "query-term": dict(nq=1, nk=0),
    "query-and-key-terms-compact": dict(nq=1, nk=1, rows=5),  # DeBERTa-like c2p + p2c on bucketed rows
    "shaw-values-compact": dict(nq=1, nk=0, rows=5, values=True),
    "segments-bias-mask": dict(nq=0, nk=1, segment=True, bias=True, mask=True),
    "dropout": dict(nq=1, nk=0, dropout=0.25),
}


def _relative_args(case: dict, lq: int, lk: int, dtype: torch.dtype, grad: bool, causal: bool) -> tuple:
    """The arguments of ``posenc::relative_attention`` for one form: tables ``[P|R, H|1, d]``, an index per table."""
    g = torch.Generator().manual_seed(2)
    p, h, d = lq + lk - 1, 3, 8

    def rnd(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_(grad)

    def table(heads: int) -> tuple[Tensor, Tensor | None]:
        if "rows" not in case:
            return rnd(p, heads, d), None
        return rnd(case["rows"], heads, d), torch.randint(0, case["rows"], (p,), generator=g)

    q, k, v = _qkv(lq, lk, dtype, grad)
    ops = [rnd(2, h, lq, d) for _ in range(case["nq"])] + [rnd(2, h, lk, d) for _ in range(case["nk"])]
    tabs, idxs = zip(*[table(h if i % 2 else 1) for i in range(len(ops))]) if ops else ((), ())
    allowed = torch.rand(2, 1, 1, lk, generator=g) > 0.2 if case.get("mask") else None
    if allowed is not None:
        allowed[..., 0] = True
    same, e = (torch.rand(1, lq, lk, generator=g) > 0.5, rnd(2, h, lq, 2)) if case.get("segment") else (None, None)
    bias = rnd(1, h, lq, lk) if case.get("bias") else None
    vt, vt_idx = table(1) if case.get("values") else (None, None)
    seed = torch.tensor([1234])
    dropout = case.get("dropout", 0.0)
    return (
        q,
        k,
        v,
        allowed,
        same,
        e,
        bias,
        vt,
        vt_idx,
        list(ops),
        list(tabs),
        list(idxs),
        seed,
        0.3,
        case["nq"],
        dropout,
        causal,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize(("lq", "lk", "causal"), [(9, 9, True), (11, 6, False)])
@pytest.mark.parametrize("case", list(RELATIVE))
def test_opcheck_relative_attention(case: str, lq: int, lk: int, causal: bool, dtype: torch.dtype) -> None:
    args = _relative_args(RELATIVE[case], lq, lk, dtype, True, causal)
    opcheck(torch.ops.posenc.relative_attention.default, args)
    out = torch.ops.posenc.relative_attention(*args).detach()
    detached = [a.detach() if isinstance(a, Tensor) else a for a in args]
    detached[9:12] = [[t.detach() if t is not None else None for t in ts] for ts in args[9:12]]
    for want in (True, False):
        opcheck(torch.ops.posenc.relative_attention_backward.default, (torch.randn_like(out), out, *detached, want))


def test_relative_op_equals_the_eager_kernel() -> None:
    """The op (what a compiled graph calls) and the eager kernel (which keeps the probabilities) give the same
    bits, forward and backward: the op recomputes the probabilities, it does not change them."""
    from posenc.fused import _RelativeAttention

    args = _relative_args(RELATIVE["query-and-key-terms-compact"], 9, 13, torch.float64, True, True)
    q, k, v, allowed, same, e, bias, vt, vt_idx, ops, tabs, idxs, seed, scale, nq, dropout, causal = args
    meta = (scale, nq, len(ops) - nq, dropout, int(seed), causal)
    leaves = [q, k, v, *ops, *tabs]
    got = torch.ops.posenc.relative_attention(*args)
    want = _RelativeAttention.apply(meta, q, k, v, allowed, same, e, bias, vt, vt_idx, *ops, *tabs, *idxs)
    dout = torch.randn_like(got)
    assert torch.equal(got, want)
    for a, b in zip(torch.autograd.grad(got, leaves, dout), torch.autograd.grad(want, leaves, dout)):
        assert torch.equal(a, b)


# ---------------------------------------------------------------- compiled attention keeps the kernels
class OffsetTable(PositionalEncoding):
    """A learned bias per offset (test only): its ``bias_offsets`` applies while compiling, so the compiled plan can
    take ``offset-bias``. Positions start at 0 (no cache): offset ``j - i`` reads ``table[:, j - i + max_len - 1]``."""

    def __init__(self, n_heads: int, max_len: int = 1024) -> None:
        super().__init__()
        self.n_heads, self.max_len = n_heads, max_len
        self.table = nn.Parameter(torch.randn(n_heads, 2 * max_len - 1) * 0.5)

    def bias(self, ctx: AttentionContext) -> Tensor:
        return self.table[:, ctx.relative() + self.max_len - 1].transpose(0, 1)  # [B, H, Lq, Lk]

    def bias_offsets(self, ctx: AttentionContext) -> Tensor | None:
        if ctx.reference or not ctx.contiguous:
            return None
        lq, lk = ctx.q_pos.shape[-1], ctx.k_pos.shape[-1]
        return self.table[:, self.max_len - lq : self.max_len + lk - 1]


def _layers(enc: PositionalEncoding) -> tuple[MultiHeadAttention, MultiHeadAttention]:
    torch.manual_seed(0)
    fast = MultiHeadAttention(32, 4, enc, path="fast").double()
    ref = MultiHeadAttention(32, 4, enc, path="reference").double()
    ref.load_state_dict(fast.state_dict())
    return fast, ref


def _run(layer, x: Tensor, causal: bool) -> tuple[Tensor, ...]:
    xx = x.clone().requires_grad_()
    out = layer(xx, causal=causal)
    params = [p for p in layer.parameters() if p.requires_grad]
    grads = torch.autograd.grad((out * out.detach().cos()).sum(), [xx, *params], allow_unused=True)
    # a parameter this call does not use (XLNet's segment terms without segment ids) has no gradient: 0 stands in
    return (out, *(g if g is not None else torch.zeros((), dtype=out.dtype) for g in grads))


def _compiled_keeps(enc: PositionalEncoding, kernel: str, causal: bool) -> None:
    """Eager and compiled (fullgraph, dynamic) take ``kernel`` at every length, with the reference's numbers and
    gradients, and the compiled module is compiled once."""
    fast, ref = _layers(enc)
    torch._dynamo.reset()
    compiled = torch.compile(fast, fullgraph=True, dynamic=True, backend="aot_eager")
    for i, n in enumerate(LENGTHS):
        x = torch.randn(2, n, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
        want = _run(ref, x, causal)
        eager = _run(fast, x, causal)
        assert fast.last_plan is not None and fast.last_plan.kernel == kernel, str(fast.last_plan)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):  # one graph for every length
            got = _run(compiled, x, causal)
        assert fast.last_plan.kernel == kernel and not fast.last_plan.portable, str(fast.last_plan)
        for a, b, c in zip(got, eager, want):
            torch.testing.assert_close(a, c, **TOL64)
            torch.testing.assert_close(b, c, **TOL64)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_compiled_offset_bias_keeps_its_kernel(causal: bool) -> None:
    _compiled_keeps(OffsetTable(4), "offset-bias", causal)


def _offset_kernel_encodings() -> list[str]:
    """The registered encodings whose eager plan at L = 300 (causal, with gradients) is one of the ops that read a
    call's terms per offset: offset-bias (``bias_offsets``) or blocked (``relative_form``)."""
    from posenc.registry import available, example

    out = []
    for name in available():
        try:
            enc = example(name, dict(d_model=32, n_heads=4, head_dim=8, max_len=1024, causal=True))
        except Exception:  # an encoding that cannot be built at these sizes (a table shorter than 300 ...)
            continue
        fast, _ = _layers(enc)
        x = torch.randn(2, 300, 32, dtype=torch.float64)
        try:
            kernel = fast.plan(x, causal=True).kernel
        except Exception:
            continue
        if kernel in ("offset-bias", "blocked"):
            out.append(name)
    return out


OFFSET_KERNEL_ENCODINGS = _offset_kernel_encodings()


def test_some_encodings_take_the_offset_kernels() -> None:
    assert len(OFFSET_KERNEL_ENCODINGS) >= 8, OFFSET_KERNEL_ENCODINGS


@pytest.mark.parametrize("name", OFFSET_KERNEL_ENCODINGS)
def test_compiled_encoding_keeps_its_offset_kernel(name: str) -> None:
    """Every encoding whose eager plan reads its terms per offset keeps that kernel compiled (its ``bias_offsets`` /
    ``relative_form`` hold while tracing: ``relative._skew.offset_rows``), one graph for every length."""
    from posenc.registry import example

    enc = example(name, dict(d_model=32, n_heads=4, head_dim=8, max_len=1024, causal=True))
    fast, _ = _layers(enc)
    kernel = fast.plan(torch.randn(2, 300, 32, dtype=torch.float64), causal=True).kernel
    _compiled_keeps(enc, kernel, causal=True)


@pytest.mark.parametrize("name", ["t5", "kerple-log"])
def test_compiled_learned_bias_takes_biased_sdpa(name: str) -> None:
    """A learned bias compiled keeps a custom-op kernel (offset-bias, or biased-sdpa where the bias is a tensor),
    never SDPA's math path with the ``[B, H, L, L]`` tensors of its gradient."""
    enc = posenc.get(name, n_heads=4)
    fast, _ = _layers(enc)
    x = torch.randn(2, 300, 32, dtype=torch.float64)
    compiled = torch.compile(fast, fullgraph=True, dynamic=True, backend="aot_eager")
    torch._dynamo.reset()
    want = _run(fast, x, False)
    got = _run(compiled, x, False)
    assert fast.last_plan is not None and fast.last_plan.kernel in ("biased-sdpa", "offset-bias"), str(fast.last_plan)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL64)


def test_compiled_dropout_takes_the_blocked_op() -> None:
    """Training with attention dropout on CPU takes the ``blocked`` kernel (SDPA's CPU kernels would materialise
    the mask), compiled too: its masks are drawn from a seed the graph draws, the same stream as eager's."""
    enc = posenc.get("t5", n_heads=4)
    fast, _ = _layers(enc)
    fast.dropout = 0.2
    fast.train()
    torch._dynamo.reset()
    compiled = torch.compile(fast, fullgraph=True, dynamic=True, backend="aot_eager")
    x = torch.randn(2, 300, 32, dtype=torch.float64)
    results = []
    for layer in (fast, compiled):
        torch.manual_seed(7)
        results.append(_run(layer, x, True))
        assert fast.last_plan is not None and fast.last_plan.kernel == "blocked", str(fast.last_plan)
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, **TOL64)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_compiled_fire_keeps_the_block_bias_op(causal: bool) -> None:
    """FIRE (a bias that is not Toeplitz: rows past its threshold L = 64 have their own normaliser) compiled keeps
    the ``block-bias`` op, fullgraph, one graph for lengths 300 and 517, with the reference path's numbers and
    gradients (``c``, the threshold and the MLP through its pieces), not the ``[B, H, L, L]`` MLP of the portable
    plan."""
    enc = posenc.get("fire", n_heads=4, init_L=64.0)
    with torch.no_grad():
        for p in enc.mlp.parameters():
            p.normal_(generator=torch.Generator().manual_seed(p.numel()))
    _compiled_keeps(enc, "block-bias", causal)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize(("lq", "lk", "causal"), [(7, 7, True), (5, 13, True), (13, 6, False)])
def test_opcheck_block_bias_attention(lq: int, lk: int, causal: bool, dtype: torch.dtype) -> None:
    """``posenc::block_bias_attention`` with FIRE's block function (the op finds it by name) and its backward: opcheck
    on odd lengths and several blocks, with and without the parameters' gradients."""
    import posenc.block_bias as bb
    from posenc.bias.fire import _BLOCKS

    g = torch.Generator().manual_seed(3)
    q, k, v = _qkv(lq, lk, dtype, True)
    knots = torch.sort(torch.randn(4, generator=g, dtype=dtype)).values
    params = [
        torch.tensor(0.3, dtype=dtype, requires_grad=True),  # c
        torch.rand(lq, generator=g, dtype=dtype).add_(1.0).requires_grad_(),  # the normalisers
        torch.randn(5, 3, generator=g, dtype=dtype, requires_grad=True),  # A
        torch.randn(5, 3, generator=g, dtype=dtype, requires_grad=True),  # B
        torch.arange(lk - lq, lk),  # query positions (bottom-right aligned)
        torch.arange(lk),
        knots,
    ]
    old, bb.BLOCK_ROWS = bb.BLOCK_ROWS, 4
    try:
        opcheck(torch.ops.posenc.block_bias_attention.default, (q, k, v, params, _BLOCKS.name, 0.3, causal))
        out = torch.ops.posenc.block_bias_attention(q, k, v, params, _BLOCKS.name, 0.3, causal).detach()
        dout = torch.randn_like(out)
        plain = [p.detach() for p in params]
        for wants in ([True] * 4 + [False] * 3, [False] * 7):
            args = (dout, q.detach(), k.detach(), v.detach(), out, plain, _BLOCKS.name, 0.3, causal, wants)
            opcheck(torch.ops.posenc.block_bias_attention_backward.default, args)
    finally:
        bb.BLOCK_ROWS = old


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_compiled_cope_keeps_its_own_blocked_op(causal: bool) -> None:
    """CoPE compiled keeps its row-blocked kernel (``posenc::cope_attention``, one graph for lengths 300 and 517),
    with the reference path's numbers and gradients, not the materialised ``[B, H, L, L]`` logits of the portable
    plan (2.8x eager's time and 6.4x its memory at L = 2048 before)."""
    enc = posenc.get("cope", head_dim=8, npos_max=16, causal=causal)
    with torch.no_grad():
        enc.pos_emb.normal_(generator=torch.Generator().manual_seed(5))
    _compiled_keeps(enc, "own-blocked", causal)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize(
    ("lq", "lk", "causal", "masks"), [(7, 7, True, False), (5, 13, True, True), (13, 6, False, True)]
)
def test_opcheck_cope_attention(lq: int, lk: int, causal: bool, masks: bool, dtype: torch.dtype) -> None:
    """``posenc::cope_attention`` and its backward: opcheck on odd lengths and several blocks, with and without a
    key mask and CoPE's gate ends, with and without the table's gradient."""
    import posenc.bias.cope as cope

    g = torch.Generator().manual_seed(4)
    q, k, v = _qkv(lq, lk, dtype, True)
    table = torch.randn(8, 6, generator=g, dtype=dtype, requires_grad=True)
    gate_end = mask = None
    if masks:
        gate_end = torch.randint(1, lk + 1, (2, lq), generator=g)
        mask = torch.rand(2, 1, lq, lk, generator=g) > 0.2
    old, cope.BLOCK_ROWS = cope.BLOCK_ROWS, 4
    try:
        args = (q, k, v, table, gate_end, mask, 0.3, 0.35, 5, causal)
        opcheck(torch.ops.posenc.cope_attention.default, args)
        out = torch.ops.posenc.cope_attention(*args).detach()
        dout = torch.randn(out.shape, generator=g, dtype=dtype)
        plain = [t.detach() for t in (q, k, v, table)]
        for want in (True, False):
            bargs = (dout, *plain, out, gate_end, mask, 0.3, 0.35, 5, causal, want)
            opcheck(torch.ops.posenc.cope_attention_backward.default, bargs)
    finally:
        cope.BLOCK_ROWS = old
