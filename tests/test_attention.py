"""The attention core: fast == reference, explicit positions (KV cache, packing, left padding), masks.

The encoding-generic tests run over every registered encoding, so a new encoding is
checked here too without writing anything.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import posenc
from posenc.base import AttentionContext, Card, PositionalEncoding
from posenc.errors import ConfigError, PositionError, UnknownNameError
from posenc.registry import example

D, H = 32, 4
DIMS = dict(d_model=D, n_heads=H, head_dim=D // H, max_len=64, vocab_size=40)
NEEDS_SEGMENTS = {"xlnet"}


def names():
    return posenc.available()


def make(name):
    """``name`` built at DIMS with the settings it declares (``example_options``), parameters moved."""
    enc = example(name, DIMS)
    # move every parameter off its initial value: a table initialised to zero (CoPE) would hide bugs
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in enc.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return enc


# encodings whose output at a position depends on the length of the whole sequence (by design), as built by make()
LENGTH_DEPENDENT = {n for n in names() if example(n, DIMS).cache_problem(1, DIMS["max_len"]) is not None}


def seg_kwargs(name, b, n):
    if name in NEEDS_SEGMENTS:
        return {"segment_ids": (torch.arange(n) >= n // 2).long().expand(b, n)}
    return {}


class LinearBias(PositionalEncoding):
    """A test encoding using every attention hook: logits, bias, values, scale."""

    info = Card(
        name="test-bias", title="", paper="", year=0, family="bias", position="relative", learnable=True, summary=""
    )

    def __init__(self):
        super().__init__()
        self.m = torch.nn.Parameter(torch.rand(H, dtype=torch.float64))
        self.w = torch.nn.Parameter(torch.randn(D // H, dtype=torch.float64))

    def logits(self, q, k, ctx):
        return 0.1 * (q @ self.w)[..., None] * ctx.relative()[:, None].to(q.dtype)

    def bias(self, ctx):
        return -self.m[:, None, None] * ctx.relative().abs()[:, None].to(self.m.dtype)

    def scale(self, head_dim):
        return 0.5 / head_dim**0.5


class ValueTerm(LinearBias):
    def values(self, probs, ctx):
        return (probs * torch.tanh(ctx.relative()[:, None].to(probs.dtype))).sum(-1, keepdim=True) * self.w


@settings(max_examples=25, deadline=None)
@given(
    b=st.integers(1, 3),
    lq=st.integers(1, 9),
    extra=st.integers(0, 5),
    offset=st.integers(0, 50),
    causal=st.booleans(),
    pad=st.booleans(),
    kind=st.sampled_from(["none", "rope", "rope-interleaved", "bias", "values"]),
)
def test_fast_equals_reference_random(b, lq, extra, offset, causal, pad, kind):
    enc = {"bias": LinearBias, "values": ValueTerm}.get(kind)
    enc = enc() if enc else posenc.get(kind, **({"head_dim": D // H} if kind != "none" else {}))
    attn = posenc.MultiHeadAttention(D, H, enc).double()
    lk = lq + extra
    x = torch.randn(b, lq, D, dtype=torch.float64)
    kv = torch.randn(b, lk, D, dtype=torch.float64)
    qpos = torch.randint(0, 100, (b, lq)) + offset
    kpos = torch.randint(0, 100, (1, lk))
    mask = torch.rand(b, lk) > 0.3 if pad else None
    kw = dict(key_value=kv, positions=qpos, key_positions=kpos, causal=causal, attention_mask=mask)
    attn.path = "fast"
    fast = attn(x, **kw)
    attn.path = "reference"
    ref, weights = attn(x, return_weights=True, **kw)
    assert torch.allclose(fast, ref, atol=1e-10)
    assert torch.isfinite(weights).all()


@pytest.mark.parametrize("name", names())
def test_every_encoding_fast_equals_reference(name):
    torch.manual_seed(1)
    enc = make(name).double().eval()
    b, n = 2, 12
    for causal in (False, True):
        model = posenc.Transformer(40, encoding=enc, d_model=D, n_heads=H, n_layers=2, causal=causal, max_len=64)
        model = model.double().eval()
        tokens = torch.randint(1, 40, (b, n))
        mask = torch.ones(b, n, dtype=torch.bool)
        mask[1, -3:] = False
        kw = dict(attention_mask=mask, **seg_kwargs(name, b, n))
        for blk in model.blocks:
            blk.attn.path = "fast"
        fast = model(tokens, **kw).hidden
        for blk in model.blocks:
            blk.attn.path = "reference"
        ref = model(tokens, **kw).hidden
        assert torch.allclose(fast, ref, atol=1e-8), f"{name} causal={causal}"


@pytest.mark.parametrize("name", names())
def test_every_encoding_kv_cache_matches_full_forward(name):
    if name in LENGTH_DEPENDENT:
        pytest.skip(f"{name} depends on the whole sequence length by design")
    enc = make(name).double().eval()
    model = posenc.Decoder(40, encoding=enc, d_model=D, n_heads=H, n_layers=2, max_len=64).double().eval()
    tokens = torch.randint(1, 40, (2, 10))
    kw = seg_kwargs(name, 2, 10)
    full = model(tokens, **kw).hidden
    cache = posenc.KVCache()
    steps = []
    for s, e in [(0, 4), (4, 5), (5, 10)]:  # a prompt, then one token, then a chunk
        kws = {k: v[:, s:e] for k, v in kw.items()}  # segment ids of earlier keys live in the cache
        steps.append(model(tokens[:, s:e], kv_cache=cache, **kws).hidden)
    assert torch.allclose(torch.cat(steps, 1), full, atol=1e-8)


@pytest.mark.parametrize("name", names())
def test_every_encoding_packed_sequences_equal_separate_runs(name):
    if name in LENGTH_DEPENDENT:
        pytest.skip(f"{name} depends on the whole sequence length by design")
    enc = make(name).double().eval()
    model = posenc.Encoder(40, encoding=enc, d_model=D, n_heads=H, n_layers=2, max_len=64).double().eval()
    a, c = torch.randint(1, 40, (1, 5)), torch.randint(1, 40, (1, 7))
    packed = torch.cat([a, c], 1)
    docs = torch.tensor([[0] * 5 + [1] * 7])
    pos = torch.cat([torch.arange(5), torch.arange(7)])[None]
    kw_a, kw_c, kw_p = seg_kwargs(name, 1, 5), seg_kwargs(name, 1, 7), {}
    if name in NEEDS_SEGMENTS:
        kw_p = {"segment_ids": torch.cat([kw_a["segment_ids"], kw_c["segment_ids"]], 1)}
    out = model(packed, positions=pos, document_ids=docs, **kw_p).hidden
    assert torch.allclose(out[:, :5], model(a, **kw_a).hidden, atol=1e-8)
    assert torch.allclose(out[:, 5:], model(c, **kw_c).hidden, atol=1e-8)


@pytest.mark.parametrize("name", names())
def test_every_encoding_left_padding(name):
    if name in LENGTH_DEPENDENT:
        pytest.skip(f"{name} depends on the whole sequence length by design")
    enc = make(name).double().eval()
    model = posenc.Decoder(40, encoding=enc, d_model=D, n_heads=H, n_layers=2, max_len=64).double().eval()
    real = torch.randint(1, 40, (1, 6))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), real], 1)
    mask = torch.tensor([[False] * 3 + [True] * 6])
    pos = (mask.long().cumsum(1) - 1).clamp(min=0)
    kw_r, kw_p = seg_kwargs(name, 1, 6), seg_kwargs(name, 1, 9)
    out = model(padded, positions=pos, attention_mask=mask, **kw_p).hidden
    if name in NEEDS_SEGMENTS:
        kw_r = {"segment_ids": kw_p["segment_ids"][:, 3:]}
    assert torch.allclose(out[:, 3:], model(real, **kw_r).hidden, atol=1e-8)
    assert torch.isfinite(out).all()


def test_fully_masked_query_rows_are_zero_on_both_paths():
    attn = posenc.MultiHeadAttention(D, H, LinearBias()).double()
    x = torch.randn(1, 4, D, dtype=torch.float64)
    mask = torch.zeros(1, 4, 4, dtype=torch.bool)
    mask[0, 2:, :] = True
    for path in ("fast", "reference"):
        attn.path = path
        inner = attn(x, mask=mask)
        assert torch.isfinite(inner).all()
        assert torch.allclose(inner[0, :2], attn.o_proj.bias.expand(2, -1))


def test_memory_positions_continue():
    enc = posenc.get("rope", head_dim=D // H)
    attn = posenc.MultiHeadAttention(D, H, enc).eval()
    seq = torch.randn(1, 10, D)
    full = attn(seq, causal=True)
    # the last 4 tokens with the first 6 as memory see the same keys at the same positions
    part = attn(seq[:, 6:], memory=seq[:, :6], causal=True)
    assert torch.allclose(part, full[:, 6:], atol=1e-5)


def test_bad_inputs():
    attn = posenc.MultiHeadAttention(D, H, posenc.get("rope", head_dim=D // H))
    x = torch.randn(2, 5, D)
    with pytest.raises(PositionError, match="4 tokens but the sequence has 5"):
        attn(x, positions=torch.arange(4))
    with pytest.raises(PositionError, match="key_positions"):
        attn(x, positions=torch.arange(5), memory=torch.randn(2, 3, D))
    with pytest.raises(ConfigError, match="memory must be"):
        attn(x, memory=torch.randn(2, 3, D + 1))
    with pytest.raises(ConfigError, match=r"attention_mask must have shape \[batch, keys\] = \[2, 5\]"):
        attn(x, attention_mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ConfigError, match="boolean"):
        attn(x, mask=torch.ones(5, 5))
    with pytest.raises(ConfigError, match=f"x must be \\[batch, length, {D}\\]"):
        attn(torch.randn(2, 5, D + 2))
    with pytest.raises(ConfigError, match="not divisible"):
        posenc.MultiHeadAttention(30, 4)
    with pytest.raises(ConfigError, match="path"):
        posenc.MultiHeadAttention(D, H, path="fastest")
    with pytest.raises(UnknownNameError, match="Did you mean: rope"):
        posenc.get("ropee")


def test_context_relative_is_j_minus_i():
    c = AttentionContext(q_pos=torch.tensor([[2, 5]]), k_pos=torch.tensor([[0, 1, 7]]), n_heads=1, head_dim=2)
    assert c.relative().tolist() == [[[-2, -1, 5], [-5, -4, 2]]]
