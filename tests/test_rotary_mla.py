"""rope-mla (MLA's decoupled RoPE with DeepSeek's YaRN) against transformers 5.24's DeepSeek-V3 code.

* cos / sin against ``DeepseekV3RotaryEmbedding`` (yarn, DeepSeek-V3's, V2's and an unequal mscale pair; plain);
* the rotation of whole heads (the unrotated channels first, the rope slice last) against
  ``apply_rotary_pos_emb_interleave`` (``rope_interleave=True``) and ``apply_rotary_pos_emb``, float64, gradients;
* the softmax scale against ``DeepseekV3Attention.scaling`` (``mscale_all_dim`` squared into it: a runtime that
  leaves it out attends differently, and transformers' attention agrees with posenc's, not with that);
* the whole ``DeepseekV3Attention`` forward (latent projections from the module, the rotation and the scale from
  posenc) and posenc's own ``MultiHeadAttention`` (SDPA plan) against transformers' functions;
* KV-cache generation, and bad settings.
"""

from __future__ import annotations

import math

import pytest
import torch

import posenc
from posenc import ConfigError, MultiHeadAttention
from posenc.base import AttentionContext

transformers = pytest.importorskip("transformers")
from transformers import DeepseekV3Config  # noqa: E402
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (  # noqa: E402
    DeepseekV3Attention,
    DeepseekV3RotaryEmbedding,
    apply_rotary_pos_emb,
    apply_rotary_pos_emb_interleave,
)

# (name, posenc options, transformers rope_parameters): DeepSeek-V3 / Kimi K2, DeepSeek-V2, mscale != mscale_all_dim,
# no YaRN
YARN_V3 = dict(factor=40.0, original_max_len=4096, mscale=1.0, mscale_all_dim=1.0)
CASES = [
    (
        "v3",
        YARN_V3,
        dict(rope_type="yarn", factor=40.0, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0),
    ),
    (
        "v2",
        dict(factor=40.0, original_max_len=4096, mscale=0.707, mscale_all_dim=0.707),
        dict(rope_type="yarn", factor=40.0, original_max_position_embeddings=4096, mscale=0.707, mscale_all_dim=0.707),
    ),
    (
        "unequal",
        dict(factor=16.0, original_max_len=256, mscale=1.0, mscale_all_dim=0.8, beta_fast=16.0, beta_slow=2.0),
        dict(
            rope_type="yarn",
            factor=16.0,
            original_max_position_embeddings=256,
            mscale=1.0,
            mscale_all_dim=0.8,
            beta_fast=16.0,
            beta_slow=2.0,
        ),
    ),
    ("plain", {}, dict(rope_type="default")),
]
NOPE, ROPE, V = 12, 8, 10  # small qk_nope_head_dim, qk_rope_head_dim, v_head_dim
HEAD = NOPE + ROPE


def hf_config(rope_parameters: dict, interleave: bool = True, heads: int = 2) -> DeepseekV3Config:
    return DeepseekV3Config(
        hidden_size=32,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_nope_head_dim=NOPE,
        qk_rope_head_dim=ROPE,
        v_head_dim=V,
        max_position_embeddings=int(
            rope_parameters.get("factor", 1) * rope_parameters.get("original_max_position_embeddings", 4096)
        ),
        rope_parameters={"rope_theta": 10000.0, **rope_parameters},
        rope_interleave=interleave,
        attn_implementation="sdpa",
    )


