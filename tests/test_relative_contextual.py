"""The RelativePositionEmbedding of anon., "Positional encoding of the Transformer" ("the article",
docs/background.md): "relative-bias", "contextual-1", "contextual-2".

Truth: the article's formulas re-evaluated here independently -- the bucket function as a
scalar loop in numpy float32 (the article's own float32 log), the bias / contextual terms as
loops over (b, h, m, n) -- float64, tol 1e-10; and the buckets against HF transformers 5.x
T5Attention._relative_position_bucket (the article's function is T5's bidirectional one).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from shape_recorder import ShapeRecorder

import posenc
from posenc.attention import KVCache, MultiHeadAttention
from posenc.base import AttentionContext
from posenc.errors import ConfigError, PositionError
from posenc.relative.contextual import seed_relative_position_bucket

DT = torch.float64
TOL = 1e-10
NAMES = ["relative-bias", "contextual-1", "contextual-2"]


@pytest.fixture(autouse=True)
def one_thread():
    """The test machines' cores are shared: one thread is several times faster than two under load."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def bucket_loop(x: int, num_buckets: int, max_distance: int) -> int:
    """The article's _relative_position_bucket for one integer, in numpy float32 scalars."""
    half = num_buckets // 2
    out = half if x > 0 else 0
    n = abs(x)
    exact = half // 2
    if n < exact:
        return out + n
    ratio = np.float32(n) / np.float32(exact)
    large = exact + int(np.log(ratio) / np.float32(math.log(max_distance / exact)) * np.float32(half - exact))
    return out + min(large, half - 1)


def test_buckets_match_a_scalar_loop_and_hf_t5():
    x = torch.arange(-300, 301)
    for nb, md in ((32, 128), (8, 20), (4, 3), (33, 50)):
        got = seed_relative_position_bucket(x, nb, md)
        want = torch.tensor([bucket_loop(int(v), nb, md) for v in x])
        assert torch.equal(got, want), (nb, md)
    t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
    for nb, md in ((32, 128), (8, 20)):
        hf = t5.T5Attention._relative_position_bucket(x, bidirectional=True, num_buckets=nb, max_distance=md)
        assert torch.equal(seed_relative_position_bucket(x, nb, md), hf)


# --------------------------------------------------- the article, looped
def make(name, seed=0, d_model=8, n_heads=2, nb=8, md=6, **kw):
    torch.manual_seed(seed)
    dims = {"relative-bias": dict(n_heads=n_heads), "contextual-1": dict(d_model=d_model, n_heads=n_heads,
            head_dim=d_model // n_heads), "contextual-2": dict(d_model=d_model)}[name]  # fmt: skip
    enc = posenc.get(name, num_buckets=nb, max_distance=md, **dims, **kw)
    return MultiHeadAttention(d_model, n_heads, enc).to(DT)


@torch.no_grad()
def article_terms(att: MultiHeadAttention, q, k, q_pos, k_pos, projection_bias=True):
    """The article's compute_bias by loops: returns (term before the temperature, term after it)."""
    enc = att.encoding
    b, h, lq, d = q.shape
    lk = k.shape[2]
    out = torch.zeros(b, h, lq, lk, dtype=DT)
    E = enc.embeddings.weight
    for bi in range(b):
        qp, kp = q_pos[min(bi, q_pos.shape[0] - 1)], k_pos[min(bi, k_pos.shape[0] - 1)]
        for m in range(lq):
            for n in range(lk):
                beta = bucket_loop(int(qp[m]) - int(kp[n]), enc.num_buckets, enc.max_distance)  # query - key
                r = E[beta]
                for hh in range(h):
                    sl = slice(hh * d, (hh + 1) * d)
                    if enc.info.name == "relative-bias":
                        out[bi, hh, m, n] = E[beta, hh]
                    elif enc.info.name == "contextual-1":
                        out[bi, hh, m, n] = q[bi, hh, m] @ (enc.to_r.weight @ r)[sl]
                    else:
                        wk, wq = att.k_proj, att.q_proj
                        kr = wk.weight @ r + (wk.bias if projection_bias else 0.0)
                        qr = wq.weight @ r + (wq.bias if projection_bias else 0.0)
                        out[bi, hh, m, n] = q[bi, hh, m] @ kr[sl] + k[bi, hh, n] @ qr[sl]
    return (None, out) if enc.info.name == "relative-bias" else (out, None)


@pytest.mark.parametrize(
    "name,projection_bias",
    [("relative-bias", True), ("contextual-1", True), ("contextual-2", True), ("contextual-2", False)],
)
def test_hooks_match_article_loop(name, projection_bias):
    kw = {"projection_bias": projection_bias} if name == "contextual-2" else {}
    att = make(name, nb=8, md=6, **kw)
    with torch.no_grad():
        att.q_proj.bias.normal_()
        att.k_proj.bias.normal_()
    enc = att.encoding
    q, k = torch.randn(2, 2, 5, 4, dtype=DT), torch.randn(2, 2, 9, 4, dtype=DT)
    q_pos, k_pos = torch.tensor([[4, 5, 6, 7, 8], [10, 20, 30, 31, 32]]), torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8]])
    before, after = article_terms(att, q, k, q_pos, k_pos, projection_bias)
    for reference in (False, True):
        ctx = AttentionContext(q_pos=q_pos, k_pos=k_pos, n_heads=2, head_dim=4, reference=reference, attention=att)
        if before is not None:
            torch.testing.assert_close(enc.logits(q, k, ctx), before, atol=TOL, rtol=0)
        else:
            torch.testing.assert_close(enc.bias(ctx).expand_as(after), after, atol=TOL, rtol=0)


