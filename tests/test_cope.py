"""CoPE against a naive float64 loop of the paper's equations (with the reference code's choices:
gates from q·k/√d, position term added after the temperature). Tolerance 1e-10 (float64)."""

from __future__ import annotations

import math

import pytest
import torch

import posenc
from posenc import ConfigError, MultiHeadAttention
from posenc.base import AttentionContext


def naive_cope_attention(q, k, v, emb, *, npos_max, causal=True, gate_scale=True):
    """q, k, v: [Lq|Lk, d] for one head with positions 0..L-1; emb [d, npos_max]. Returns (logits, output)."""
    lq, d = q.shape
    lk = k.shape[0]
    s = 1 / math.sqrt(d)
    gs = s if gate_scale else 1.0
    logits = torch.full((lq, lk), -math.inf, dtype=q.dtype)
    for i in range(lq):
        for j in range(lk):
            if causal and j > i:
                continue
            last = i if causal else lk - 1
            p = sum(torch.sigmoid(q[i] @ k[t] * gs) for t in range(j, last + 1))
            p = min(float(p.detach()), npos_max - 1)
            lo, hi = math.floor(p), math.ceil(p)
            e = (p - lo) * emb[:, hi] + (1 - p + lo) * emb[:, lo]
            logits[i, j] = q[i] @ k[j] * s + q[i] @ e
    probs = torch.softmax(logits, -1)
    return logits, probs @ v


def random_cope(npos_max=6, **opts):
    torch.manual_seed(0)
    enc = posenc.get("cope", head_dim=4, npos_max=npos_max, **opts)
    with torch.no_grad():
        enc.pos_emb.normal_()
    return enc


@pytest.mark.parametrize("npos_max", [3, 16])
@pytest.mark.parametrize("gate_scale", [True, False])
@pytest.mark.parametrize("path", ["fast", "reference"])
def test_attention_equals_naive_loop(npos_max, gate_scale, path):
    enc = random_cope(npos_max, gate_scale=gate_scale)
    att = MultiHeadAttention(8, 2, enc, path=path).double()
    x = torch.randn(2, 7, 8, dtype=torch.float64)
    got = att(x, causal=True)
    q = att._split(att.q_proj(x))
    k = att._split(att.k_proj(x))
    v = att._split(att.v_proj(x))
    emb = enc.pos_emb.detach().double()
    heads = torch.empty_like(q)
    for b in range(2):
        for h in range(2):
            _, heads[b, h] = naive_cope_attention(
                q[b, h], k[b, h], v[b, h], emb, npos_max=npos_max, gate_scale=gate_scale
            )
    expect = att.o_proj(heads.transpose(1, 2).reshape(2, 7, 8))
    torch.testing.assert_close(got, expect, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("literal", [False, True])
def test_logits_hook_equals_naive_loop_on_visible_entries(literal):
    enc = random_cope(5)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 1, 6, 4, dtype=torch.float64, generator=g) * 2
    k = torch.randn(1, 1, 6, 4, dtype=torch.float64, generator=g) * 2
    pos = torch.arange(6)[None]
    ctx = AttentionContext(q_pos=pos, k_pos=pos, n_heads=1, head_dim=4, reference=literal)
    scale = 4**-0.5
    got = (q @ k.transpose(-1, -2) + enc.logits(q, k, ctx)) * scale
    expect, _ = naive_cope_attention(q[0, 0], k[0, 0], k[0, 0], enc.pos_emb.detach().double(), npos_max=5)
    visible = torch.ones(6, 6, dtype=torch.bool).tril()
    torch.testing.assert_close(got[0, 0][visible], expect[visible], rtol=1e-10, atol=1e-10)


def test_non_causal_counts_all_later_keys_as_the_reference_code_without_mask():
    enc = random_cope(8, causal=False)
    x = torch.randn(1, 5, 8, dtype=torch.float64)
    att = MultiHeadAttention(8, 2, enc, path="reference").double()
    got = att(x)
    q, k, v = (att._split(p(x)) for p in (att.q_proj, att.k_proj, att.v_proj))
    heads = torch.stack(
        [
            naive_cope_attention(q[0, h], k[0, h], v[0, h], enc.pos_emb.detach().double(), npos_max=8, causal=False)[1]
            for h in range(2)
        ]
    )[None]
    torch.testing.assert_close(got, att.o_proj(heads.transpose(1, 2).reshape(1, 5, 8)), rtol=1e-10, atol=1e-10)


def attention_pair(**opts):
    enc = random_cope(6, **opts)
    fast = MultiHeadAttention(8, 2, enc, path="fast").double()
    ref = MultiHeadAttention(8, 2, enc, path="reference").double()
    ref.load_state_dict(fast.state_dict())
    return fast, ref


