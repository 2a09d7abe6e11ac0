"""posenc.block_bias: attention with a bias evaluated per block of query rows, against the materialised formula."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import posenc
import posenc.block_bias as bb
from posenc.block_bias import block_bias_attention

F64 = torch.float64


def bias_fn(params, r0, r1, ke):
    """A bias that is not a function of j - i: per head a weight times sin(u_i · z_j)."""
    w, u, z = params
    return w[:, None, None] * torch.sin(u[r0:r1, None] * z[None, :ke])


@settings(max_examples=40, deadline=None)
@given(
    b=st.integers(1, 2),
    h=st.integers(1, 3),
    lq=st.integers(1, 21),
    extra=st.integers(0, 9),
    causal=st.booleans(),
    shared=st.booleans(),
    rows=st.integers(1, 9),
    seed=st.integers(0, 2**16),
)
def test_matches_the_formula_with_gradients(b, h, lq, extra, causal, shared, rows, seed):
    lk = lq + extra
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, 4, generator=g, dtype=F64, requires_grad=True) for n in (lq, lk, lk))
    params = tuple(torch.randn(n, generator=g, dtype=F64, requires_grad=True) for n in ((1 if shared else h), lq, lk))
    dout = torch.randn(b, h, lq, 4, generator=g, dtype=F64)
    old = bb.BLOCK_ROWS
    bb.BLOCK_ROWS = rows  # several blocks, a ragged last one
    try:
        got = block_bias_attention(q, k, v, bias_fn, params, 0.4, causal)
        dgot = torch.autograd.grad(got, (q, k, v, *params), dout)
    finally:
        bb.BLOCK_ROWS = old
    s = 0.4 * q @ k.transpose(-1, -2) + bias_fn(params, 0, lq, lk)
    if causal:
        i, j = torch.arange(lq)[:, None], torch.arange(lk)[None, :]
        s = s.masked_fill(j > i + lk - lq, float("-inf"))
    want = torch.softmax(s, -1) @ v
    dwant = torch.autograd.grad(want, (q, k, v, *params), dout)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    for a, c in zip(dgot, dwant):
        torch.testing.assert_close(a, c, rtol=1e-9, atol=1e-11)


def test_bad_shapes_say_what_is_right():
    q = torch.randn(1, 2, 5, 4)
    k = torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match="Lk=3 < Lq=5"):
        block_bias_attention(q, k, k, bias_fn, (), 1.0, causal=True)
    with pytest.raises(ValueError, match="do not match"):
        block_bias_attention(q, k, k[..., :3], bias_fn, (), 1.0)


@pytest.mark.parametrize("learn_threshold", [True, False])
def test_fire_models_take_it_and_match_the_reference_path(learn_threshold):
    """FIRE past its threshold (a bias that is not Toeplitz): the block-bias kernel gives the reference numbers."""
    outs = []
    for path in ("auto", "reference"):
        torch.manual_seed(0)
        opts = {"init_L": 64, "learn_threshold": learn_threshold}  # rows past i = 64 have their own normaliser
        m = posenc.LanguageModel(
            40, encoding="fire", encoding_options=opts, d_model=16, n_heads=2, n_layers=2, max_len=300, path=path
        ).double()
        with torch.no_grad():
            for p in m.parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()), dtype=F64))
        tokens = torch.randint(0, 40, (2, 270), generator=torch.Generator().manual_seed(1))
        y = m(tokens)
        loss = (y * torch.linspace(-1, 1, y.numel(), dtype=F64).view_as(y)).sum()
        grads = torch.autograd.grad(loss, [p for p in m.parameters() if p.requires_grad])
        outs.append((m, loss, grads))
    (fast, a, ga), (_, b, gb) = outs
    assert {blk.attn.last_plan.kernel for blk in fast.trunk.blocks} == {"block-bias"}
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("causal", [True, False])
def test_float32_blocks_match_the_formula(causal):
    """float32 (the training dtype): the forward's two flash calls per causal block, merged by their log-sum-exps,
    and the backward's scores masked on the diagonal square give the formula's numbers."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, n, 8, generator=g, requires_grad=True) for n in (37, 45, 45))
    params = tuple(torch.randn(n, generator=g, requires_grad=True) for n in (3, 37, 45))
    dout = torch.randn(2, 3, 37, 8, generator=g)
    old = bb.BLOCK_ROWS
    bb.BLOCK_ROWS = 16
    try:
        got = block_bias_attention(q, k, v, bias_fn, params, 0.3, causal)
        dgot = torch.autograd.grad(got, (q, k, v, *params), dout)
    finally:
        bb.BLOCK_ROWS = old
    s = 0.3 * q @ k.transpose(-1, -2) + bias_fn(params, 0, 37, 45)
    if causal:
        s = s.masked_fill(torch.arange(45)[None, :] > torch.arange(37)[:, None] + 8, float("-inf"))
    want = torch.softmax(s, -1) @ v
    dwant = torch.autograd.grad(want, (q, k, v, *params), dout)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, c in zip(dgot, dwant):
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kernel", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("c", [0.37, -0.2, 0.0])
def test_fire_block_gradient_by_hand_equals_autograd(c, kernel):
    """FIRE's block bias ``A_s x + B_s`` with ``x = ψ(|i - j|) / n_i`` and its gradient written out (what the custom
    op runs, without autograd): equal to autograd through the formula as written, for ``c``, the normalisers ``n``
    and the pieces ``A, B`` (c < 0 enters as |c|; at c = 0 |c|'s gradient is 0, as autograd's), on a block that
    starts past row 0; in C and in PyTorch ops."""
    from posenc import native
    from posenc.bias.fire import _BLOCKS

    g = torch.Generator().manual_seed(2)
    q_pos, k_pos = torch.tensor([0, 3, 4, 9, 12]), torch.tensor([0, 1, 2, 5, 7, 11, 13])
    knots = torch.sort(torch.randn(4, generator=g, dtype=F64)).values
    knots[-1] = float("inf")  # a unit that never switches
    cc = torch.tensor(c, dtype=F64, requires_grad=True)
    norm = torch.rand(5, dtype=F64, generator=g).add_(0.5).requires_grad_()
    a, b = (torch.randn(5, 3, generator=g, dtype=F64, requires_grad=True) for _ in range(2))
    params = (cc, norm, a, b, q_pos, k_pos, knots)
    r0, r1, ke = 1, 4, 6
    dbias = torch.randn(3, r1 - r0, ke, generator=g, dtype=F64)
    x = torch.log1p((cc * (q_pos[r0:r1, None] - k_pos[None, :ke]).to(F64).abs()).abs()) / norm[r0:r1, None]
    s = (x.detach()[..., None] > knots).sum(-1)  # the piece of every pair, by a comparison per knot
    want_bias = a[s].permute(2, 0, 1) * x + b[s].permute(2, 0, 1)
    want = torch.autograd.grad(want_bias, (cc, norm, a, b), dbias)
    native.enabled = kernel
    try:
        with torch.no_grad():
            got_bias = _BLOCKS.bias(params, r0, r1, ke)
            grads = [torch.zeros_like(t) for t in params[:4]] + [None] * 3
            _BLOCKS.grad(params, r0, r1, ke, dbias, grads)
    finally:
        native.enabled = True
    torch.testing.assert_close(got_bias, want_bias.detach(), rtol=1e-12, atol=1e-12)
    for got, w in zip(grads, want):
        torch.testing.assert_close(got, w, rtol=1e-10, atol=1e-12)
