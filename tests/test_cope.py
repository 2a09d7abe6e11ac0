"""CoPE against a naive float64 loop of the paper's equations (with the reference code's choices:
gates from q·k/√d, position term added after the temperature). Tolerance 1e-10 (float64)."""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from shape_recorder import ShapeRecorder

import posenc
import posenc.bias.cope as cope_module
from posenc import ConfigError, MultiHeadAttention
from posenc.base import AttentionContext
from posenc.bias.cope import cope_attention


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


def attention_pair(kernel=False, **opts):
    enc = random_cope(6, **opts)
    if kernel:
        enc.fused_min_pairs = 1  # the blocked kernel even at these lengths (its threshold is for speed)
    fast = MultiHeadAttention(8, 2, enc, path="fast").double()
    ref = MultiHeadAttention(8, 2, enc, path="reference").double()
    ref.load_state_dict(fast.state_dict())
    return fast, ref


@pytest.mark.parametrize("kernel", [False, True])
@pytest.mark.parametrize("offset", [0, 11])
@pytest.mark.parametrize("causal", [True, False])
def test_fast_equals_reference_with_masks_and_offsets(offset, causal, kernel):
    fast, ref = attention_pair(kernel, causal=causal)
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
    real = CoPE._one_query_positions
    monkeypatch.setattr(
        CoPE,
        "_one_query_positions",
        lambda self, q, k, ctx: seen.append(ctx.scores is not None) or real(self, q, k, ctx),
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


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("gates", ["half", "closed", "open", "mixed"])
@pytest.mark.parametrize("keys", [3, 40, 301])
def test_one_query_positions_on_a_window_equal_every_keys(keys, gates, masked, causal):
    """A decoding step computes the gates, their running sum and the interpolation on a window of the last keys
    only (every position before it is clamped); its logits and their gradients equal the literal formula's over
    every key: gates near 1/2 (the window of 2n + 64 keys), near 0 (it grows to every key), near 1 (clamped at
    once), and a mix, with and without a mask, with the query's position past the keys' or among them."""
    torch.manual_seed(keys)
    enc = random_cope(5, causal=causal).double()
    h, d = 2, 4
    q = torch.randn(2, h, 1, d, dtype=torch.float64) * 0.1
    k = torch.randn(2, h, keys, d, dtype=torch.float64)
    if gates != "half":  # q·k/√d of about -40 (closed), +40 (open), or either per key (mixed)
        sign = {"closed": -1.0, "open": 1.0, "mixed": torch.randn(1, 1, keys, 1).sign()}[gates]
        q = torch.ones_like(q) * 10
        k = k.abs() * sign * 2
    q.requires_grad_(True)
    k.requires_grad_(True)
    k_pos = torch.arange(keys)[None]
    q_pos = torch.tensor([[keys - 1 if causal else keys // 2]])
    mask = torch.rand(2, 1, 1, keys) > 0.3 if masked else None
    ctx = dict(q_pos=q_pos, k_pos=k_pos, n_heads=h, head_dim=d, mask=mask)
    got = enc.logits(q, k, AttentionContext(**ctx))
    want = enc.logits(q, k, AttentionContext(**ctx, reference=True))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    handed = AttentionContext(**ctx)  # the materialised kernel hands the step its q·kᵀ: the window slices it
    handed.scores = torch.matmul(q, k.transpose(-1, -2)).detach()
    torch.testing.assert_close(enc.logits(q, k, handed), want, rtol=1e-10, atol=1e-10)
    w = torch.randn_like(got)
    g_got = torch.autograd.grad((got * w).sum(), [q, k, enc.pos_emb])
    g_want = torch.autograd.grad((want * w).sum(), [q, k, enc.pos_emb])
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_a_decoding_step_computes_the_gates_of_a_window_not_of_the_whole_cache(monkeypatch):
    """At a context of 2,000 keys and npos_max 16, a decoding step's sigmoid sees the window of 2·16 + 64 keys (the
    gates near 1/2 reach the clamp well inside it), not 2,000."""
    seen = []
    real = torch.sigmoid
    monkeypatch.setattr(torch, "sigmoid", lambda x: seen.append(x.shape[-1]) or real(x))
    enc = posenc.get("cope", head_dim=8, npos_max=16)
    q, k = torch.randn(1, 2, 1, 8) * 0.1, torch.randn(1, 2, 2000, 8)
    ctx = AttentionContext(q_pos=torch.tensor([[1999]]), k_pos=torch.arange(2000)[None], n_heads=2, head_dim=8)
    out = enc.logits(q, k, ctx)
    assert out.shape == (1, 2, 1, 2000) and seen == [2 * 16 + cope_module.WINDOW_MARGIN]


# ---------------------------------------------------------------- the blocked kernel (cope_attention)
def formula(q, k, v, emb, scale, npos_max, gate_scale, causal=False, gate_end=None, mask=None):
    """The CoPE attention as written, materialised: ``[B, H, Lq, Lk]`` gates, positions and logits."""
    b, h, lq, _ = q.shape
    lk = k.shape[2]
    allowed = torch.ones(b, h, lq, lk, dtype=torch.bool)
    if causal:
        allowed &= torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
    if mask is not None:
        allowed &= mask
    counts = allowed.clone()
    if gate_end is not None:
        counts &= torch.arange(lk)[None, None, None, :] < gate_end[:, None, :, None]
    qk = q @ k.transpose(-1, -2)
    gates = torch.sigmoid(gate_scale * qk) * counts
    p = gates.flip(-1).cumsum(-1).flip(-1).clamp(max=npos_max - 1)  # p_ij = sum_{t >= j} g_it
    lo = p.floor()
    w = p - lo
    table = emb.t()  # e[m] = table[m], [npos_max, Dh]
    e = w[..., None] * table[p.ceil().long()] + (1 - w[..., None]) * table[lo.long()]  # [B, H, Lq, Lk, Dh]
    logits = scale * qk + (q[..., None, :] * e).sum(-1)
    logits = logits.masked_fill(~allowed, torch.finfo(logits.dtype).min)
    return torch.softmax(logits, -1) @ v


def kernel_case(draw_or_seed, b, h, lq, extra, d, npos, causal, gate_end, mask, gate_scale):
    g = torch.Generator().manual_seed(draw_or_seed)
    lk = lq + extra
    q, k, v = (torch.randn(b, h, n, d, dtype=torch.float64, generator=g) for n in (lq, lk, lk))
    emb = torch.randn(d, npos, dtype=torch.float64, generator=g)
    ends = torch.randint(0, lk + 1, (b, lq), generator=g) if gate_end else None
    allowed = None
    if mask:  # a mask per query row, or one key-padding row for all of them
        allowed = torch.rand(b, 1, lq if draw_or_seed % 2 else 1, lk, generator=g) > 0.3
        allowed[..., 0] = True  # every row sees a key (a row that sees none is zeroed by the attention)
    return q, k, v, emb, dict(npos_max=npos, gate_scale=gate_scale, causal=causal, gate_end=ends, mask=allowed)


class rows_per_block:
    """Blocks of ``n`` query rows and windows from ``2·npos_max`` keys inside the ``with`` (small blocks and
    windows at small lengths: many blocks, windows shorter than the keys, and their fallbacks)."""

    def __init__(self, n, margin=0):
        self.n, self.margin = n, margin

    def __enter__(self):
        self.before = cope_module.BLOCK_ROWS, cope_module.WINDOW_MARGIN
        cope_module.BLOCK_ROWS, cope_module.WINDOW_MARGIN = self.n, self.margin

    def __exit__(self, *exc):
        cope_module.BLOCK_ROWS, cope_module.WINDOW_MARGIN = self.before


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    b=st.integers(1, 2),
    h=st.integers(1, 3),
    lq=st.integers(1, 40),
    extra=st.integers(0, 12),
    d=st.integers(1, 6),
    npos=st.integers(2, 9),
    causal=st.booleans(),
    gate_end=st.booleans(),
    mask=st.booleans(),
    gate_scale=st.sampled_from([0.3, 1.0, -4.0, 6.0]),  # gates near 1/2, near 0 or 1: windows short and long
    rows=st.sampled_from([1, 3, 8, 128]),
)
def test_kernel_equals_the_formula_values_and_gradients(
    seed, b, h, lq, extra, d, npos, causal, gate_end, mask, gate_scale, rows
):
    q, k, v, emb, opts = kernel_case(seed, b, h, lq, extra, d, npos, causal, gate_end, mask, gate_scale)
    leaves = [t.requires_grad_() for t in (q, k, v, emb)]
    with rows_per_block(rows):
        got = cope_attention(q, k, v, emb, 0.7, **opts)
        expect = formula(q, k, v, emb, 0.7, **opts)
        torch.testing.assert_close(got, expect, rtol=1e-10, atol=1e-10)
        dout = torch.randn(got.shape, dtype=got.dtype, generator=torch.Generator().manual_seed(seed + 1))
        for a, e in zip(torch.autograd.grad(got, leaves, dout), torch.autograd.grad(expect, leaves, dout)):
            torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize(
    "causal,gate_end,mask,gate_scale",
    [(True, False, False, 0.5), (False, False, False, 0.5), (True, True, True, 2.0), (False, True, True, -3.0)],
)
def test_kernel_gradcheck(causal, gate_end, mask, gate_scale):
    """Every block of 2 rows, windows from 4 keys (npos_max 2): the hand-written backward against finite
    differences."""
    q, k, v, emb, opts = kernel_case(7, 1, 2, 9, 2, 2, 2, causal, gate_end, mask, gate_scale)
    with rows_per_block(2):
        assert torch.autograd.gradcheck(  # fast mode: random directions, a few evaluations
            lambda *t: cope_attention(*t, 0.8, **opts),
            [t.requires_grad_() for t in (q, k, v, emb)],
            fast_mode=True,
            atol=1e-7,
            rtol=1e-5,
        )


def test_kernel_window_past_which_positions_are_clamped():
    """Long rows, few embeddings: each block computes its gates on a window from its rows' diagonal only, and the
    answer is still the formula's (the keys past it all sit at the last embedding)."""
    q, k, v, emb, opts = kernel_case(3, 1, 2, 300, 0, 4, 4, True, False, False, 1.0)
    leaves = [t.requires_grad_() for t in (q, k, v, emb)]
    windows: list[tuple[bool, int]] = []
    block_logits = cope_module._block_logits

    def recorded(*args):
        out = block_logits(*args)
        windows.append(out[1])
        return out

    spy = mock.patch.object(cope_module, "_block_logits", recorded)
    with rows_per_block(32, margin=cope_module.WINDOW_MARGIN), spy:
        got = cope_attention(q, k, v, emb, 0.5, **opts)
        skewed = [w for skew, w in windows if skew]
        assert skewed and max(skewed) < 300 // 2  # most blocks: a window of its own, far shorter than the keys
        forward = list(windows)
        expect = formula(q, k, v, emb, 0.5, **opts)
        torch.testing.assert_close(got, expect, rtol=1e-10, atol=1e-10)
        dout = torch.randn(got.shape, dtype=got.dtype, generator=torch.Generator().manual_seed(0))
        for a, e in zip(torch.autograd.grad(got, leaves, dout), torch.autograd.grad(expect, leaves, dout)):
            torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-9)
    assert windows[len(forward) :] == forward  # the backward found each block's window again: the same


def test_kernel_never_holds_a_query_by_key_tensor():
    """Memory O(rows · Lk) per (batch, head): no tensor of the forward or backward has Lq·Lk entries per head."""
    b, h, length, d = 1, 2, 256, 4
    q, k, v, emb, opts = kernel_case(5, b, h, length, 0, d, 8, True, False, False, 1.0)
    leaves = [t.requires_grad_() for t in (q, k, v, emb)]
    with rows_per_block(16), ShapeRecorder() as rec:
        out = cope_attention(q, k, v, emb, 0.5, **opts)
        torch.autograd.grad(out.square().sum(), leaves)
    biggest = max(math.prod(s) for s in rec.shapes)
    assert biggest <= b * h * 16 * length < b * h * length * length // 8, biggest


def test_blocked_attention_equals_the_logits_hook_at_another_temperature():
    """A transformers model's ``scaling`` may differ from 1/√d: the kernel then gives what logits() gives."""
    enc = random_cope(5)
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 2, 12, 4, dtype=torch.float64, generator=g) for _ in range(3))
    pos = torch.arange(12)[None]
    ctx = AttentionContext(q_pos=pos, k_pos=pos, n_heads=2, head_dim=4)
    run = enc.blocked_attention(ctx)
    assert run is not None
    causal = torch.ones(12, 12, dtype=torch.bool).tril()
    for scale in (0.5, 0.13):
        got = run(q, k, v, scale, True, None)
        logits = (q @ k.transpose(-1, -2) + enc.logits(q, k, ctx).detach()) * scale
        expect = torch.softmax(logits.masked_fill(~causal, -math.inf), -1) @ v
        torch.testing.assert_close(got, expect, rtol=1e-10, atol=1e-10)


