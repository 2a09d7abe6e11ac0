"""HF BERT's relative_key / relative_key_query ("relative-key", "relative-key-query").

Truth: HF transformers 4.57 BertSelfAttention given the same weights, through the fixture of
scripts/fixtures_hf457_bert_nezha.py (the module was removed in transformers 5), float64,
tol 1e-10; and the formula of anon., "Revisiting absolute position embedding" evaluated by a
naive loop here (float64, tol 1e-10).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from shape_recorder import ShapeRecorder

import posenc
from posenc.attention import KVCache, MultiHeadAttention
from posenc.base import AttentionContext
from posenc.errors import ConfigError, PositionError

FIXTURES = Path(__file__).parent / "fixtures"
DT = torch.float64
TOL = 1e-10


@pytest.fixture(autouse=True)
def one_thread():
    """The test machines' cores are shared: one thread is several times faster than two under load."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


KINDS = ["relative-key", "relative-key-query"]


@torch.no_grad()
def naive(att: MultiHeadAttention, x, q_pos, key_query: bool, max_len: int, clip: bool = False):
    """A_ij = (q_i·k_j + q_i·E[i-j+L-1] (+ k_j·E[i-j+L-1])) / sqrt(d), by loops."""
    b, n, _ = x.shape
    h, d = att.n_heads, att.head_dim
    E = att.encoding.distance_embedding.weight
    q = (x @ att.q_proj.weight.T + att.q_proj.bias).view(b, n, h, d)
    k = (x @ att.k_proj.weight.T + att.k_proj.bias).view(b, n, h, d)
    v = (x @ att.v_proj.weight.T + att.v_proj.bias).view(b, n, h, d)
    z = torch.zeros(b, n, h, d, dtype=x.dtype)
    for bi in range(b):
        p = q_pos[min(bi, q_pos.shape[0] - 1)]
        for hi in range(h):
            for i in range(n):
                scores = []
                for j in range(n):
                    dist = int(p[i]) - int(p[j])
                    if clip:
                        dist = max(-(max_len - 1), min(max_len - 1, dist))
                    r = E[dist + max_len - 1]
                    s = q[bi, i, hi] @ k[bi, j, hi] + q[bi, i, hi] @ r
                    if key_query:
                        s = s + k[bi, j, hi] @ r
                    scores.append(float(s) / math.sqrt(d))
                alpha = torch.softmax(torch.tensor(scores, dtype=DT), 0)
                z[bi, i, hi] = (alpha[:, None] * v[bi, :, hi]).sum(0)
    return z.reshape(b, n, h * d) @ att.o_proj.weight.T + att.o_proj.bias


