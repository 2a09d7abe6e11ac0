"""T5 relative position bias ("t5") against HF transformers' T5Attention.

Truth: HF ``T5Attention._relative_position_bucket`` (bucket ids, exact integer
equality) and a full ``T5Attention`` forward in float64 given the same weights
(tolerance 1e-12). Fast path (SDPA additive mask) == reference path at 1e-10.
"""

from __future__ import annotations

import pytest
import torch

import posenc
from posenc import ConfigError, MultiHeadAttention, PositionError
from posenc.relative.t5 import T5Bias, t5_relative_position_bucket

D_MODEL, N_HEADS = 16, 4


def _hf_t5_attention(num_buckets: int, max_distance: int, decoder: bool):
    transformers = pytest.importorskip("transformers")
    from transformers.models.t5.modeling_t5 import T5Attention

    cfg = transformers.T5Config(
        d_model=D_MODEL,
        d_kv=D_MODEL // N_HEADS,
        num_heads=N_HEADS,
        d_ff=32,
        num_layers=1,
        relative_attention_num_buckets=num_buckets,
        relative_attention_max_distance=max_distance,
        dropout_rate=0.0,
        is_decoder=decoder,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = T5Attention(cfg, has_relative_attention_bias=True, layer_idx=0, is_causal=decoder).double().eval()
    with torch.no_grad():
        hf.relative_attention_bias.weight.normal_()  # make the bias large enough to matter
    return hf


def _ours_from_hf(hf, num_buckets: int, max_distance: int, bidirectional: bool, scaling: str = "t5", **kw):
    enc = T5Bias(
        N_HEADS, num_buckets=num_buckets, max_distance=max_distance, bidirectional=bidirectional, scaling=scaling
    )
    mha = MultiHeadAttention(D_MODEL, N_HEADS, enc, bias=False, **kw).double().eval()
    with torch.no_grad():
        mha.q_proj.weight.copy_(hf.q.weight)
        mha.k_proj.weight.copy_(hf.k.weight)
        mha.v_proj.weight.copy_(hf.v.weight)
        mha.o_proj.weight.copy_(hf.o.weight)
        enc.relative_attention_bias.weight.copy_(hf.relative_attention_bias.weight)
    return mha


# ---------------------------------------------------------------- buckets vs HF
@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize(("num_buckets", "max_distance"), [(32, 128), (8, 20), (16, 9), (64, 512)])
def test_buckets_equal_hf(bidirectional: bool, num_buckets: int, max_distance: int) -> None:
    pytest.importorskip("transformers")
    from transformers.models.t5.modeling_t5 import T5Attention

    rel = torch.cat([torch.arange(-3000, 3001), torch.tensor([-(10**7), 10**7, -(2**31), 2**31])])
    want = T5Attention._relative_position_bucket(
        rel, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance
    )
    got = t5_relative_position_bucket(
        rel, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance
    )
    assert torch.equal(got, want.long())
    assert int(got.min()) >= 0 and int(got.max()) < num_buckets


def test_odd_buckets_unidirectional_equal_hf() -> None:
    pytest.importorskip("transformers")
    from transformers.models.t5.modeling_t5 import T5Attention

    rel = torch.arange(-300, 300)
    want = T5Attention._relative_position_bucket(rel, bidirectional=False, num_buckets=5, max_distance=30)
    assert torch.equal(t5_relative_position_bucket(rel, bidirectional=False, num_buckets=5, max_distance=30), want)


def test_bias_with_offset_equals_hf_compute_bias() -> None:
    """Queries after ``past`` cached tokens: HF's ``compute_bias(past_seen_tokens=...)``."""
    hf = _hf_t5_attention(8, 20, decoder=True)
    mha = _ours_from_hf(hf, 8, 20, bidirectional=False)
    past, lq, lk = 37, 5, 42
    want = hf.compute_bias(lq, lk, past_seen_tokens=past)
    got = mha.encoding.compute_bias(torch.arange(past, past + lq)[None], torch.arange(lk)[None])
    torch.testing.assert_close(got, want, rtol=0, atol=0)


# --------------------------------------------------------- full attention vs HF
@pytest.mark.parametrize("decoder", [False, True])
@pytest.mark.parametrize(("num_buckets", "max_distance", "length"), [(32, 128, 150), (8, 12, 30)])
@pytest.mark.parametrize("path", ["reference", "fast"])
def test_attention_equals_hf_t5attention(decoder: bool, num_buckets: int, max_distance: int, length: int, path: str):
    """Output of HF ``T5Attention.forward`` (eager, float64, relative bias in this layer) vs ours; tol 1e-12."""
    hf = _hf_t5_attention(num_buckets, max_distance, decoder)
    mha = _ours_from_hf(hf, num_buckets, max_distance, bidirectional=not decoder, path=path)
    torch.manual_seed(1)
    x = torch.randn(2, length, D_MODEL, dtype=torch.float64)
    keep = torch.ones(2, length, dtype=torch.bool)
    keep[1, -7:] = False  # right padding in the second sequence
    neg = torch.finfo(torch.float64).min
    hf_mask = torch.zeros(2, 1, length, length, dtype=torch.float64).masked_fill(~keep[:, None, None, :], neg)
    if decoder:
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        hf_mask = hf_mask.masked_fill(~causal, neg)
    with torch.no_grad():
        want = hf(x, mask=hf_mask)[0]
        got = mha(x, attention_mask=keep, causal=decoder)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_default_scaling_is_t5_with_query_scaled() -> None:
    """``scaling="default"`` == HF T5 (no temperature) with ``W_q`` divided by sqrt(d_head)."""
    hf = _hf_t5_attention(32, 128, decoder=False)
    mha = _ours_from_hf(hf, 32, 128, bidirectional=True, scaling="default", path="reference")
    with torch.no_grad():
        hf.q.weight.mul_((D_MODEL // N_HEADS) ** -0.5)
    x = torch.randn(2, 20, D_MODEL, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(mha(x), hf(x)[0], rtol=0, atol=1e-12)
    assert T5Bias(2, scaling="t5").scale(64) == 1.0
    assert T5Bias(2).scale(64) == 64**-0.5


# ------------------------------------------------------------- fast == reference
@pytest.mark.parametrize("bidirectional", [True, False])
def test_fast_equals_reference(bidirectional: bool) -> None:
    torch.manual_seed(2)
    enc = T5Bias(N_HEADS, num_buckets=8, max_distance=10, bidirectional=bidirectional)
    with torch.no_grad():
        enc.relative_attention_bias.weight.normal_()
    fast = MultiHeadAttention(D_MODEL, N_HEADS, enc, path="fast").double()
    ref = MultiHeadAttention(D_MODEL, N_HEADS, enc, path="reference").double()
    ref.load_state_dict(fast.state_dict())
    for lq, lk, causal in [(25, 25, True), (25, 25, False), (3, 40, False)]:
        x = torch.randn(3, lq, D_MODEL, dtype=torch.float64)
        kv = torch.randn(3, lk, D_MODEL, dtype=torch.float64) if lk != lq else None
        q_pos = torch.randint(0, 500, (3, 1)) + torch.arange(lq)  # random offsets per sequence
        k_pos = None if kv is None else torch.randint(0, 500, (3, 1)) + torch.arange(lk)
        keep = torch.rand(3, lk) > 0.3
        keep[:, 0] = True
        kw = dict(positions=q_pos, key_value=kv, key_positions=k_pos, attention_mask=keep, causal=causal)
        torch.testing.assert_close(fast(x, **kw), ref(x, **kw), rtol=0, atol=1e-10)


def test_fast_equals_reference_with_kv_cache() -> None:
    torch.manual_seed(3)
    model = posenc.Decoder(
        11,
        encoding="t5",
        encoding_options={"bidirectional": False, "num_buckets": 8, "max_distance": 6},
        d_model=16,
        n_heads=2,
    ).double()
    tokens = torch.randint(0, 11, (2, 14))
    full = model(tokens).hidden
    cache = posenc.KVCache()
    steps = [model(tokens[:, :9], kv_cache=cache).hidden]
    for t in range(9, 14):
        steps.append(model(tokens[:, t : t + 1], kv_cache=cache).hidden)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=1e-10)


# ----------------------------------------------------------- layer sharing, cache
def test_bias_computed_once_per_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    model = posenc.Encoder(13, encoding="t5", d_model=16, n_heads=2, n_layers=3)
    assert all(b.attn.encoding is model.encoding for b in model.blocks)
    calls = []
    original = T5Bias.buckets

    def counting(self, rel):
        calls.append(rel.shape)
        return original(self, rel)

    monkeypatch.setattr(T5Bias, "buckets", counting)
    tokens = torch.randint(0, 13, (2, 9))
    model(tokens)
    assert len(calls) == 1
    model(tokens, positions=torch.arange(5, 14))
    assert len(calls) == 2  # a new forward computes it again


# ------------------------------------------------------ gradients, training, shift
def test_gradients_reach_the_table() -> None:
    enc = T5Bias(N_HEADS, num_buckets=8, max_distance=10)
    mha = MultiHeadAttention(D_MODEL, N_HEADS, enc, path="fast")
    x = torch.randn(2, 30, D_MODEL)
    mha(x).pow(2).sum().backward()
    g = enc.relative_attention_bias.weight.grad
    assert g is not None
    used = g.abs().sum(1) > 0
    # every bucket is used at L=30 except bucket N/2 ("j > i at distance 0"), which T5 never uses
    assert used.tolist() == [True] * 4 + [False] + [True] * 3
    for name, p in mha.named_parameters():
        assert p.grad is not None and bool(p.grad.abs().sum() > 0), name


def test_tiny_model_learns_previous_token() -> None:
    """Tag each token with its left neighbour: impossible without position; loss must fall."""
    torch.manual_seed(0)
    model = posenc.TokenTagger(
        8, 8, encoding="t5", d_model=32, n_heads=4, n_layers=1, encoding_options={"num_buckets": 8, "max_distance": 16}
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(100):
        tokens = torch.randint(1, 8, (16, 12))
        target = torch.cat([torch.zeros(16, 1, dtype=torch.long), tokens[:, :-1]], 1)
        loss = torch.nn.functional.cross_entropy(model(tokens).reshape(-1, 8), target.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    # 100 steps (was 50: 0.48 on seed 0, at the threshold, and 0.52-0.78 on 3 of 6 seeds). Last five / first five
    # over seeds 0-5 (the manual_seed shifted), native kernels on and off: 0.04-0.06; no learning stays near 1.
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5, losses


@pytest.mark.parametrize("bidirectional", [True, False])
def test_translation_invariance(bidirectional: bool) -> None:
    torch.manual_seed(4)
    enc = T5Bias(N_HEADS, num_buckets=8, max_distance=10, bidirectional=bidirectional)
    mha = MultiHeadAttention(D_MODEL, N_HEADS, enc).double()
    x = torch.randn(2, 24, D_MODEL, dtype=torch.float64)
    pos = torch.arange(24)
    base = mha(x, positions=pos, causal=not bidirectional)
    for shift in (1, 17, 10_000):
        torch.testing.assert_close(mha(x, positions=pos + shift, causal=not bidirectional), base, rtol=0, atol=1e-12)
    # and position matters: reversing the positions changes the output
    assert not torch.allclose(mha(x, positions=pos.flip(0)), mha(x, positions=pos))


# ---------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_buckets": 7}, "even"),
        ({"num_buckets": 2}, ">= 4"),
        ({"num_buckets": 1, "bidirectional": False}, ">= 2"),
        ({"num_buckets": 32, "max_distance": 8}, ">= 9"),
        ({"num_buckets": 8, "max_distance": 2, "bidirectional": False}, ">= 5"),
        ({"scaling": "none"}, "scaling"),
        ({"num_buckets": 8.0}, "integer"),
    ],
)
def test_bad_config(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        T5Bias(4, **kwargs)
    with pytest.raises(ConfigError, match="n_heads"):
        T5Bias(0)


def test_bad_input() -> None:
    with pytest.raises(ConfigError, match=f"'t5' was built for n_heads=2 but is used with n_heads={N_HEADS}"):
        MultiHeadAttention(D_MODEL, N_HEADS, T5Bias(2))
    mha = MultiHeadAttention(D_MODEL, N_HEADS, T5Bias(N_HEADS))
    mha.encoding = T5Bias(2)  # swapped in after construction: the call still checks
    with pytest.raises(ConfigError, match="n_heads=2"):
        mha(torch.randn(1, 5, D_MODEL))
    mha = MultiHeadAttention(D_MODEL, N_HEADS, T5Bias(N_HEADS))
    with pytest.raises(PositionError, match="integer"):
        mha(torch.randn(1, 5, D_MODEL), positions=torch.arange(5) + 0.5)
