"""RoPE in both layouts: against HF transformers' implementations and against its defining property."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import posenc
from posenc.base import AttentionContext
from posenc.errors import ConfigError, PositionError


def ctx(q_pos, k_pos, h=2, d=8):
    return AttentionContext(q_pos=q_pos, k_pos=k_pos, n_heads=h, head_dim=d)


@pytest.mark.parametrize("rotary_dim", [None, 8])
def test_rotate_half_equals_hf_llama(rotary_dim):
    pytest.importorskip("transformers")
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    d, b, h, n = 16, 2, 3, 9
    r = rotary_dim or d
    cfg = LlamaConfig(hidden_size=d * h, num_attention_heads=h, head_dim=r, max_position_embeddings=64)
    rot = LlamaRotaryEmbedding(cfg)
    q, k = torch.randn(b, h, n, d), torch.randn(b, h, n, d)
    pos = torch.stack([torch.arange(n), torch.arange(5, 5 + n)])  # per-row positions (an offset)
    cos, sin = rot(q, pos)
    qh, kh = apply_rotary_pos_emb(q[..., :r], k[..., :r], cos, sin)  # partial: rotate the first r dims
    want_q = torch.cat([qh, q[..., r:]], -1)
    want_k = torch.cat([kh, k[..., r:]], -1)
    enc = posenc.get("rope", head_dim=d, rotary_dim=rotary_dim)
    got_q, got_k = enc.rotate(q, k, ctx(pos, pos, h, d))
    assert torch.allclose(got_q, want_q, atol=1e-6)
    assert torch.allclose(got_k, want_k, atol=1e-6)


def test_rotate_every_two_equals_hf_roformer_and_seed001():
    pytest.importorskip("transformers")
    from transformers.models.roformer.modeling_roformer import (
        RoFormerSelfAttention,
        RoFormerSinusoidalPositionalEmbedding,
    )

    d, b, h, n = 16, 2, 3, 11
    table = RoFormerSinusoidalPositionalEmbedding(64, d)
    table.weight.data = table.create_weight()
    q, k = torch.randn(b, h, n, d), torch.randn(b, h, n, d)
    sinusoidal_pos = table(torch.Size([b, n]))[None, None]
    want_q, want_k = RoFormerSelfAttention.apply_rotary_position_embeddings(sinusoidal_pos, q, k)
    enc = posenc.get("rope-interleaved", head_dim=d)
    pos = torch.arange(n)[None]
    got_q, got_k = enc.rotate(q, k, ctx(pos, pos, h, d))
    assert torch.allclose(got_q, want_q, atol=1e-5)
    assert torch.allclose(got_k, want_k, atol=1e-5)

    # forward_rope of anon., "Positional encoding of the Transformer":
    # emb = cat(sin, cos) of pos*inv_freq; sin, cos repeated '(d 2)'; rotate_every_two
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    ang = torch.arange(n).float()[:, None] * inv
    sin, cos = ang.sin().repeat_interleave(2, -1), ang.cos().repeat_interleave(2, -1)
    x1, x2 = q[..., 0::2], q[..., 1::2]
    rot = torch.stack([-x2, x1], -1).flatten(-2)
    assert torch.allclose(got_q, q * cos + rot * sin, atol=1e-5)


@settings(max_examples=25, deadline=None)
@given(
    i=st.integers(0, 3000),
    j=st.integers(0, 3000),
    shift=st.integers(0, 3000),
    layout=st.sampled_from(["rope", "rope-interleaved"]),
)
def test_score_depends_on_offset_only(i, j, shift, layout):
    # RoFormer: (R_m q)^T (R_n k) = q^T R_{n-m} k
    g = torch.Generator().manual_seed(i * 7 + j)
    q, k = torch.randn(1, 1, 1, 32, generator=g).double(), torch.randn(1, 1, 1, 32, generator=g).double()
    enc = posenc.get(layout, head_dim=32).double()  # the phases stay float32 (as HF's)

    def score(a, b):
        qa, kb = enc.rotate(q, k, ctx(torch.tensor([[a]]), torch.tensor([[b]]), 1, 32))
        return float((qa * kb).sum())

    # pair i contributes |q_i||k_i| cos(angle difference); each float32 angle m·θ_i is off by up to
    # m·θ_i·2^-24 (the rounded product) and each float32 cos / sin by 2^-24
    def pair_norms(v):  # pairs (2i, 2i+1) or (i, i+16)
        return v.view(16, 2).norm(dim=-1) if layout == "rope-interleaved" else v.view(2, 16).norm(dim=0)

    size = pair_norms(q.flatten()) * pair_norms(k.flatten())
    tol = float((size * (2 * (i + j + shift) * enc.inv_freq.double() * 2**-24 + 2**-21)).sum()) + 1e-12
    assert score(i, j) == pytest.approx(score(i + shift, j + shift), abs=tol)


def test_phases_in_float32_for_half_precision_inputs():
    enc = posenc.get("rope", head_dim=64)
    pos = torch.tensor([[4000, 4001]])
    q = torch.randn(1, 1, 2, 64)
    ref, _ = enc.rotate(q, q, ctx(pos, pos, 1, 64))
    got, _ = enc.rotate(q.bfloat16(), q.bfloat16(), ctx(pos, pos, 1, 64))
    assert got.dtype == torch.bfloat16
    # the only error is bf16 rounding of the output, not of the phase (a bf16 phase at 4000 is off by ~16 rad)
    assert torch.allclose(got.float(), ref, atol=0.05)
    a = pos[..., None].bfloat16() * enc.inv_freq.bfloat16()
    bad = q[..., :32] * a.cos().float() - q[..., 32:] * a.sin().float()
    assert (bad - ref[..., :32]).abs().max() > 0.2  # what computing the phase in bf16 would give


def test_cos_sin_table_is_shared_not_recomputed_per_layer(monkeypatch):
    model = posenc.Decoder(30, encoding="rope", d_model=32, n_heads=4, n_layers=3)
    enc = model.encoding
    calls = []
    original = enc.angles
    monkeypatch.setattr(enc, "angles", lambda p: calls.append(p.shape) or original(p))
    tokens = torch.randint(0, 30, (2, 10))
    model(tokens)
    assert len(calls) == 1  # the table is built once, for every layer
    calls.clear()
    model(tokens)
    assert calls == []  # and kept across forwards
    assert all(b.attn.encoding is enc for b in model.blocks)


def test_forward_on_bld_and_bhld():
    enc = posenc.get("rope-interleaved", head_dim=8)
    x = torch.randn(2, 5, 8)
    y = enc(x)
    y4 = enc(x[:, None])
    assert torch.allclose(y4[:, 0], y)
    assert torch.allclose(y[:, 0], x[:, 0])  # position 0 is the identity


def test_bad_inputs():
    with pytest.raises(ConfigError, match="head_dim must be even, got 63"):
        posenc.get("rope", head_dim=63)
    with pytest.raises(ConfigError, match="rotary_dim"):
        posenc.get("rope", head_dim=64, rotary_dim=66)
    with pytest.raises(ConfigError, match="rotary_dim"):
        posenc.get("rope", head_dim=64, rotary_dim=7)
    enc = posenc.get("rope", head_dim=8)
    with pytest.raises(ConfigError, match="head_dim=8"):
        enc(torch.randn(1, 3, 10))
    with pytest.raises(PositionError, match=">= 0"):
        enc(torch.randn(1, 3, 8), torch.tensor([-1, 0, 1]))
    with pytest.raises(PositionError, match="3 tokens but the sequence has 4"):
        enc(torch.randn(1, 4, 8), torch.arange(3))
    with pytest.raises(ConfigError, match="does not take 'dim'.*it takes: head_dim, base, rotary_dim"):
        posenc.get("rope", dim=8)