def test_blocked_attention_declines_keys_out_of_position_order_and_the_reference_path():
    enc = random_cope(5)
    pos = torch.arange(6)[None]
    shuffled = torch.tensor([[0, 2, 1, 3, 4, 5]])
    assert enc.blocked_attention(AttentionContext(q_pos=pos, k_pos=pos, n_heads=1, head_dim=4)) is not None
    assert enc.blocked_attention(AttentionContext(q_pos=pos, k_pos=shuffled, n_heads=1, head_dim=4)) is None
    assert enc.blocked_attention(AttentionContext(q_pos=pos, k_pos=pos, n_heads=1, head_dim=4, reference=True)) is None
    # keys out of order: the plan falls back to the materialised logits, with the same numbers as the reference
    fast, ref = attention_pair(kernel=True)
    x = torch.randn(1, 6, 8, dtype=torch.float64)
    got = fast(x, positions=shuffled)
    assert fast.last_plan.kernel != "own-blocked"
    torch.testing.assert_close(got, ref(x, positions=shuffled), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("causal", [True, False])
def test_attention_takes_the_kernel_and_equals_the_naive_loop(causal):
    enc = random_cope(4, causal=causal)
    enc.fused_min_pairs = 1
    att = MultiHeadAttention(8, 2, enc).double()
    x = torch.randn(2, 11, 8, dtype=torch.float64)
    with rows_per_block(4):
        got = att(x, causal=causal)
    assert att.last_plan.kernel == "own-blocked"
    q, k, v = (att._split(p(x)) for p in (att.q_proj, att.k_proj, att.v_proj))
    emb = enc.pos_emb.detach().double()
    heads = torch.stack(
        [
            torch.stack(
                [naive_cope_attention(q[b, h], k[b, h], v[b, h], emb, npos_max=4, causal=causal)[1] for h in range(2)]
            )
            for b in range(2)
        ]
    )
    # (the naive loop's causal=False is the reference code without a mask: every key attends and counts)
    torch.testing.assert_close(got, att.o_proj(heads.transpose(1, 2).reshape(2, 11, 8)), rtol=1e-10, atol=1e-10)


def test_language_model_training_step_takes_the_kernel_and_equals_the_reference_model():
    torch.manual_seed(0)
    fast = posenc.LanguageModel(20, encoding="cope", d_model=16, n_heads=2, n_layers=2, max_len=64).double()
    ref = posenc.LanguageModel(20, encoding="cope", d_model=16, n_heads=2, n_layers=2, max_len=64, path="reference")
    ref = ref.double()
    with torch.no_grad():
        for p in fast.parameters():
            p.add_(0.3 * torch.randn_like(p))
    ref.load_state_dict(fast.state_dict())
    for m in fast.modules():
        if isinstance(m, cope_module.CoPE):
            m.fused_min_pairs = 1
    tokens = torch.randint(0, 20, (2, 30))
    losses = [m.loss(tokens) for m in (fast, ref)]
    assert all(b.attn.last_plan.kernel == "own-blocked" for b in fast.trunk.blocks)
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-10, atol=1e-12)
    for (name, a), b in zip(fast.named_parameters(), torch.autograd.grad(losses[1], list(ref.parameters()))):
        (ga,) = torch.autograd.grad(losses[0], [a], retain_graph=True)
        torch.testing.assert_close(ga, b, rtol=1e-8, atol=1e-10, msg=name)


