"""posenc.offset_bias: attention with a per-offset bias, against the materialised formula (values and gradients)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import posenc
import posenc.offset_bias as ob
from posenc.offset_bias import offset_bias_attention

F64 = torch.float64


def materialised(q, k, v, vals, scale, causal):
    """``softmax(scale q kᵀ + B) v`` with ``B[h, i, j] = vals[h, j - i + Lq - 1]`` written out."""
    lq, lk = q.shape[2], k.shape[2]
    i = torch.arange(lq)[:, None]
    j = torch.arange(lk)[None, :]
    s = scale * q @ k.transpose(-1, -2) + vals[:, j - i + lq - 1]
    if causal:
        s = s.masked_fill(j > i + lk - lq, float("-inf"))
    return torch.softmax(s, -1) @ v


@settings(max_examples=40, deadline=None)
@given(
    b=st.integers(1, 2),
    h=st.integers(1, 3),
    lq=st.integers(1, 23),
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
    vals = (3 * torch.randn(1 if shared else h, lq + lk - 1, generator=g, dtype=F64)).requires_grad_()
    dout = torch.randn(b, h, lq, 4, generator=g, dtype=F64)
    old = ob.FORWARD_ROWS, ob.BACKWARD_BYTES
    ob.FORWARD_ROWS, ob.BACKWARD_BYTES = rows, rows * lk * 8  # several blocks, ragged last one
    try:
        got = offset_bias_attention(q, k, v, vals, 0.4, causal)
        dgot = torch.autograd.grad(got, (q, k, v, vals), dout)
    finally:
        ob.FORWARD_ROWS, ob.BACKWARD_BYTES = old
    want = materialised(q, k, v, vals, 0.4, causal)
    dwant = torch.autograd.grad(want, (q, k, v, vals), dout)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    for a, c in zip(dgot, dwant):
        torch.testing.assert_close(a, c, rtol=1e-9, atol=1e-11)


def test_gradcheck():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 3, generator=g, dtype=F64, requires_grad=True) for n in (5, 7, 7))
    vals = torch.randn(2, 11, generator=g, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *a: offset_bias_attention(*a, 0.7, True), (q, k, v, vals))


def test_bad_shapes_say_what_is_right():
    q = torch.randn(1, 2, 5, 4)
    k = v = torch.randn(1, 2, 7, 4)
    with pytest.raises(ValueError, match=r"vals must be \[2\|1, Lq \+ Lk - 1 = 11\]"):
        offset_bias_attention(q, k, v, torch.randn(2, 10), 1.0)
    with pytest.raises(ValueError, match="Lk=5 < Lq=7"):
        offset_bias_attention(k, q, q, torch.randn(2, 11), 1.0, causal=True)
    with pytest.raises(ValueError, match="do not match"):
        offset_bias_attention(q, k, v[..., :3], torch.randn(2, 11), 1.0)


@pytest.mark.parametrize("name", ["t5", "kerple-log", "kerple-power", "dynamic-bias", "seed-relative-bias"])
def test_models_take_it_and_match_the_reference_path(name):
    """A training step of a LanguageModel and a SequenceClassifier: the offset-bias kernel, the reference numbers."""
    torch.manual_seed(0)
    for kind in ("lm", "classifier"):
        models = []
        for path in ("auto", "reference"):
            torch.manual_seed(0)
            kw = dict(encoding=name, d_model=16, n_heads=2, n_layers=2, max_len=300, path=path)
            m = posenc.LanguageModel(50, **kw) if kind == "lm" else posenc.SequenceClassifier(50, 3, **kw)
            models.append(m.double())
        fast, ref = models
        with torch.no_grad():
            for p in fast.parameters():  # off the initial values (a zero-initialised table hides a dropped term)
                p.add_(0.1 * torch.randn_like(p))
        ref.load_state_dict(fast.state_dict())
        tokens = torch.randint(0, 50, (2, 260))
        outs = []
        for m in (fast, ref):
            y = m(tokens)
            loss = (y * torch.linspace(-1, 1, y.numel(), dtype=F64).view_as(y)).sum()
            outs.append((loss, torch.autograd.grad(loss, list(m.parameters()), allow_unused=True)))
        kernels = {blk.attn.last_plan.kernel for blk in fast.trunk.blocks}
        assert kernels == {"offset-bias"}, kernels
        torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-10, atol=1e-10)
        for a, c in zip(outs[0][1], outs[1][1]):
            if a is None or c is None:
                assert (a is None or not a.any()) and (c is None or not c.any())
            else:
                torch.testing.assert_close(a, c, rtol=1e-8, atol=1e-10)
