"""p-RoPE and HoPE: RoPE with its low frequencies removed.

p-RoPE against transformers' Gemma 4 "proportional" RoPE (its rotary embedding and apply_rotary_pos_emb: the same
weights of every pair, bit for bit, float32 and float64) and against the paper's formula written out; HoPE against
its formula written out (a naive loop over the pairs, float64). Both: p = 1 is RoPE, p -> 0 is NoPE, relative-only
scores, the SDPA kernel through MultiHeadAttention, a KV cache giving the full forward's numbers, and bad settings.
"""

from __future__ import annotations

import math

import pytest
import torch

import posenc
from posenc import ConfigError, MultiHeadAttention
from posenc.base import AttentionContext

F64 = torch.float64


def naive_truncated_rope(x: torch.Tensor, pos: list[int], *, d: int, base: float, keep) -> torch.Tensor:
    """The formula, pair by pair: pair ``(i, i + d/2)`` rotates by ``m · base^{-2i/d}`` where ``keep(i, θ_i)``, else
    by 0 (``x`` ``[L, d]`` float64)."""
    out = x.clone()
    for t, m in enumerate(pos):
        for i in range(d // 2):
            theta = base ** (-2 * i / d)
            phi = m * theta if keep(i, theta) else 0.0
            c, s = math.cos(phi), math.sin(phi)
            a, b = x[t, i].item(), x[t, i + d // 2].item()
            out[t, i], out[t, i + d // 2] = a * c - b * s, b * c + a * s
    return out


def rotate(enc, q, k, qpos, kpos=None):
    kpos = qpos if kpos is None else kpos
    ctx = AttentionContext(q_pos=qpos, k_pos=kpos, n_heads=q.shape[1], head_dim=q.shape[-1])
    return enc.rotate(q, k, ctx)


# ------------------------------------------------------------------------------------------------ p-RoPE
def gemma4_full_attention_rotary(head_dim: int, p: float, base: float):
    from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding

    cfg = Gemma4TextConfig(
        hidden_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=head_dim,
        global_head_dim=head_dim,
        num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": base},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": p, "rope_theta": base},
        },
    )
    return Gemma4TextRotaryEmbedding(cfg)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize(
    "head_dim,p,base", [(16, 0.25, 10000.0), (64, 0.25, 1e6), (32, 0.75, 10000.0), (24, 0.5, 500.0)]
)
def test_p_rope_is_gemma4_proportional_rope(head_dim, p, base, dtype):
    from transformers.models.gemma4.modeling_gemma4 import apply_rotary_pos_emb

    hf = gemma4_full_attention_rotary(head_dim, p, base)
    enc = posenc.get("p-rope", head_dim=head_dim, p=p, base=base)
    assert torch.equal(enc.inv_freq, hf.full_attention_inv_freq)  # the kept frequencies and the zeros
    assert enc.kept == int(p * head_dim // 2) == int((hf.full_attention_inv_freq > 0).sum())
    g = torch.Generator().manual_seed(head_dim)
    pos = torch.tensor([[0, 1, 2, 7, 100, 4095, 70_000, 1 << 20], [3, 5, 8, 13, 21, 34, 55, 89]])
    q = torch.randn(2, 3, 8, head_dim, generator=g, dtype=dtype)
    k = torch.randn(2, 3, 8, head_dim, generator=g, dtype=dtype)
    cos, sin = hf(q, pos, "full_attention")  # [B, L, d], the halves repeated
    mine_cos, mine_sin = enc.cos_sin(pos)
    assert torch.equal(mine_cos.to(dtype), cos[..., : head_dim // 2]) and torch.equal(
        cos[..., head_dim // 2 :], cos[..., : head_dim // 2]
    )
    assert torch.equal(mine_sin.to(dtype), sin[..., : head_dim // 2])
    rq, rk = rotate(enc, q, k, pos)
    # the rotation: bit for bit with posenc.native's kernel; PyTorch's path (POSENC_NATIVE=0) may differ by an ulp
    tol = dict(rtol=0, atol=4 * torch.finfo(dtype).eps * 8)
    torch.testing.assert_close(rq, apply_rotary_pos_emb(q, cos, sin), **tol)
    torch.testing.assert_close(rk, apply_rotary_pos_emb(k, cos, sin), **tol)


def test_p_rope_equals_its_formula_written_out():
    d, base, p = 12, 10000.0, 0.5
    enc = posenc.get("p-rope", head_dim=d, p=p, base=base)
    pos = [0, 1, 5, 17, 300, 2048]
    x = torch.randn(1, 1, len(pos), d, dtype=F64)
    got = enc(x, torch.tensor(pos))[0, 0]
    want = naive_truncated_rope(x[0, 0], pos, d=d, base=base, keep=lambda i, th: i < 3)  # ⌊0.5 · 12 / 2⌋ = 3
    # float32 phases: |Δφ| <= m·θ·2^-24 (2048 · 6e-8 = 1.2e-4 rad here), as RoPE's
    torch.testing.assert_close(got, want, rtol=0, atol=4 * 2048 * 2.0**-24 * float(x.abs().max()))
    assert torch.equal(got[:, 3:6], x[0, 0, :, 3:6]) and torch.equal(got[:, 9:], x[0, 0, :, 9:])  # unrotated


def test_p_one_is_rope_exactly():
    for d in (8, 64):
        a, b = posenc.get("p-rope", head_dim=d, p=1.0), posenc.get("rope", head_dim=d)
        assert torch.equal(a.inv_freq, b.inv_freq) and a.kept == d // 2
        q, k = torch.randn(2, 2, 9, d), torch.randn(2, 2, 9, d)
        pos = torch.arange(3, 12)[None]
        for x, y in zip(rotate(a, q, k, pos), rotate(b, q, k, pos), strict=True):
            assert torch.equal(x, y)


def test_p_towards_zero_keeps_fewer_frequencies_and_a_p_that_keeps_none_is_refused():
    d = 32
    kept = [posenc.get("p-rope", head_dim=d, p=p).kept for p in (1.0, 0.75, 0.5, 0.25, 0.1, 2 / d)]
    assert kept == [16, 12, 8, 4, 1, 1]
    for p in (1 / d, 0.03):  # int(p * d // 2) = 0 pairs: NoPE in disguise (issue 48), refused with the smallest p
        with pytest.raises(ConfigError, match=r"smallest p that keeps one pair is 2 / head_dim = 0.0625"):
            posenc.get("p-rope", head_dim=d, p=p)
    torch.manual_seed(0)
    nope = MultiHeadAttention(d, 1, None).double()
    x = torch.randn(2, 10, d, dtype=F64)
    want = nope(x, causal=True)
    attn = MultiHeadAttention(d, 1, posenc.get("p-rope", head_dim=d, p=2 / d)).double()
    attn.load_state_dict(nope.state_dict())
    assert (attn(x, causal=True) - want).abs().max() > 1e-3  # one pair (the highest frequency) carries the position


@pytest.mark.parametrize("name,opts", [("p-rope", dict(p=0.5)), ("hope", dict(max_len=64))])
def test_scores_depend_on_the_offset_only(name, opts):
    enc = posenc.get(name, head_dim=16, **opts)
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 2, 6, 16, generator=g, dtype=F64), torch.randn(1, 2, 6, 16, generator=g, dtype=F64)
    pos = torch.tensor([[0, 3, 4, 9, 20, 21]])
    rq, rk = rotate(enc, q, k, pos)
    for shift in (1, 37, 500):  # float32 phases: errors of m·2^-24 rad
        sq, sk = rotate(enc, q, k, pos + shift)
        torch.testing.assert_close(sq @ sk.transpose(-1, -2), rq @ rk.transpose(-1, -2), rtol=0, atol=2e-4)
    moved = pos.clone()
    moved[0, 2] += 1  # not a shift of every position: the scores change
    mq, mk = rotate(enc, q, k, moved)
    assert (mq @ mk.transpose(-1, -2) - rq @ rk.transpose(-1, -2)).abs().max() > 1e-2


# ------------------------------------------------------------------------------------------------ HoPE
def test_hope_equals_its_formula_written_out():
    d, base, L = 16, 10000.0, 64
    enc = posenc.get("hope", head_dim=d, max_len=L, base=base)
    # θ_i L >= 2π  <=>  10000^(-i/8) >= 2π/64 = 0.0982: i = 0, 1, 2 (0.0998 at i = 2, 0.0316 at i = 3)
    assert enc.kept == 2 + 1
    pos = [0, 1, 2, 9, 63, 64, 1000]
    x = torch.randn(1, 1, len(pos), d, dtype=F64)
    got = enc(x, torch.tensor(pos))[0, 0]
    want = naive_truncated_rope(x[0, 0], pos, d=d, base=base, keep=lambda i, th: th * L >= 2 * math.pi)
    torch.testing.assert_close(got, want, rtol=0, atol=4 * 1000 * 2.0**-24 * float(x.abs().max()))  # float32 phases
    assert torch.equal(got[:, 3:8], x[0, 0, :, 3:8]) and torch.equal(got[:, 11:], x[0, 0, :, 11:])
    # every kept component turns fully within L; the first one dropped does not
    assert float(enc.inv_freq[enc.kept - 1]) * L >= 2 * math.pi > float(base ** (-2 * enc.kept / d)) * L


def test_hope_keeps_more_components_for_longer_training_and_refuses_none_below_two_pi():
    counts = [posenc.get("hope", head_dim=64, max_len=n).kept for n in (7, 64, 512, 4096, 1 << 20)]
    assert counts == [1, 9, 16, 23, 32]  # θ_i = 10^(-i/8) >= 2π/L; θ_31 · 2^20 = 1.3·10^-4 · 2^20 > 2π: all
    for n in (1, 6):  # 2π·1 fits in 7 positions, not in 6: no pair would rotate (NoPE in disguise, issue 48)
        with pytest.raises(ConfigError, match="the smallest max_len that keeps one pair is 7"):
            posenc.get("hope", head_dim=64, max_len=n)


def test_hope_has_no_long_term_decay_where_rope_has():
    """The paper's point: the mean score of a fixed q = k content against the offset does not fall with |k|."""

    def trend(name, **opts):
        enc = posenc.get(name, head_dim=64, **opts)
        g = torch.Generator().manual_seed(0)
        v = torch.randn(64, 1, 1, 64, generator=g, dtype=F64)
        n = 512
        pos = torch.arange(n)[None]
        q = v.expand(-1, -1, n, -1)
        rq, rk = rotate(enc, q, q.clone(), pos)
        s = (rq[:, :, :1] * rk).sum(-1).mean(0)[0]  # the score of query 0 against keys 0..n-1, mean over draws
        ranks = torch.arange(n, dtype=F64)
        r = torch.corrcoef(torch.stack([ranks, s.argsort().argsort().to(F64)]))[0, 1]
        return float(r), float(s[: n // 16].mean()), float(s[-n // 4 :].mean())

    rope_r, _, _ = trend("rope")
    hope_r, near, far = trend("hope", max_len=64)
    assert rope_r < -0.5  # RoFormer's decay on the same probe
    assert abs(hope_r) < 0.3 and far > 0.3 * near


# ------------------------------------------------------------------------------------------------ both
@pytest.mark.parametrize("name,opts", [("p-rope", dict(p=0.25)), ("hope", dict(max_len=32))])
def test_attention_takes_sdpa_and_a_kv_cache_gives_the_full_forward(name, opts):
    torch.manual_seed(0)
    attn = MultiHeadAttention(32, 2, posenc.get(name, head_dim=16, **opts)).double().eval()
    x = torch.randn(2, 9, 32, dtype=F64)
    full = attn(x, causal=True)
    assert attn.last_plan is not None and attn.last_plan.kernel == "sdpa", str(attn.last_plan)
    cache = posenc.KVCache()
    steps = [attn(x[:, :4], causal=True, kv_cache=cache)]
    steps += [attn(x[:, t : t + 1], causal=True, kv_cache=cache) for t in range(4, 9)]
    assert all(attn.last_plan.kernel == "sdpa" for _ in [0])
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-12, atol=1e-12)

    torch.manual_seed(1)
    lm = posenc.LanguageModel(40, d_model=32, n_heads=2, n_layers=2, encoding=name, encoding_options=opts, max_len=32)
    lm = lm.double().eval()
    tokens = torch.randint(0, 40, (2, 12))
    with torch.no_grad():
        whole = lm(tokens)
        kv = posenc.KVCache()
        parts = [lm(tokens[:, :5], kv_cache=kv)] + [lm(tokens[:, t : t + 1], kv_cache=kv) for t in range(5, 12)]
    torch.testing.assert_close(torch.cat(parts, 1), whole, rtol=1e-10, atol=1e-10)
    assert lm.decoding_mode(4, 8)[0] == "cache"
    prompt = tokens[:, :4]
    assert torch.equal(lm.generate(prompt, 8), lm.generate(prompt, 8, use_cache=False))


@pytest.mark.parametrize("name,opts", [("p-rope", dict(p=0.5)), ("hope", dict(max_len=16))])
def test_a_language_model_learns_with_it(name, opts):
    """Predict the token two places back: needs positions (a causal NoPE model learns it too, slower)."""
    torch.manual_seed(0)
    lm = posenc.LanguageModel(8, d_model=32, n_heads=2, n_layers=1, encoding=name, encoding_options=opts, max_len=16)
    opt = torch.optim.Adam(lm.parameters(), lr=1e-2)
    x = torch.randint(0, 8, (32, 16))
    y = torch.cat([torch.zeros(32, 2, dtype=torch.long), x[:, :-2]], 1)
    first = last = None
    for _ in range(60):
        loss = torch.nn.functional.cross_entropy(lm(x).reshape(-1, 8), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = loss.item() if first is None else first
        last = loss.item()
    assert last < 0.5 * first


@pytest.mark.parametrize("p", [0, 0.0, -0.5, 1.5, 2, float("nan"), float("inf")])
def test_p_outside_zero_one_is_refused_with_its_value(p):
    with pytest.raises(ConfigError, match=r"p must be") as err:
        posenc.get("p-rope", head_dim=16, p=p)
    assert repr(p) in str(err.value) or str(p) in str(err.value)


@pytest.mark.parametrize(
    "name,opts,match",
    [
        ("p-rope", dict(head_dim=15), "head_dim must be a positive even integer, got 15; use head_dim=14 or 16"),
        ("hope", dict(head_dim=9, max_len=64), "got 9; use head_dim=8 or 10"),
        ("p-rope", dict(head_dim=16, p="half"), "p must be a number"),
        ("p-rope", dict(head_dim=16, base=1.0), "base"),
        ("hope", dict(head_dim=16, max_len=0), "max_len"),
        ("hope", dict(head_dim=16), "needs 'max_len'"),
    ],
)
def test_bad_settings(name, opts, match):
    with pytest.raises(ConfigError, match=match):
        posenc.get(name, **opts)
