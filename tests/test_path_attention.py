"""PaTH (Yang et al. 2025): the logits against the paper's product of d x d matrices written out per pair, causal and
not, gradients, the identity transforms, padding and the KV cache, grouped keys, and the length limits."""

from __future__ import annotations

import math

import pytest
import torch
from cache_steps import cached_steps

import posenc
from posenc import MultiHeadAttention
from posenc.errors import ConfigError
from posenc.relative import path_attention as pa

D, H = 12, 3
DH = D // H


def _layer(seed: int = 0) -> MultiHeadAttention:
    torch.manual_seed(seed)
    return MultiHeadAttention(D, H, posenc.get("path", n_heads=H, head_dim=DH)).double()


def _literal(layer: MultiHeadAttention, x: torch.Tensor, causal: bool) -> torch.Tensor:
    """softmax_j(q_i^T H_i H_{i-1} ... H_{j+1} k_j / sqrt(d)) v_j with H_t = I - β_t w_t w_t^T as matrices, w_t =
    W_w k_t normalised and β_t = 2σ(W_β k_t + b) from the keys of every head of token t; for j > i (no mask) the
    transforms of the tokens i+1 .. j, from the query's side."""
    enc = layer.encoding
    b, n, _ = x.shape
    q = layer.q_proj(x).view(b, n, H, DH)
    k = layer.k_proj(x).view(b, n, H, DH)
    v = layer.v_proj(x).view(b, n, H, DH)
    ww, wb, bb = enc.w_proj.weight, enc.beta_proj.weight, enc.beta_proj.bias
    out = torch.zeros(b, n, H, DH, dtype=x.dtype)
    for bi in range(b):
        keys_t = k[bi].reshape(n, H * DH)
        for h in range(H):

            def householder(t: int, h: int = h, keys_t: torch.Tensor = keys_t) -> torch.Tensor:
                w = ww[h * DH : (h + 1) * DH] @ keys_t[t]
                w = w / w.norm()
                beta = 2.0 / (1.0 + math.exp(-float(wb[h] @ keys_t[t] + bb[h])))
                return torch.eye(DH, dtype=x.dtype) - beta * torch.outer(w, w)

            for i in range(n):
                keys = list(range(i + 1)) if causal else list(range(n))
                logits = []
                for j in keys:
                    m = torch.eye(DH, dtype=x.dtype)
                    for t in range(i, j, -1) if j <= i else range(i + 1, j + 1):
                        m = m @ householder(t)
                    logits.append(float(q[bi, i, h] @ m @ k[bi, j, h]) / math.sqrt(DH))
                p = torch.softmax(torch.tensor(logits, dtype=x.dtype), 0)
                for pj, j in zip(p, keys):
                    out[bi, i, h] += pj * v[bi, j, h]
    return layer.o_proj(out.reshape(b, n, D))


@pytest.mark.parametrize("causal", [True, False])
def test_the_paper_product_of_matrices(causal: bool) -> None:
    layer = _layer()
    x = torch.randn(2, 6, D, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(layer(x, causal=causal), _literal(layer, x, causal), rtol=1e-10, atol=1e-12)


def test_no_transform_is_plain_attention_and_a_transform_changes_the_scores() -> None:
    torch.manual_seed(1)
    q, k = torch.randn(1, 2, 5, 4, dtype=torch.float64), torch.randn(1, 2, 5, 4, dtype=torch.float64)
    w = torch.nn.functional.normalize(torch.randn(1, 2, 5, 4, dtype=torch.float64), dim=-1)
    plain = q @ k.transpose(-1, -2)
    torch.testing.assert_close(pa.path_logits(q, k, w, torch.zeros(1, 2, 5, dtype=torch.float64)), plain)
    got = pa.path_logits(q, k, w, torch.full((1, 2, 5), 2.0, dtype=torch.float64))
    torch.testing.assert_close(got.diagonal(dim1=-2, dim2=-1), plain.diagonal(dim1=-2, dim2=-1))  # j = i: none
    assert not torch.allclose(got.tril(-1), plain.tril(-1))
    # a reflection (β = 2) keeps the norm: |q_i^T H ... H| = |q_i|
    r = q[0, 0, 4] @ (torch.eye(4, dtype=torch.float64) - 2 * torch.outer(w[0, 0, 4], w[0, 0, 4]))
    torch.testing.assert_close(r.norm(), q[0, 0, 4].norm())


def test_gradients() -> None:
    torch.manual_seed(2)
    q, k = (torch.randn(1, 1, 4, 3, dtype=torch.float64, requires_grad=True) for _ in range(2))
    w = torch.randn(1, 1, 4, 3, dtype=torch.float64, requires_grad=True)
    beta = torch.rand(1, 1, 4, dtype=torch.float64, requires_grad=True)

    def fn(q, k, w, beta):
        return pa.path_logits(q, k, torch.nn.functional.normalize(w, dim=-1), 2 * beta)

    assert torch.autograd.gradcheck(fn, (q, k, w, beta))
    layer = _layer(seed=3)
    x = torch.randn(1, 5, D, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: layer(t, causal=True), (x,))


def test_left_padding_kv_cache_and_grouped_keys() -> None:
    layer = _layer(seed=4)
    x = torch.randn(2, 10, D, dtype=torch.float64)
    pad = 3
    batch = torch.cat([x[:1], torch.cat([torch.randn(1, pad, D, dtype=torch.float64), x[1:, :-pad]], 1)])
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[1, :pad] = False
    with torch.no_grad():
        out = layer(batch, causal=True, attention_mask=mask)
        torch.testing.assert_close(out[1, pad:], layer(x[1:, :-pad], causal=True)[0], rtol=1e-10, atol=1e-12)
        want = layer(x, causal=True)
        torch.testing.assert_close(cached_steps(layer, x, 4)[0], want, rtol=1e-10, atol=1e-12)
    enc = posenc.get("path", n_heads=4, head_dim=2)
    k = torch.randn(1, 2, 5, 2)
    w, beta = enc.transforms(k)
    w2, beta2 = enc.transforms(k.repeat_interleave(2, dim=1))
    torch.testing.assert_close(w, w2)
    torch.testing.assert_close(beta, beta2)
    with pytest.raises(ConfigError, match="keys of 3 heads"):
        enc.transforms(torch.randn(1, 3, 5, 2))


def test_a_call_too_long_is_refused_with_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = _layer(seed=5).float()
    monkeypatch.setattr(pa, "MAX_KEYS", 8)
    with pytest.raises(ConfigError, match="a call of 9 keys is more than its limit of 8"):
        with torch.no_grad():
            layer(torch.randn(1, 9, D))
    monkeypatch.setattr(pa, "MAX_KEYS", 4096)
    monkeypatch.setattr(pa, "MAX_GRAD_NUMBERS", 1000)
    x = torch.randn(2, 8, D)
    with pytest.raises(ConfigError, match=r"2 x 3 x 8 x 8 x 4 numbers, more than its limit of 1000"):
        layer(x, causal=True)
    with torch.no_grad():  # without a gradient the steps keep nothing
        assert layer(x, causal=True).shape == x.shape


def test_a_model_trains_with_it() -> None:
    torch.manual_seed(6)
    lm = posenc.LanguageModel(30, d_model=D, n_heads=H, n_layers=2, encoding="path")
    opt = torch.optim.Adam(lm.parameters(), lr=1e-2)
    data = torch.arange(30).repeat(4, 2)[:, :32]
    losses = []
    for _ in range(60):
        loss = lm.loss(data)
        losses.append(float(loss.detach()))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert losses[-1] < 0.5 * losses[0]