@pytest.mark.parametrize("offset", [0, 11])
@pytest.mark.parametrize("causal", [True, False])
def test_fast_equals_reference_with_masks_and_offsets(offset, causal):
    fast, ref = attention_pair(causal=causal)
    x = torch.randn(2, 9, 8, dtype=torch.float64)
    pos = torch.arange(offset, offset + 9)[None].repeat(2, 1)
    pos[1] += 4
    pad = torch.ones(2, 9, dtype=torch.bool)
    pad[1, -2:] = False
    for kw in (dict(causal=causal), dict(causal=causal, attention_mask=pad)):
        torch.testing.assert_close(fast(x, positions=pos, **kw), ref(x, positions=pos, **kw), rtol=1e-10, atol=1e-10)


def test_translation_invariance_and_kv_cache():
    fast, _ = attention_pair()
    x = torch.randn(1, 8, 8, dtype=torch.float64)
    full = fast(x, causal=True)
    torch.testing.assert_close(fast(x, positions=torch.arange(8) + 100, causal=True), full, rtol=1e-10, atol=1e-10)
    cache = posenc.KVCache()
    steps = [fast(x[:, :3], causal=True, kv_cache=cache)]
    steps += [fast(x[:, t : t + 1], causal=True, kv_cache=cache) for t in range(3, 8)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-10, atol=1e-10)


def test_causal_use_future_keys_do_not_change_past_outputs():
    fast, _ = attention_pair()
    x = torch.randn(1, 8, 8, dtype=torch.float64)
    y = x.clone()
    y[:, 5:] = torch.randn(1, 3, 8, dtype=torch.float64)
    torch.testing.assert_close(fast(x, causal=True)[:, :5], fast(y, causal=True)[:, :5], rtol=1e-12, atol=1e-12)


def test_gradients_reach_every_parameter_and_long_sequences_are_finite():
    fast, _ = attention_pair()
    x = torch.randn(1, 40, 8, dtype=torch.float64, requires_grad=True)  # far beyond npos_max = 6
    out = fast(x, causal=True)
    assert torch.isfinite(out).all()
    out.square().mean().backward()
    for name, p in fast.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert fast.encoding.pos_emb.grad.abs().sum() > 0


def test_language_model_trains_and_layers_get_their_own_tables():
    torch.manual_seed(0)
    model = posenc.LanguageModel(
        10, encoding="cope", encoding_options=dict(npos_max=8), d_model=16, n_layers=2, n_heads=2, d_ff=32
    )
    tables = {id(b.attn.encoding.pos_emb) for b in model.trunk.blocks}
    assert len(tables) == 2
    opt = torch.optim.Adam(model.parameters(), lr=2e-2)
    data = torch.randint(0, 10, (8, 6))
    data = torch.cat([data, data], 1)
    losses = []
    for _ in range(30):
        loss = model.loss(data)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.75 * losses[0]
    assert all(b.attn.encoding.pos_emb.abs().sum() > 0 for b in model.trunk.blocks)
    with torch.no_grad():
        assert torch.isfinite(model(torch.randint(0, 10, (2, 40)))).all()


@pytest.mark.parametrize(
    "opts,match",
    [
        (dict(head_dim=0), "head_dim"),
        (dict(head_dim=4, npos_max=1), "npos_max"),
        (dict(head_dim=4, npos_max=2.5), "npos_max"),
    ],
)
def test_bad_settings(opts, match):
    with pytest.raises(ConfigError, match=match):
        posenc.get("cope", **opts)


def test_wrong_head_dim_at_construction_and_at_call():
    enc = posenc.get("cope", head_dim=4)
    with pytest.raises(ConfigError, match="'cope' was built for head_dim=4 but is used with head_dim=6"):
        MultiHeadAttention(12, 2, enc)  # head_dim 6
    att = MultiHeadAttention(12, 2, posenc.get("cope", head_dim=6))
    att.encoding = enc  # swapped in after construction: the call still checks
    with pytest.raises(ConfigError, match="head_dim=4"):
        att(torch.randn(1, 3, 12))


def test_a_decoding_step_computes_q_k_once_for_the_gates_and_the_scores(monkeypatch):
    """One query: the materialised kernel computes q·kᵀ and hands it to the gates (ctx.scores); same numbers."""
    from posenc.bias.cope import CoPE

    seen = []
    real = CoPE.gates
    monkeypatch.setattr(
        CoPE, "gates", lambda self, q, k, ctx: seen.append(ctx.scores is not None) or real(self, q, k, ctx)
    )
    torch.manual_seed(0)
    model = posenc.LanguageModel(20, encoding="cope", d_model=16, n_heads=2, n_layers=2, max_len=32).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))  # pos_emb off its zero initialisation
    tokens = torch.randint(0, 20, (2, 12))
    with torch.no_grad():
        full = model(tokens)
        cache = posenc.KVCache()
        steps = [model(tokens[:, :8], kv_cache=cache)]
        seen.clear()
        steps += [model(tokens[:, t : t + 1], kv_cache=cache) for t in range(8, 12)]
    assert seen and all(seen)  # every decoding step's gates reused the kernel's q·kᵀ
    assert all(b.attn.last_plan.kernel == "materialised" for b in model.trunk.blocks)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-10, atol=1e-11)