def make(kind, max_len=8, clip=False, seed=0, d_model=8, n_heads=2):
    torch.manual_seed(seed)
    enc = posenc.get(kind, head_dim=d_model // n_heads, max_len=max_len, clip=clip)
    att = MultiHeadAttention(d_model, n_heads, enc).to(DT)
    with torch.no_grad():
        enc.distance_embedding.weight.normal_(0, 0.5)  # larger than BERT's 0.02 so the term matters
    return att


def both_paths(att, *args, **kwargs):
    out = []
    for path in ("fast", "reference"):
        att.path = path
        out.append(att(*args, **kwargs))
    att.path = "auto"
    return out


# -------------------------------------------------------- HF 4.57 fixture
def _load(case: dict, kind: str) -> MultiHeadAttention:
    cfg = case["config"]
    hd = cfg["hidden_size"] // cfg["num_attention_heads"]
    enc = posenc.get(kind, head_dim=hd, max_len=cfg["max_position_embeddings"])
    att = MultiHeadAttention(cfg["hidden_size"], cfg["num_attention_heads"], enc).to(DT)
    sd = case["state_dict"]
    with torch.no_grad():
        for ours, theirs in (("q_proj", "query"), ("k_proj", "key"), ("v_proj", "value")):
            getattr(att, ours).weight.copy_(sd[f"{theirs}.weight"])
            getattr(att, ours).bias.copy_(sd[f"{theirs}.bias"])
        att.o_proj.weight.copy_(torch.eye(cfg["hidden_size"], dtype=DT))  # BertSelfAttention has no W_O
        att.o_proj.bias.zero_()
        enc.distance_embedding.weight.copy_(sd["distance_embedding.weight"])
    return att


@pytest.mark.parametrize("kind", KINDS)
def test_matches_hf457_bert_self_attention(kind):
    fx = torch.load(FIXTURES / "hf457_bert_relative.pt")
    assert fx["transformers"].startswith("4.57")
    case = fx[kind.replace("-", "_")]
    att = _load(case, kind)
    # a full sequence of max_position_embeddings tokens (every distance row used), with key padding
    for got in both_paths(att, case["x"], attention_mask=case["mask"].bool()):
        torch.testing.assert_close(got, case["out"], atol=TOL, rtol=0)
    for path in ("fast", "reference"):
        att.path = path
        cache = KVCache()
        first = att(case["x1"], kv_cache=cache)
        step = att(case["x2"], kv_cache=cache)
        # a 4-token prompt into an empty cache: posenc uses the true positions 0..3, = HF without a cache
        torch.testing.assert_close(first, case["out_first_nocache"], atol=TOL, rtol=0)
        # one new token: HF's position key_length - 1 is right, and we agree
        torch.testing.assert_close(step, case["out_step"], atol=TOL, rtol=0)
        # HF 4.57 with a cache gives every query of the prompt the position key_length - 1 = 3;
        # reproducing that with explicit positions gives HF's number, and it is not the true one
        hf_like = att(case["x1"], positions=torch.full((4,), 3), key_positions=torch.arange(4))
        torch.testing.assert_close(hf_like, case["out_first"], atol=TOL, rtol=0)
        assert (case["out_first"] - case["out_first_nocache"]).abs().max() > 1e-3


# ---------------------------------------------------- the formula, looped
@pytest.mark.parametrize("kind", KINDS)
def test_matches_formula_loop(kind):
    att = make(kind, max_len=12)
    x = torch.randn(2, 6, 8, dtype=DT)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5], [4, 6, 7, 9, 12, 15]])  # per-sequence, gaps, offset
    want = naive(att, x, pos, kind.endswith("query"), 12)
    for got in both_paths(att, x, positions=pos):
        torch.testing.assert_close(got, want, atol=TOL, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_distance_beyond_table_raises_or_clips(kind):
    x = torch.randn(1, 6, 8, dtype=DT)
    pos = torch.tensor([0, 1, 2, 3, 4, 9])  # distances up to 9, table covers |i-j| <= 4
    att = make(kind, max_len=5)
    for path in ("fast", "reference"):
        att.path = path
        with pytest.raises(PositionError, match=r"\|i - j\| <= 4 \(max_len=5.*9 positions apart.*clip=True"):
            att(x, positions=pos)
    clipped = make(kind, max_len=5, clip=True)
    want = naive(clipped, x, pos[None], kind.endswith("query"), 5, clip=True)
    for got in both_paths(clipped, x, positions=pos):
        torch.testing.assert_close(got, want, atol=TOL, rtol=0)


# ------------------------------------------------------ fast == reference
@pytest.mark.parametrize("kind", KINDS)
def test_hook_fast_equals_literal(kind):
    torch.manual_seed(1)
    enc = posenc.get(kind, head_dim=4, max_len=64).to(DT)  # a large table: only the used rows are scored
    q, k = torch.randn(2, 2, 3, 4, dtype=DT), torch.randn(2, 2, 10, 4, dtype=DT)
    for q_pos, k_pos in (
        (torch.arange(7, 10)[None], torch.arange(10)[None]),  # KV cache
        (torch.tensor([[40, 41, 42], [0, 5, 9]]), torch.randint(0, 50, (2, 10))),
    ):
        f = AttentionContext(q_pos=q_pos, k_pos=k_pos, n_heads=2, head_dim=4, reference=False)
        r = AttentionContext(q_pos=q_pos, k_pos=k_pos, n_heads=2, head_dim=4, reference=True)
        torch.testing.assert_close(enc.logits(q, k, f), enc.logits(q, k, r), atol=TOL, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_attention_paths_agree_masks_offsets_cache(kind):
    att = make(kind, max_len=20, seed=2)
    x = torch.randn(3, 9, 8, dtype=DT)
    pad = torch.ones(3, 9, dtype=torch.bool)
    pad[1, :4] = False
    pos = torch.stack([torch.arange(9), torch.arange(9) + 50, torch.arange(0, 18, 2)])
    fast, ref = both_paths(att, x, positions=pos, attention_mask=pad)
    torch.testing.assert_close(fast, ref, atol=TOL, rtol=0)
    for path in ("fast", "reference"):
        att.path = path
        full = att(x, causal=True)
        cache = KVCache()
        parts = [att(x[:, :5], causal=True, kv_cache=cache), att(x[:, 5:], causal=True, kv_cache=cache)]
        torch.testing.assert_close(torch.cat(parts, 1), full, atol=TOL, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_translation_invariance(kind):
    att = make(kind, max_len=8, seed=3)
    x = torch.randn(2, 7, 8, dtype=DT)
    pos = torch.arange(7)
    for path in ("fast", "reference"):
        att.path = path
        torch.testing.assert_close(att(x, positions=pos + 300), att(x, positions=pos), atol=TOL, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_fast_path_builds_no_lq_lk_d_tensor(kind):
    att = make(kind, max_len=32)
    x = torch.randn(1, 11, 8, dtype=DT)
    for path, expect in (("fast", False), ("reference", True)):
        att.path = path
        with ShapeRecorder() as rec:
            att(x).sum().backward()
        assert any(len(s) >= 3 and s[-3:] == (11, 11, 4) for s in rec.shapes) is expect, path


# ----------------------------------------------------------------- learning
@pytest.mark.parametrize("kind", KINDS)
def test_gradients_reach_distance_embedding(kind):
    for path in ("fast", "reference"):
        att = make(kind, max_len=6)
        att.path = path
        att(torch.randn(2, 6, 8, dtype=DT)).pow(2).sum().backward()
        g = att.encoding.distance_embedding.weight.grad
        assert g is not None and g.abs().sum(-1).gt(0).all()  # all 2*6-1 distances occur at L=6


def test_tiny_model_trains_with_its_own_table_per_layer():
    torch.manual_seed(0)
    model = posenc.SequenceClassifier(
        6, 2, encoding="relative-key-query", d_model=16, n_layers=2, n_heads=2, d_ff=32, max_len=8
    )
    encs = [b.attn.encoding for b in model.trunk.blocks]
    assert encs[0] is not encs[1] and encs[0].max_len == 8  # the model's max_len is passed through
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
    # 150 steps (was 60: 0.76-0.93 of the first loss on 3 of 6 seeds). Last five / first five over seeds 0-5 (the
    # manual_seed shifted), native kernels on and off: 0.000-0.47 (one seed sits on a plateau at 0.47, the rest
    # below 0.01); no learning stays near 1.
    assert sum(losses[-5:]) / 5 < 0.75 * sum(losses[:5]) / 5


# ---------------------------------------------------------------- bad input
def test_bad_input_errors():
    with pytest.raises(ConfigError, match="max_len.*>= 1, got 0"):
        posenc.get("relative-key", head_dim=4, max_len=0)
    with pytest.raises(ConfigError, match="head_dim must be a positive integer"):
        posenc.get("relative-key-query", head_dim=-2)
    att = make("relative-key")
    with pytest.raises(PositionError, match="integer"):
        att(torch.randn(1, 3, 8, dtype=DT), positions=torch.tensor([0.0, 1.0, 2.5]))
    with pytest.raises(ConfigError, match=r"built for head_dim=4 but is used with head_dim=6.*head_dim=6\)"):
        MultiHeadAttention(12, 2, posenc.get("relative-key", head_dim=4))
    wrong = MultiHeadAttention(12, 2, posenc.get("relative-key", head_dim=6)).to(DT)
    wrong.encoding = posenc.get("relative-key", head_dim=4).to(DT)  # swapped in after construction: still checked
    with pytest.raises(ConfigError, match="head_dim=4, got 6"):
        wrong(torch.randn(1, 3, 12, dtype=DT))
    # a model longer than the table names the limit instead of an IndexError
    model = posenc.Encoder(10, encoding="relative-key", d_model=8, n_heads=2, n_layers=1, max_len=4)
    with pytest.raises(PositionError, match="max_len=4"):
        model(torch.randint(0, 10, (1, 6)))
