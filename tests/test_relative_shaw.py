"""Shaw et al. 2018 ("shaw") and NEZHA ("nezha").

Truth: the papers' equations evaluated by a naive loop over (b, h, i, j) written here
(float64, tol 1e-10); for NEZHA also HF transformers 4.57 NezhaSelfAttention through the
fixture of scripts/fixtures_hf457_bert_nezha.py (float64 run; tolerances below).
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


# ----------------------------------------------------------------- naive truth
@torch.no_grad()
def naive_attention(att: MultiHeadAttention, x, q_pos, k_pos, a_k, a_v, key_pad=None):
    """Shaw eqs. 3-5 by loops. ``a_k(c)`` / ``a_v(c)`` give the vector for the offset c = j - i (or None)."""
    b, lq, _ = x.shape
    h, d = att.n_heads, att.head_dim
    q = (x @ att.q_proj.weight.T + att.q_proj.bias).view(b, lq, h, d)
    k = (x @ att.k_proj.weight.T + att.k_proj.bias).view(b, lq, h, d)
    v = (x @ att.v_proj.weight.T + att.v_proj.bias).view(b, lq, h, d)
    z = torch.zeros(b, lq, h, d, dtype=x.dtype)
    for bi in range(b):
        qp = q_pos[min(bi, q_pos.shape[0] - 1)]
        kp = k_pos[min(bi, k_pos.shape[0] - 1)]
        for hi in range(h):
            for i in range(lq):
                e = []
                for j in range(lq):
                    c = int(kp[j]) - int(qp[i])
                    key = k[bi, j, hi] + (a_k(c) if a_k is not None else 0.0)
                    score = float(q[bi, i, hi] @ key) / math.sqrt(d)
                    if key_pad is not None and not key_pad[bi, j]:
                        score = -math.inf
                    e.append(score)
                alpha = torch.softmax(torch.tensor(e, dtype=x.dtype), 0)
                for j in range(lq):
                    c = int(kp[j]) - int(qp[i])
                    z[bi, i, hi] += alpha[j] * (v[bi, j, hi] + (a_v(c) if a_v is not None else 0.0))
    return z.reshape(b, lq, h * d) @ att.o_proj.weight.T + att.o_proj.bias


def clip(x: int, k: int) -> int:
    return max(-k, min(k, x))


def attention(enc, d_model=8, n_heads=2, seed=0):
    torch.manual_seed(seed)
    return MultiHeadAttention(d_model, n_heads, enc).to(DT)


def both_paths(att, *args, **kwargs):
    att.path = "fast"
    fast = att(*args, **kwargs)
    att.path = "reference"
    ref = att(*args, **kwargs)
    att.path = "auto"
    return fast, ref


# ---------------------------------------------------------------------- Shaw
@pytest.mark.parametrize("keys,values", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("k", [0, 2])
def test_shaw_matches_paper_loop(keys, values, k):
    enc = posenc.get("shaw", head_dim=4, max_relative_position=k, keys=keys, values=values)
    att = attention(enc)
    x = torch.randn(2, 7, 8, dtype=DT)
    pos = torch.tensor([[3, 4, 5, 6, 7, 8, 9], [0, 2, 3, 7, 8, 9, 15]])  # offsets, gaps, beyond k
    pad = torch.ones(2, 7, dtype=torch.bool)
    pad[1, -2:] = False
    w_k = enc.w_K.detach() if keys else None
    w_v = enc.w_V.detach() if values else None
    want = naive_attention(
        att,
        x,
        pos,
        pos,
        (lambda c: w_k[clip(c, k) + k]) if keys else None,
        (lambda c: w_v[clip(c, k) + k]) if values else None,
        key_pad=pad,
    )
    for got in both_paths(att, x, positions=pos, attention_mask=pad):
        torch.testing.assert_close(got, want, atol=TOL, rtol=0)


def test_shaw_k0_has_no_position_information():
    """k = 0: one vector for every offset, so permuting the tokens permutes the outputs."""
    att = attention(posenc.get("shaw", head_dim=4, max_relative_position=0))
    x = torch.randn(1, 6, 8, dtype=DT)
    perm = torch.tensor([3, 0, 5, 1, 4, 2])
    torch.testing.assert_close(att(x[:, perm]), att(x)[:, perm], atol=TOL, rtol=0)
    # with k = 2 it is not
    att2 = attention(posenc.get("shaw", head_dim=4, max_relative_position=2))
    assert (att2(x[:, perm]) - att2(x)[:, perm]).abs().max() > 1e-3


# ---------------------------------------------------------------------- NEZHA
def paper_sinusoid(c: int, d: int) -> torch.Tensor:
    out = torch.zeros(d, dtype=DT)
    for m in range(d // 2):
        out[2 * m] = math.sin(c / 10000 ** (2 * m / d))
        out[2 * m + 1] = math.cos(c / 10000 ** (2 * m / d))
    return out


@pytest.mark.parametrize("table", ["paper", "hf"])
def test_nezha_matches_paper_loop(table):
    k, d = 3, 4
    enc = posenc.get("nezha", head_dim=d, max_relative_position=k, table=table)
    att = attention(enc, seed=1)
    x = torch.randn(2, 8, 8, dtype=DT)
    pos = torch.arange(5, 13)[None]

    def a(c):  # paper: sinusoid of clip(j-i); HF / released code: sinusoid of clip(j-i) + k
        return paper_sinusoid(clip(c, k) + (k if table == "hf" else 0), d)

    want = naive_attention(att, x, pos, pos, a, a)
    for got in both_paths(att, x, positions=pos):
        torch.testing.assert_close(got, want, atol=TOL, rtol=0)


def _load_nezha(case: dict, table: str) -> MultiHeadAttention:
    cfg = case["config"]
    enc = posenc.get("nezha", head_dim=cfg["hidden_size"] // cfg["num_attention_heads"],
                     max_relative_position=cfg["max_relative_position"], table=table)  # fmt: skip
    att = MultiHeadAttention(cfg["hidden_size"], cfg["num_attention_heads"], enc).to(DT)
    sd = case["state_dict"]
    with torch.no_grad():
        for ours, theirs in (("q_proj", "query"), ("k_proj", "key"), ("v_proj", "value")):
            getattr(att, ours).weight.copy_(sd[f"{theirs}.weight"])
            getattr(att, ours).bias.copy_(sd[f"{theirs}.bias"])
        att.o_proj.weight.copy_(torch.eye(cfg["hidden_size"], dtype=DT))  # HF's self-attention has no W_O
        att.o_proj.bias.zero_()
    return att


@pytest.mark.parametrize("case_name", ["clipped", "default"])
def test_nezha_matches_hf457(case_name):
    fx = torch.load(FIXTURES / "hf457_nezha.pt")
    assert fx["transformers"].startswith("4.57")
    case = fx[case_name]
    if case_name == "default":  # the fixture's case uses NezhaConfig's default clip distance, 64
        assert case["config"]["max_relative_position"] == posenc.get("nezha", head_dim=8).max_relative_position
    att = _load_nezha(case, "hf")
    enc = att.encoding
    # the table: HF builds it in float32, ours is float64 -> agree to float32 rounding of angles up to 2k
    torch.testing.assert_close(enc.a, case["hf_table"], atol=5e-6, rtol=0)
    mask = case["mask"].bool()
    for got in both_paths(att, case["x"], attention_mask=mask):
        torch.testing.assert_close(got, case["out"], atol=5e-6, rtol=0)
    # given HF's own table, the attention arithmetic agrees to float64 precision
    enc.a = case["hf_table"].clone()
    for got in both_paths(att, case["x"], attention_mask=mask):
        torch.testing.assert_close(got, case["out"], atol=TOL, rtol=0)
    # and the paper's table (sinusoid of the offset, not of the shifted row) is a different function
    paper = _load_nezha(case, "paper")
    assert (paper(case["x"], attention_mask=mask) - case["out"]).abs().max() > 1e-2


# ------------------------------------------------------ fast == reference
def _ctx(q_pos, k_pos, reference, h=2, d=4):
    return AttentionContext(q_pos=q_pos, k_pos=k_pos, n_heads=h, head_dim=d, reference=reference)


@pytest.mark.parametrize("name", ["shaw", "nezha"])
def test_hooks_fast_equals_literal(name):
    """The gather / scatter forms equal the literal L×L×d forms: Lq != Lk, per-sequence offsets, beyond k."""
    torch.manual_seed(3)
    enc = posenc.get(name, head_dim=4, max_relative_position=3).to(DT)
    q, k = torch.randn(2, 2, 5, 4, dtype=DT), torch.randn(2, 2, 11, 4, dtype=DT)
    probs = torch.softmax(torch.randn(2, 2, 5, 11, dtype=DT), -1)
    for q_pos, k_pos in (
        (torch.arange(6, 11)[None], torch.arange(11)[None]),  # a KV cache: the last 5 of 11
        (torch.tensor([[0, 1, 2, 3, 4], [20, 21, 22, 23, 40]]), torch.randint(0, 50, (2, 11))),  # anything
    ):
        fast, ref = _ctx(q_pos, k_pos, False), _ctx(q_pos, k_pos, True)
        torch.testing.assert_close(enc.logits(q, k, fast), enc.logits(q, k, ref), atol=TOL, rtol=0)
        torch.testing.assert_close(enc.values(probs, fast), enc.values(probs, ref), atol=TOL, rtol=0)


@pytest.mark.parametrize("name", ["shaw", "nezha"])
def test_attention_paths_agree_with_masks_offsets_and_cache(name):
    enc = posenc.get(name, head_dim=4, max_relative_position=2)
    att = attention(enc, seed=4)
    x = torch.randn(3, 9, 8, dtype=DT)
    pad = torch.ones(3, 9, dtype=torch.bool)
    pad[0, :3] = False  # left padding
    pos = torch.stack([torch.arange(9), torch.arange(9) + 100, torch.arange(9) * 2])
    fast, ref = both_paths(att, x, positions=pos, attention_mask=pad, causal=True)
    torch.testing.assert_close(fast, ref, atol=TOL, rtol=0)
    # KV cache (Lq != Lk): a 6-token prompt then a 3-token chunk equals the full causal run
    for path in ("fast", "reference"):
        att.path = path
        full = att(x, causal=True)
        cache = KVCache()
        first = att(x[:, :6], causal=True, kv_cache=cache)
        second = att(x[:, 6:], causal=True, kv_cache=cache)
        torch.testing.assert_close(torch.cat([first, second], 1), full, atol=TOL, rtol=0)


@pytest.mark.parametrize("name", ["shaw", "nezha"])
def test_translation_invariance(name):
    att = attention(posenc.get(name, head_dim=4, max_relative_position=3), seed=5)
    x = torch.randn(2, 8, 8, dtype=DT)
    pos = torch.tensor([0, 1, 2, 5, 6, 7, 9, 12])
    for path in ("fast", "reference"):
        att.path = path
        torch.testing.assert_close(att(x, positions=pos + 1000), att(x, positions=pos), atol=TOL, rtol=0)


def _has_lld(shapes, lq, lk, d):
    return any(len(s) >= 3 and s[-3:] == (lq, lk, d) for s in shapes)


@pytest.mark.parametrize("name", ["shaw", "nezha"])
def test_fast_path_builds_no_lq_lk_d_tensor(name):
    att = attention(posenc.get(name, head_dim=4, max_relative_position=2))
    x = torch.randn(1, 13, 8, dtype=DT)
    for path, expect in (("fast", False), ("reference", True)):
        att.path = path
        with ShapeRecorder() as rec:
            att(x).sum().backward()
        assert _has_lld(rec.shapes, 13, 13, 4) is expect, path


# ------------------------------------------------------------ learning
def test_gradients_reach_tables():
    enc = posenc.get("shaw", head_dim=4, max_relative_position=2)
    for path in ("fast", "reference"):
        att = attention(enc)
        att.path = path
        enc.zero_grad()
        att(torch.randn(2, 7, 8, dtype=DT)).pow(2).sum().backward()
        for p in (enc.w_K, enc.w_V):
            assert p.grad is not None and p.grad.abs().sum() > 0
            assert p.grad.abs().sum(-1).gt(0).all()  # every offset row is used at L=7 > 2k+1
    nezha = posenc.get("nezha", head_dim=4)
    assert not list(nezha.parameters())  # fixed


def test_each_layer_has_its_own_tables_and_model_trains():
    """A 2-layer classifier with shaw learns 'does token 1 come before token 2'; loss falls."""
    torch.manual_seed(0)
    model = posenc.SequenceClassifier(
        6, 2, encoding="shaw", encoding_options={"max_relative_position": 4}, d_model=16, n_layers=2, n_heads=2, d_ff=32
    )
    encs = [b.attn.encoding for b in model.trunk.blocks]
    assert encs[0] is not encs[1] and not torch.equal(encs[0].w_K, encs[1].w_K)
    g = torch.Generator().manual_seed(0)
    n, length = 32, 6
    tokens = torch.randint(3, 6, (n, length), generator=g)
    labels = torch.randint(0, 2, (n,), generator=g)
    for row in range(n):
        a, b = torch.randperm(length, generator=g)[:2].sort().values.tolist()
        first, second = (1, 2) if labels[row] == 1 else (2, 1)
        tokens[row, a], tokens[row, b] = first, second
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(150):
        loss = F.cross_entropy(model(tokens), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    # 150 steps (was 40: 0.65-0.81 of the first loss on 2 of 6 seeds). Last five / first five over seeds 0-5 (the
    # manual_seed shifted), native kernels on and off: at most 0.003; no learning stays near 1.
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5
    for e in encs:
        assert e.w_K.grad is not None and e.w_V.grad is not None


# ------------------------------------------------------------- bad input
def test_bad_input_errors():
    with pytest.raises(ConfigError, match="max_relative_position.*-1"):
        posenc.get("shaw", head_dim=4, max_relative_position=-1)
    with pytest.raises(ConfigError, match="max_relative_position"):
        posenc.get("shaw", head_dim=4, max_relative_position=2.5)
    with pytest.raises(ConfigError, match="keys=False and values=False"):
        posenc.get("shaw", head_dim=4, keys=False, values=False)
    with pytest.raises(ConfigError, match="head_dim must be a positive"):
        posenc.get("shaw", head_dim=0)
    with pytest.raises(ConfigError, match="head_dim must be even, got 5"):
        posenc.get("nezha", head_dim=5)
    with pytest.raises(ConfigError, match="table must be one of"):
        posenc.get("nezha", head_dim=4, table="shifted")
    with pytest.raises(ConfigError, match="base must be > 1"):
        posenc.get("nezha", head_dim=4, base=1.0)
    att = attention(posenc.get("shaw", head_dim=4))
    with pytest.raises(PositionError, match="integer"):
        att(torch.randn(1, 3, 8, dtype=DT), positions=torch.tensor([0.0, 1.5, 2.0]))
    with pytest.raises(ConfigError, match="'shaw' was built for head_dim=4 but is used with head_dim=6"):
        MultiHeadAttention(12, 2, posenc.get("shaw", head_dim=4))
    wrong = MultiHeadAttention(12, 2, posenc.get("shaw", head_dim=6)).to(DT)
    wrong.encoding = posenc.get("shaw", head_dim=4).to(DT)  # swapped in after construction: still checked
    with pytest.raises(ConfigError, match="head_dim=4, got 6"):
        wrong(torch.randn(1, 3, 12, dtype=DT))