@pytest.mark.parametrize(
    "args,match",
    [
        (dict(k=torch.zeros(1, 1, 3, 5)), "must be \\[B, H, Lq\\|Lk, Dh\\]"),
        (dict(causal=True, k=torch.zeros(1, 1, 2, 4), v=torch.zeros(1, 1, 2, 4)), "Lk=2 < Lq=3"),
        (dict(emb=torch.zeros(4, 7)), "emb must be \\[head_dim=4, npos_max=5\\], got \\(4, 7\\)"),
        (dict(npos_max=1), "npos_max must be an integer >= 2, got 1"),
        (dict(gate_end=torch.zeros(1, 4, dtype=torch.long)), "gate_end must be \\[1\\|1, Lq=3\\]"),
        (dict(gate_end=torch.zeros(1, 3)), "gate_end must hold integers"),
        (dict(mask=torch.ones(1, 1, 3, 3)), "mask must be booleans"),
        (dict(mask=torch.ones(1, 1, 3, 4, dtype=torch.bool)), "mask must be \\[1\\|1, 1\\|1, 3\\|1, 3\\]"),
    ],
)
def test_kernel_bad_input(args, match):
    call = dict(q=torch.zeros(1, 1, 3, 4), k=torch.zeros(1, 1, 3, 4), v=torch.zeros(1, 1, 3, 4))
    call.update(emb=torch.zeros(4, 5), scale=0.5, npos_max=5, gate_scale=0.5)
    call.update(args)
    with pytest.raises(ConfigError, match=match):
        cope_attention(**call)