def positions(batch: int, length: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.sort(torch.randint(0, 200_000, (batch, length), generator=g), dim=-1).values


@pytest.mark.parametrize("case,ours,theirs", CASES, ids=[c[0] for c in CASES])
def test_cos_sin_equal_transformers(case, ours, theirs):
    enc = posenc.get("rope-mla", head_dim=HEAD, rope_dim=ROPE, **ours)
    hf = DeepseekV3RotaryEmbedding(hf_config(theirs))
    pos = positions(2, 9, 0)
    cos, sin = hf(torch.zeros(1, dtype=torch.float32), pos)
    c, s = enc.cos_sin(pos)
    assert torch.equal(c, cos[..., : ROPE // 2]) and torch.equal(s, sin[..., : ROPE // 2])
    assert torch.equal(enc.inv_freq, hf.inv_freq)


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("case,ours,theirs", CASES, ids=[c[0] for c in CASES])
def test_rotation_equals_transformers_float64_with_gradients(case, ours, theirs, interleave):
    enc = posenc.get("rope-mla", head_dim=HEAD, rope_dim=ROPE, interleaved=interleave, **ours)
    hf = DeepseekV3RotaryEmbedding(hf_config(theirs, interleave))
    b, h, n = 2, 3, 9
    g = torch.Generator().manual_seed(1)
    q = torch.randn(b, h, n, HEAD, dtype=torch.float64, generator=g)
    k = torch.randn(b, h, n, HEAD, dtype=torch.float64, generator=g)
    pos = positions(b, n, 2)
    q1, k1 = q.clone().requires_grad_(), k.clone().requires_grad_()
    cos, sin = hf(q1, pos)
    rotate = apply_rotary_pos_emb_interleave if interleave else apply_rotary_pos_emb
    q_rot, k_rot = rotate(q1[..., NOPE:], k1[..., NOPE:], cos, sin)
    want_q, want_k = torch.cat((q1[..., :NOPE], q_rot), -1), torch.cat((k1[..., :NOPE], k_rot), -1)
    q2, k2 = q.clone().requires_grad_(), k.clone().requires_grad_()
    got_q, got_k = enc.rotate(q2, k2, AttentionContext(q_pos=pos, k_pos=pos, n_heads=h, head_dim=HEAD))
    assert float((got_q - want_q).detach().abs().max()) == 0.0 and float((got_k - want_k).detach().abs().max()) == 0.0
    w = torch.randn(b, h, n, n, dtype=torch.float64, generator=g)
    ((want_q @ want_k.transpose(-1, -2)) * w).sum().backward()
    ((got_q @ got_k.transpose(-1, -2)) * w).sum().backward()
    torch.testing.assert_close(q2.grad, q1.grad, rtol=0, atol=1e-13)
    torch.testing.assert_close(k2.grad, k1.grad, rtol=0, atol=1e-13)
    torch.testing.assert_close(enc(q, pos), want_q.detach(), rtol=0, atol=0)


def test_rope_first_and_the_interleaved_layout():
    last = posenc.get("rope-mla", head_dim=HEAD, rope_dim=ROPE)
    first = posenc.get("rope-mla", head_dim=HEAD, rope_dim=ROPE, rope_first=True)
    half = posenc.get("rope-mla", head_dim=HEAD, rope_dim=ROPE, interleaved=False)
    x = torch.randn(1, 2, 6, HEAD, dtype=torch.float64)
    pos = torch.arange(3, 9)
    moved = torch.cat((x[..., NOPE:], x[..., :NOPE]), -1)
    got = first(moved, pos)
    torch.testing.assert_close(torch.cat((got[..., ROPE:], got[..., :ROPE]), -1), last(x, pos), rtol=0, atol=0)
    # interleaved: rotate-half on the slice's channels de-interleaved (evens, then odds), i.e. on a checkpoint's
    # interleaved weights what interleaved=False gives on their de-interleaved copy
    deinterleaved = torch.cat((x[..., :NOPE], x[..., NOPE::2], x[..., NOPE + 1 :: 2]), -1)
    torch.testing.assert_close(last(x, pos), half(deinterleaved, pos), rtol=0, atol=0)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(last(x, pos), half(x, pos))
    # the unrotated channels pass through
    assert torch.equal(last(x, pos)[..., :NOPE], x[..., :NOPE])


@pytest.mark.parametrize("case,ours,theirs", CASES, ids=[c[0] for c in CASES])
def test_softmax_scale_equals_transformers(case, ours, theirs):
    enc = posenc.get("rope-mla", head_dim=HEAD, rope_dim=ROPE, **ours)
    assert enc.scale(HEAD) == DeepseekV3Attention(hf_config(theirs), 0).scaling


def test_mscale_all_dim_is_in_the_softmax_scale():
    # DeepSeek-V3's settings: head 192 (128 + 64), factor 40, mscale = mscale_all_dim = 1
    enc = posenc.get("rope-mla", head_dim=192, rope_dim=64, **YARN_V3)
    mu = 0.1 * math.log(40.0) + 1.0
    assert enc.scale(192) == pytest.approx(mu**2 / math.sqrt(192), rel=1e-15)
    assert mu**2 == pytest.approx(1.8738, abs=1e-4)  # what a runtime without it leaves out of every logit
    # cos / sin carry mscale / mscale_all_dim = 1 here: the whole factor is in the scale
    c, s = enc.cos_sin(torch.arange(5)[None])
    torch.testing.assert_close(c**2 + s**2, torch.ones_like(c))
    plain = posenc.get("rope-mla", head_dim=192, rope_dim=64, factor=40.0, original_max_len=4096)
    assert plain.scale(192) == 192**-0.5  # no mscale_all_dim: no softmax factor (transformers alike)


def _hf_attention(case_params: dict, seed: int = 0) -> DeepseekV3Attention:
    torch.manual_seed(seed)
    attn = DeepseekV3Attention(hf_config(case_params), 0).double().eval()
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return attn


@pytest.mark.parametrize("case,ours,theirs", CASES[:3], ids=[c[0] for c in CASES[:3]])
def test_whole_deepseek_attention_with_posenc_rotation_and_scale(case, ours, theirs):
    attn = _hf_attention(theirs)
    rotary = DeepseekV3RotaryEmbedding(attn.config)
    enc = posenc.get("rope-mla", head_dim=HEAD, rope_dim=ROPE, **ours)
    b, n, h = 2, 7, 2
    x = torch.randn(b, n, 32, dtype=torch.float64)
    pos = positions(b, n, 3)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    mask = torch.zeros(b, 1, n, n, dtype=torch.float64).masked_fill(~causal, torch.finfo(torch.float64).min)
    want, _ = attn(x, position_embeddings=rotary(x, pos), attention_mask=mask)
    # the latent projections from the module, unrotated; the rotation and the scale from posenc
    q = attn.q_proj(x).view(b, n, h, HEAD).transpose(1, 2)
    kv_nope, k_rot = attn.kv_a_proj_with_mqa(x).split([16, ROPE], dim=-1)
    kv_nope = attn.kv_a_layernorm(kv_nope).view(b, 1, n, 16)
    k, v = attn.expand_kv(kv_nope, k_rot.view(b, 1, n, ROPE))
    q, k = enc.rotate(q, k, AttentionContext(q_pos=pos, k_pos=pos, n_heads=h, head_dim=HEAD))
    logits = (q @ k.transpose(-1, -2)) * enc.scale(HEAD)
    z = logits.masked_fill(~causal, -math.inf).softmax(-1) @ v
    got = attn.o_proj(z.transpose(1, 2).reshape(b, n, h * V))
    diff = float((got - want).detach().abs().max())
    assert diff < 1e-14, diff
    # the same attention scaled without mscale_all_dim (the runtimes' bug) is another attention
    bad = (logits / enc.scale(HEAD) * HEAD**-0.5).masked_fill(~causal, -math.inf).softmax(-1) @ v
    assert float((attn.o_proj(bad.transpose(1, 2).reshape(b, n, h * V)) - want).detach().abs().max()) > 1e-3


def test_posenc_attention_takes_sdpa_and_equals_transformers_functions():
    torch.manual_seed(0)
    enc = posenc.get("rope-mla", head_dim=HEAD, rope_dim=ROPE, **YARN_V3)
    attn = MultiHeadAttention(40, 2, enc, head_dim=HEAD).double()
    x = torch.randn(2, 11, 40, dtype=torch.float64)
    got = attn(x, causal=True)
    assert attn.last_plan is not None and attn.last_plan.kernel == "sdpa", attn.last_plan
    assert attn.plan(x, causal=True).kernel == "sdpa"
    hf_attn = DeepseekV3Attention(hf_config(CASES[0][2]), 0)
    rotary = DeepseekV3RotaryEmbedding(hf_attn.config)
    pos = torch.arange(11)[None]
    q, k, v = (attn._split(p(x)) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    q_rot, k_rot = apply_rotary_pos_emb_interleave(q[..., NOPE:], k[..., NOPE:], *rotary(x, pos))
    q, k = torch.cat((q[..., :NOPE], q_rot), -1), torch.cat((k[..., :NOPE], k_rot), -1)
    z = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=hf_attn.scaling)
    want = attn.o_proj(z.transpose(1, 2).reshape(2, 11, 2 * HEAD))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_language_model_generates_the_same_with_and_without_cache():
    torch.manual_seed(0)
    model = posenc.LanguageModel(
        vocab_size=40,
        d_model=48,
        n_heads=2,
        n_layers=2,
        encoding="rope-mla",
        max_len=64,
        encoding_options=dict(rope_dim=8, **{**YARN_V3, "original_max_len": 16}),
    ).eval()
    prompt = torch.randint(0, 40, (2, 5))
    a = model.generate(prompt, max_new_tokens=8, use_cache=True)
    assert torch.equal(a, model.generate(prompt, max_new_tokens=8, use_cache=False))


def test_model_trains_on_text():
    torch.manual_seed(0)
    model = posenc.LanguageModel(vocab_size=20, d_model=32, n_heads=2, n_layers=1, encoding="rope-mla", max_len=32)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, 20, (4, 16))
    losses = []
    for _ in range(30):
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 20), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]


