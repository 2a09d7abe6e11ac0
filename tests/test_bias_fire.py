"""FIRE ("fire") against the paper's equation b(i,j) = f(psi(i-j) / psi(max(L, i))), psi(x) = log(c x + 1).

Truth:
* hand-computed cases with math.log and an MLP set to f(x) = relu(x) (float64, 1e-12, eps = 0);
* a naive double loop with the module's random MLP weights written out as W2 relu(W1 x + b1) + b2
  (float64, 1e-12, with the pseudo-code's eps = 1e-6 in the denominator);
* what FIRE claims: progressive interpolation -- for i >= L the farthest key (j = 0) always gets
  f(1) whatever the length; shift invariance only while every query lies below the threshold L,
  and not beyond it;
* fast (SDPA) == reference attention path (float64, 1e-10);
* the fast bias's piecewise-linear form of the MLP == the MLP itself (random weights, float64).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import posenc
from posenc import ConfigError, MultiHeadAttention, native
from posenc.base import AttentionContext
from posenc.bias.fire import FIRE

D, H = 16, 4


def relu_fire(c: float, L: float, n_heads: int = 2) -> FIRE:
    """A FIRE whose MLP is f(x) = relu(x) for every head (hidden width 1), eps = 0."""
    enc = FIRE(n_heads, hidden=1, init_c=c, init_L=L, eps=0.0).double()
    with torch.no_grad():
        enc.mlp[0].weight.fill_(1.0)
        enc.mlp[0].bias.zero_()
        enc.mlp[2].weight.fill_(1.0)
        enc.mlp[2].bias.zero_()
    return enc


def test_hand_computed_small_cases() -> None:
    enc = relu_fire(c=1.0, L=2.0)
    m = enc.matrix(5)  # [H, 5, 5]
    # i = 1 < L = 2: normaliser psi(2) = log 3
    assert m[0, 1, 0].item() == pytest.approx(math.log(2) / math.log(3), abs=1e-12)
    # i = 3 > L: normaliser psi(3) = log 4; i - j = 2 -> log 3 / log 4
    assert m[1, 3, 1].item() == pytest.approx(math.log(3) / math.log(4), abs=1e-12)
    # i = 4, j = 0: psi(4) / psi(4) = 1
    assert m[0, 4, 0].item() == pytest.approx(1.0, abs=1e-12)
    assert torch.all(m.diagonal(dim1=-2, dim2=-1) == 0)
    enc2 = relu_fire(c=0.5, L=10.0)
    m2 = enc2.matrix(4)
    # i = 3 < L = 10: log(0.5 * 3 + 1) / log(0.5 * 10 + 1)
    assert m2[0, 3, 0].item() == pytest.approx(math.log(2.5) / math.log(6.0), abs=1e-12)


def naive(enc: FIRE, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    w1, b1 = enc.mlp[0].weight[:, 0].tolist(), enc.mlp[0].bias.tolist()
    w2, b2 = enc.mlp[2].weight.tolist(), enc.mlp[2].bias.tolist()
    c, L, eps = enc.c.item(), enc.L_multiplier.item() * enc.init_L_value, enc.eps
    b, lq, lk = max(q_pos.shape[0], k_pos.shape[0]), q_pos.shape[1], k_pos.shape[1]
    out = torch.zeros(b, enc.n_heads, lq, lk, dtype=torch.float64)
    for n in range(b):
        qp, kp = q_pos[min(n, q_pos.shape[0] - 1)], k_pos[min(n, k_pos.shape[0] - 1)]
        for i in range(lq):
            for j in range(lk):
                pi, pj = float(qp[i]), float(kp[j])
                x = math.log(c * abs(pi - pj) + 1) / (math.log(c * max(L, pi) + 1) + eps)
                hidden = [max(0.0, w1[u] * x + b1[u]) for u in range(len(w1))]
                for h in range(enc.n_heads):
                    out[n, h, i, j] = sum(w2[h][u] * hidden[u] for u in range(len(w1))) + b2[h]
    return out


def test_bias_equals_naive_loop() -> None:
    enc = FIRE(3, hidden=8, init_c=0.3, init_L=6.0).double()
    q_pos = torch.tensor([[2, 3, 4], [20, 21, 22]])
    k_pos = torch.tensor([[0, 1, 2, 3, 4], [0, 7, 20, 21, 22]])
    ctx = AttentionContext(q_pos=q_pos, k_pos=k_pos, n_heads=3, head_dim=4)
    assert torch.allclose(enc.bias(ctx), naive(enc, q_pos, k_pos), atol=1e-12)


def test_progressive_interpolation_farthest_key_is_f_of_one() -> None:
    enc = FIRE(H, init_L=16.0).double()
    f1 = enc.mlp(torch.ones(1, dtype=torch.float64))
    for n in (17, 40, 300):
        m = enc.matrix(n)
        assert torch.allclose(m[:, n - 1, 0], f1, atol=1e-5), n  # eps = 1e-6 shifts it slightly
        x = enc.normalized_distance(torch.arange(n)[None], torch.arange(n)[None])[0].detach()
        causal = torch.ones(n, n, dtype=torch.bool).tril()  # j <= i, where FIRE is defined
        assert float(x[causal].max()) <= 1.0 + 1e-12  # inputs stay in [0, 1]: interpolation, not extrapolation


def test_shift_invariant_below_threshold_only() -> None:
    enc = FIRE(H, init_L=64.0).double()
    mha = MultiHeadAttention(D, H, enc).double()
    x = torch.randn(1, 8, D, dtype=torch.float64)
    pos = torch.arange(8)
    a = mha(x, positions=pos, causal=True)
    assert torch.allclose(a, mha(x, positions=pos + 40, causal=True), atol=1e-10)  # all i <= L
    assert not torch.allclose(a, mha(x, positions=pos + 500, causal=True), atol=1e-6)  # i > L


def test_gradients_reach_every_parameter() -> None:
    enc = FIRE(H, init_L=8.0)
    mha = MultiHeadAttention(D, H, enc)
    x = torch.randn(2, 12, D)  # positions 0..11 straddle L = 8: both c and L matter
    mha(x, causal=True).square().sum().backward()
    for name, p in enc.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_fixed_threshold() -> None:
    enc = FIRE(H, learn_threshold=False)
    assert not enc.L_multiplier.requires_grad
    assert enc.threshold().item() == 512.0


def test_fast_equals_reference() -> None:
    torch.manual_seed(2)
    enc = FIRE(H, init_L=4.0).double()
    fast = MultiHeadAttention(D, H, enc, path="fast").double()
    ref = MultiHeadAttention(D, H, enc, path="reference").double()
    ref.load_state_dict(fast.state_dict())
    x = torch.randn(2, 7, D, dtype=torch.float64)
    pad = torch.tensor([[1] * 7, [0, 0, 1, 1, 1, 1, 1]])
    pos = torch.tensor([[30, 31, 32, 33, 34, 35, 36], [0, 1, 2, 3, 4, 5, 6]])
    for kw in (dict(causal=True), dict(attention_mask=pad), dict(causal=True, positions=pos, attention_mask=pad)):
        assert torch.allclose(fast(x, **kw), ref(x, **kw), atol=1e-10), kw


def test_model_layers_trains_and_longer_inputs() -> None:
    torch.manual_seed(0)
    model = posenc.LanguageModel(12, encoding="fire", d_model=16, n_heads=4, n_layers=2, d_ff=16, max_len=16)
    encs = [b.attn.encoding for b in model.trunk.blocks]
    assert encs[0] is not encs[1]  # one FIRE per layer by default
    shared = posenc.Decoder(12, encoding="fire", encoding_options={"shared": True}, d_model=16, n_heads=4)
    assert shared.blocks[0].attn.encoding is shared.blocks[1].attn.encoding  # FIRE-S
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        start = torch.randint(0, 12, (8, 1))
        loss = model.loss((start + torch.arange(12)) % 12)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    # last five / first five over seeds 0-5 (the manual_seed shifted), native kernels on and off: 0.17-0.24; no learning
    # stays near 1
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5
    model.eval()
    with torch.no_grad():
        logits = model(torch.randint(0, 12, (1, 200)))
    assert torch.isfinite(logits).all()


def test_card() -> None:
    card = posenc.card("fire")
    assert (card.family, card.position, card.learnable) == ("bias", "relative", True)


def test_bad_settings() -> None:
    for kwargs, word in (
        (dict(n_heads=0), "n_heads"),
        (dict(n_heads=4, hidden=0), "hidden"),
        (dict(n_heads=4, init_c=0.0), "init_c"),
        (dict(n_heads=4, init_L=-1.0), "init_L"),
        (dict(n_heads=4, eps=-1.0), "eps"),
    ):
        with pytest.raises(ConfigError, match=word):
            posenc.get("fire", **kwargs)
    ctx = AttentionContext(q_pos=torch.arange(3)[None], k_pos=torch.arange(3)[None], n_heads=2, head_dim=4)
    with pytest.raises(ConfigError, match="n_heads=4"):
        FIRE(4).bias(ctx)


@pytest.mark.parametrize("kernel", [True, False], ids=["native", "torch"])
@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10**6), hidden=st.integers(1, 12), zeros=st.integers(0, 3), heads=st.integers(1, 3))
def test_piecewise_linear_form_equals_the_mlp(kernel: bool, seed: int, hidden: int, zeros: int, heads: int) -> None:
    """The fast bias (knots + one multiply-add per pair; in C or in PyTorch ops) == the MLP on every pair: values and
    every gradient."""
    native.enabled = kernel
    try:
        _check_piecewise_equals_mlp(seed, hidden, zeros, heads)
    finally:
        native.enabled = True


def _check_piecewise_equals_mlp(seed: int, hidden: int, zeros: int, heads: int) -> None:
    torch.manual_seed(seed)
    enc = FIRE(heads, hidden=hidden, init_c=0.7, init_L=5.0).double()
    with torch.no_grad():
        for p in enc.mlp.parameters():
            p.normal_()
        enc.mlp[0].weight[: min(zeros, hidden)] = 0.0  # units that never switch
    pos = torch.arange(23)[None]
    out = []
    for reference in (False, True):
        ctx = AttentionContext(q_pos=pos, k_pos=pos, n_heads=heads, head_dim=4, reference=reference)
        bias = enc.bias(ctx)
        weight = torch.linspace(-1, 1, bias.numel(), dtype=bias.dtype).view_as(bias)
        out.append((bias, torch.autograd.grad((bias * weight).sum(), list(enc.parameters()), allow_unused=True)))
    torch.testing.assert_close(out[0][0], out[1][0], rtol=1e-12, atol=1e-12)
    for a, b in zip(out[0][1], out[1][1]):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
    knots, slope, intercept = enc.piecewise_linear()
    assert knots.numel() == hidden and slope.shape == intercept.shape == (hidden + 1, heads)
    assert int(torch.isfinite(knots).sum()) == hidden - min(zeros, hidden)  # a unit that never switches: +inf