@torch.no_grad()
def article_attention(att: MultiHeadAttention, x, pos):
    """softmax((q·k + contextual) / sqrt(d) + bias) v, then W_O, with the article's terms from the loop."""
    b, n, _ = x.shape
    h, d = att.n_heads, att.head_dim
    q = att.q_proj(x).view(b, n, h, d).transpose(1, 2)
    k = att.k_proj(x).view(b, n, h, d).transpose(1, 2)
    v = att.v_proj(x).view(b, n, h, d).transpose(1, 2)
    before, after = article_terms(att, q, k, pos, pos)
    s = q @ k.transpose(-1, -2)
    s = (s + before if before is not None else s) / math.sqrt(d)
    s = s + after if after is not None else s
    return att.o_proj((torch.softmax(s, -1) @ v).transpose(1, 2).reshape(b, n, h * d))


@pytest.mark.parametrize("name", NAMES)
def test_attention_matches_article_loop(name):
    att = make(name, seed=1, nb=8, md=6)
    x = torch.randn(2, 9, 8, dtype=DT)
    pos = torch.arange(9)[None]
    want = article_attention(att, x, pos)
    for path in ("fast", "reference"):
        att.path = path
        torch.testing.assert_close(att(x), want, atol=TOL, rtol=0)


# ------------------------------------------------------ fast == reference
@pytest.mark.parametrize("name", NAMES)
def test_paths_agree_masks_offsets_cache(name):
    att = make(name, seed=2, nb=8, md=6)
    x = torch.randn(3, 10, 8, dtype=DT)
    pad = torch.ones(3, 10, dtype=torch.bool)
    pad[2, :3] = False
    pos = torch.stack([torch.arange(10), torch.arange(10) + 77, torch.arange(0, 30, 3)])
    outs = []
    for path in ("fast", "reference"):
        att.path = path
        outs.append(att(x, positions=pos, attention_mask=pad, causal=True))
        full = att(x, causal=True)
        cache = KVCache()
        parts = [att(x[:, :7], causal=True, kv_cache=cache), att(x[:, 7:], causal=True, kv_cache=cache)]
        torch.testing.assert_close(torch.cat(parts, 1), full, atol=TOL, rtol=0)
    torch.testing.assert_close(outs[0], outs[1], atol=TOL, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_translation_invariance(name):
    att = make(name, seed=3)
    x = torch.randn(2, 8, 8, dtype=DT)
    pos = torch.tensor([0, 1, 3, 4, 8, 9, 15, 40])
    for path in ("fast", "reference"):
        att.path = path
        torch.testing.assert_close(att(x, positions=pos + 500), att(x, positions=pos), atol=TOL, rtol=0)


def _lld(shapes, lq, lk):
    """A tensor with [.., Lq, Lk, more ..] dimensions: per-pair vectors."""
    return any(s[i : i + 2] == (lq, lk) and len(s) > i + 2 for s in shapes for i in range(len(s) - 1))


@pytest.mark.parametrize("name", ["contextual-1", "contextual-2"])
def test_fast_path_builds_no_lq_lk_d_tensor(name):
    att = make(name)
    x = torch.randn(1, 13, 8, dtype=DT)
    for path, expect in (("fast", False), ("reference", True)):
        att.path = path
        with ShapeRecorder() as rec:
            att(x).sum().backward()
        assert _lld(rec.shapes, 13, 13) is expect, path


# ----------------------------------------------------------------- learning
@pytest.mark.parametrize("name", NAMES)
def test_gradients_reach_parameters(name):
    for path in ("fast", "reference"):
        att = make(name)
        att.path = path
        att(torch.randn(2, 7, 8, dtype=DT)).pow(2).sum().backward()
        enc = att.encoding
        params = [enc.embeddings.weight] + ([enc.to_r.weight] if name == "contextual-1" else [])
        for p in params:
            assert p.grad is not None and p.grad.abs().sum() > 0
        used = torch.unique(seed_relative_position_bucket(torch.arange(7)[:, None] - torch.arange(7), 8, 6))
        assert enc.embeddings.weight.grad[used].abs().sum(-1).gt(0).all()


@pytest.mark.parametrize("name", NAMES)
def test_tiny_model_trains(name):
    torch.manual_seed(0)
    model = posenc.SequenceClassifier(
        6,
        2,
        encoding=name,
        encoding_options={"num_buckets": 8, "max_distance": 8},
        d_model=16,
        n_layers=2,
        n_heads=2,
        d_ff=32,
    )
    encs = [b.attn.encoding for b in model.trunk.blocks]
    assert encs[0] is encs[1]  # one module for every layer, as one RelativePositionEmbedding
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, 6, (32, 6), generator=g)
    labels = torch.randint(0, 2, (32,), generator=g)
    for row in range(32):
        a, b = torch.randperm(6, generator=g)[:2].sort().values.tolist()
        tokens[row, a], tokens[row, b] = (1, 2) if labels[row] == 1 else (2, 1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(150):
        loss = F.cross_entropy(model(tokens), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    # 150 steps (was 60: relative-bias stalled at 0.64-0.79 of its first loss on 3 of 6 seeds). Last five / first
    # five over seeds 0-5 (each test's torch.manual_seed shifted), native kernels on and off: at most 0.001
    # (relative-bias, contextual-2) and 0.17 (contextual-1); no learning stays near 1.
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5


# ---------------------------------------------------------------- bad input
def test_bad_input_errors():
    with pytest.raises(ConfigError, match="num_buckets must be an integer >= 4.*got 2"):
        posenc.get("relative-bias", n_heads=2, num_buckets=2)
    with pytest.raises(ConfigError, match="max_distance must be an integer > 8.*got 8"):
        posenc.get("contextual-2", d_model=8, num_buckets=32, max_distance=8)
    with pytest.raises(ConfigError, match="n_heads must be a positive"):
        posenc.get("relative-bias", n_heads=0)
    # sizes other than the attention's fail when the attention is built, naming both and the right one
    with pytest.raises(ConfigError, match="'relative-bias' was built for n_heads=3 but is used with n_heads=2"):
        MultiHeadAttention(8, 2, posenc.get("relative-bias", n_heads=3))
    with pytest.raises(ConfigError, match="built for n_heads=2, head_dim=4 but is used with n_heads=4, head_dim=2"):
        MultiHeadAttention(8, 4, posenc.get("contextual-1", d_model=8, n_heads=2, head_dim=4))
    with pytest.raises(ConfigError, match=r"built for d_model=12 but is used with d_model=8.*build it with d_model=8"):
        MultiHeadAttention(8, 2, posenc.get("contextual-2", d_model=12))
    with pytest.raises(ConfigError, match="built for d_model=12 but is used with d_model=8"):
        posenc.Encoder(10, encoding=posenc.get("contextual-2", d_model=12), d_model=8, n_heads=2)
    # swapped in after construction (or used standalone), the call still checks
    for good, wrong, message in [
        (
            MultiHeadAttention(8, 2, posenc.get("relative-bias", n_heads=2)),
            posenc.get("relative-bias", n_heads=3),
            "built for n_heads=3",
        ),
        (
            MultiHeadAttention(8, 4, posenc.get("contextual-1", d_model=8, n_heads=4, head_dim=2)),
            posenc.get("contextual-1", d_model=8, n_heads=2, head_dim=4),
            "built for n_heads=2, head_dim=4; got 4, 2",
        ),
        (
            MultiHeadAttention(8, 2, posenc.get("contextual-2", d_model=8)),
            posenc.get("contextual-2", d_model=12),
            "d_model=12 but the attention's projections take 8",
        ),
    ]:
        good.encoding = wrong
        with pytest.raises(ConfigError, match=message):
            good(torch.randn(1, 3, 8))
    enc = posenc.get("contextual-2", d_model=8)
    ctx = AttentionContext(q_pos=torch.arange(3)[None], k_pos=torch.arange(3)[None], n_heads=2, head_dim=4)
    with pytest.raises(ConfigError, match="attention's own q_proj and k_proj"):
        enc.logits(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4), ctx)
    with pytest.raises(PositionError, match="integer"):
        make("contextual-1")(torch.randn(1, 3, 8, dtype=DT), positions=torch.tensor([0.0, 0.5, 1.0]))