# ------------------------------------------------------------------ bad input
def test_rope_dim_larger_than_head_dim_names_both():
    with pytest.raises(ConfigError, match=r"rope_dim=24 is larger than head_dim=16"):
        posenc.get("rope-mla", head_dim=16, rope_dim=24)


def test_odd_dims():
    with pytest.raises(ConfigError, match="rope_dim .* must be an even integer >= 2 .* got 5"):
        posenc.get("rope-mla", head_dim=16, rope_dim=5)
    enc = posenc.get("rope-mla", head_dim=15, rope_dim=6)  # an odd unrotated part is fine
    x = torch.randn(1, 1, 4, 15)
    assert torch.equal(enc(x)[..., :9], x[..., :9])
    assert posenc.get("rope-mla", head_dim=3).rope_dim == 2  # the default: a third of the head, at least a pair
    with pytest.raises(ConfigError, match="head_dim must be an integer >= 2"):
        posenc.get("rope-mla", head_dim=1)


def test_yarn_settings_without_factor_or_original():
    with pytest.raises(ConfigError, match="mscale, mscale_all_dim set YaRN, which needs factor"):
        posenc.get("rope-mla", head_dim=16, mscale=1.0, mscale_all_dim=1.0)
    with pytest.raises(ConfigError, match="needs original_max_len"):
        posenc.get("rope-mla", head_dim=16, factor=40.0)
    with pytest.raises(ConfigError, match=r"rope-mla \(YaRN on its rope_dim=4 slice\).*factor .* must be >= 1"):
        posenc.get("rope-mla", head_dim=16, factor=0.5, original_max_len=64)
    with pytest.raises(ConfigError, match="head_dim=16"):
        MultiHeadAttention(32, 2, posenc.get("rope-mla", head_dim=20))
