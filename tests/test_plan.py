"""Which kernel a call takes, decided from what the positions are, for every caller (issue: one fast path).

Models, KV-cache decoding, Transformer-XL memory, shifted rows and dropout take the fast kernels; arbitrary positions
(packed documents restarting at 0, randomized positions) take the gather forms. Every case gives the reference
path's numbers and gradients. The encoding-generic tests run over every registered encoding.
"""

from __future__ import annotations

import pytest
import torch
from test_attention import LENGTH_DEPENDENT, NEEDS_SEGMENTS, names

import posenc
from posenc import fused
from posenc.attention import KERNELS, MultiHeadAttention, Plan, choose_kernel
from posenc.base import PositionalEncoding, contiguous_positions, is_arange_rows, mark_arange
from posenc.fused import RelativeForm, relative_attention
from posenc.registry import example_options

F64 = torch.float64
V = 23


def has_form(enc: PositionalEncoding) -> bool:
    return type(enc).relative_form is not PositionalEncoding.relative_form


def lm(name: str, path: str = "auto", dropout: float = 0.0) -> posenc.LanguageModel:
    torch.manual_seed(0)
    opts = example_options(name, dict(d_model=16, n_heads=2, head_dim=8, max_len=64))
    model = posenc.LanguageModel(
        V,
        encoding=name,
        encoding_options=opts,
        d_model=16,
        n_heads=2,
        n_layers=2,
        max_len=64,
        path=path,
        dropout=dropout,
    ).double()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # off the initial values: a zero-initialised table would hide a dropped term
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    for m in model.modules():
        if isinstance(m, PositionalEncoding):
            m.fused_min_pairs = 1  # the blocked kernel even at these short lengths (its threshold is for speed)
    return model


def plans(model) -> list[Plan]:
    return [b.attn.last_plan for b in model.trunk.blocks]


def fast_kernels(model) -> set[str]:
    return {p.kernel for p in plans(model)}


def expected_kernel(model) -> str:
    """What a contiguous, dropout-free training call of this encoding should take."""
    enc = model.trunk.encoding
    attn = model.trunk.blocks[0].attn
    if attn.encoding is None:
        return "sdpa"
    if "probabilities" in enc.hooks():  # weights of its own (stick-breaking): its blocked kernel where it has one,
        # else the kernel that hands it the logits
        return "own-blocked" if hasattr(enc, "blocked_attention") else "materialised"
    if has_form(enc) and not (getattr(enc, "terms", ()) and "p2p" in enc.terms):
        return "blocked"
    if "values" in enc.hooks():
        return "materialised"
    if "bias" in enc.hooks() and "logits" not in enc.hooks() and offers_bias_offsets(enc):
        return "offset-bias"  # a bias that depends on the offset only, from its values per offset
    if "bias" in enc.hooks() and "logits" not in enc.hooks() and offers_bias_blocks(enc):
        return "block-bias"  # a bias evaluated one block of query rows at a time (FIRE)
    if "logits" in enc.hooks() and hasattr(enc, "blocked_attention"):
        return "own-blocked"  # the encoding's own row-blocked attention (CoPE)
    if "logits" in enc.hooks() or ("bias" in enc.hooks() and any(p.requires_grad for p in enc.parameters())):
        return "biased-sdpa"  # terms with a gradient
    if "bias" in enc.hooks():
        return "sdpa"  # a constant bias (ALiBi) is a plain additive mask
    return "sdpa"


def offers_bias_offsets(enc) -> bool:
    inner = getattr(enc, "inner", enc)  # randomized positions wrap an encoding
    return type(inner).bias_offsets is not PositionalEncoding.bias_offsets


def offers_bias_blocks(enc) -> bool:
    inner = getattr(enc, "inner", enc)
    return type(inner).bias_blocks is not PositionalEncoding.bias_blocks


def grads_of(model, loss):
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.autograd.grad(loss, params, allow_unused=True)


def assert_same(fast_model, ref_model, run):
    """``run(model) -> scalar``: the same value and gradients on the fast and the reference model."""
    torch.manual_seed(11)  # randomized positions draw in training: the same draw for both
    a = run(fast_model)
    torch.manual_seed(11)
    b = run(ref_model)
    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
    for ga, gb in zip(grads_of(fast_model, a), grads_of(ref_model, b)):
        if ga is None or gb is None:
            assert (ga is None or not ga.any()) and (gb is None or not gb.any())
        else:
            torch.testing.assert_close(ga, gb, rtol=1e-8, atol=1e-9)


def pair(name):
    fast, ref = lm(name), lm(name, path="reference")
    ref.load_state_dict(fast.state_dict())
    for a, b in zip(fast.modules(), ref.modules()):  # per-layer tables built by fresh_copy: same settings
        if isinstance(a, PositionalEncoding):
            b.fused_min_pairs = a.fused_min_pairs
    return fast, ref


def weighted(logits):
    return (logits * torch.linspace(-1, 1, logits.numel(), dtype=F64).view_as(logits)).sum()


TOKENS = torch.randint(0, V, (2, 14), generator=torch.Generator().manual_seed(5))


# ---------------------------------------------------------------- the positions decide
def test_contiguity_is_read_from_the_values():
    a = torch.arange(5, 12)[None]
    assert is_arange_rows(a) and is_arange_rows(torch.stack([torch.arange(7), torch.arange(3, 10)]))
    assert not is_arange_rows(torch.tensor([[0, 1, 2, 0, 1]]))  # a packed batch restarting at 0
    assert not is_arange_rows(torch.tensor([[0, 2, 4]]))
    assert not is_arange_rows(torch.arange(4.0)[None])  # float positions: no integer offsets
    rows = torch.stack([torch.arange(7), torch.arange(3, 10)])
    assert contiguous_positions(rows, rows)  # left padding as shifted rows: one k - q start
    assert not contiguous_positions(rows, torch.stack([torch.arange(7), torch.arange(7)]))  # two starts
    cache: dict = {}
    marked = mark_arange(cache, torch.tensor([[0, 5, 9]]))  # a mark is trusted (made by arange)
    assert is_arange_rows(marked, cache)


def test_choose_kernel_is_one_table():
    base = dict(
        reference=False,
        return_weights=False,
        has_form=False,
        needs_values=False,
        has_terms=False,
        learned_bias=False,
        dropout=0.0,
        on_cpu=True,
        compiling=False,
    )
    assert choose_kernel(**base)[0] == "sdpa"
    assert choose_kernel(**{**base, "reference": True, "has_form": True})[0] == "materialised"
    assert choose_kernel(**{**base, "has_form": True, "dropout": 0.1})[0] == "blocked"
    assert choose_kernel(**{**base, "dropout": 0.1})[0] == "blocked"
    assert choose_kernel(**{**base, "dropout": 0.1, "on_cpu": False})[0] == "sdpa"  # GPU SDPA has dropout
    assert choose_kernel(**{**base, "has_terms": True, "learned_bias": True})[0] == "biased-sdpa"
    assert choose_kernel(**{**base, "needs_values": True})[0] == "materialised"
    assert choose_kernel(**{**base, "has_offsets": True, "has_terms": True, "learned_bias": True})[0] == "offset-bias"
    assert choose_kernel(**{**base, "has_form": True, "has_offsets": True})[0] == "blocked"
    assert choose_kernel(**{**base, "one_query": True, "has_form": True})[0] == "decode"
    assert choose_kernel(**{**base, "one_query": True, "has_form": True, "reference": True})[0] == "materialised"
    assert choose_kernel(**{**base, "has_blocks": True, "has_terms": True, "learned_bias": True})[0] == "block-bias"
    assert choose_kernel(**{**base, "has_offsets": True, "has_blocks": True})[0] == "offset-bias"
    assert choose_kernel(**{**base, "has_own": True, "has_terms": True, "learned_bias": True})[0] == "own-blocked"
    assert choose_kernel(**{**base, "has_own": True, "on_cpu": False, "has_terms": True})[0] == "sdpa"
    kernels = {
        "sdpa", "biased-sdpa", "offset-bias", "block-bias", "decode", "blocked", "own-blocked", "materialised", "flex"
    }  # flex is chosen before this table (plan_call; tests/test_flex.py)
    assert set(KERNELS) == kernels


def test_plan_says_which_kernel_and_why_without_running():
    enc = posenc.get("shaw", head_dim=8, max_relative_position=3)
    enc.fused_min_pairs = 1
    attn = MultiHeadAttention(16, 2, enc)
    x = torch.randn(2, 9, 16)
    p = attn.plan(x, causal=True)
    assert p.kernel == "blocked" and p.contiguous and "form" in p.terms and "offset tables" in p.reason
    assert attn.last_plan is None  # nothing ran
    p = attn.plan(x, positions=torch.tensor([0, 1, 2, 0, 1, 2, 3, 0, 1]))
    assert p.kernel == "materialised" and not p.contiguous  # Shaw's a^V without the form needs probabilities
    assert "arbitrary" in str(p)
    cache = posenc.KVCache()
    attn(x, kv_cache=cache, causal=True)
    before = cache.length()
    p = attn.plan(x[:, :1], kv_cache=cache, causal=True)
    assert p.contiguous and cache.length() == before  # plan leaves the cache as it was


# ---------------------------------------------------------------- every encoding, every caller
@pytest.mark.parametrize("name", names())
def test_model_training_step_takes_the_fast_kernel_and_matches_reference(name):
    fast, ref = pair(name)
    kw = {"segment_ids": (torch.arange(14) >= 7).long().expand(2, 14)} if name in NEEDS_SEGMENTS else {}
    assert_same(fast, ref, lambda m: weighted(m(TOKENS, **kw)))
    ps = plans(fast)
    if name.startswith("randomized-"):  # training draws sorted random positions: arbitrary by design
        assert not any(p.contiguous for p in ps) and "blocked" not in fast_kernels(fast)
        return
    assert all(p.contiguous for p in ps), [str(p) for p in ps]
    assert fast_kernels(fast) == {expected_kernel(fast)}, [str(p) for p in ps]


@pytest.mark.parametrize("name", names())
def test_kv_cache_decoding_takes_the_fast_kernel_and_matches_the_full_forward(name):
    if name in LENGTH_DEPENDENT or name in NEEDS_SEGMENTS:
        pytest.skip(f"{name}: its output at a position depends on the whole length (or needs segments)")
    fast, ref = pair(name)
    fast.eval(), ref.eval()
    with torch.no_grad():
        full = ref(TOKENS)
        cache = posenc.KVCache()
        steps = [fast(TOKENS[:, :9], kv_cache=cache)]
        assert all(p.contiguous for p in plans(fast))
        for t in range(9, 14):
            steps.append(fast(TOKENS[:, t : t + 1], kv_cache=cache))
            ps = plans(fast)
            enc = fast.trunk.encoding
            # materialised only for a^V without a form, for logits that read q·kᵀ (computed once for them), or for
            # weights of the encoding's own (a probabilities hook)
            own = {"values", "probabilities"} & enc.hooks() if enc is not None else set()
            fine = [p.contiguous and (p.kernel != "materialised" or own or "q·kᵀ" in p.reason) for p in ps]
            assert all(fine), [str(p) for p in ps]
            if enc is not None and enc.logits_read_scores:
                assert all(p.kernel == "materialised" and "q·kᵀ" in p.reason for p in ps)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("name", [n for n in names() if n not in NEEDS_SEGMENTS])
def test_memory_takes_the_fast_kernel_and_matches_reference(name):
    fast, ref = pair(name)
    fast.eval(), ref.eval()  # randomized positions: the memory's positions are the plain ones

    def run(m):
        _, mem = m(TOKENS[:, :6], return_memory=True)
        return weighted(m(TOKENS[:, 6:], memory=mem))

    assert_same(fast, ref, run)
    assert all(p.contiguous for p in plans(fast))
    if has_form(fast.trunk.encoding) and expected_kernel(fast) == "blocked":
        assert fast_kernels(fast) == {"blocked"}


@pytest.mark.parametrize("name", names())
def test_shifted_rows_with_padding_take_the_fast_kernel(name):
    """Left padding with each row's positions shifted (one start per row, the same for queries and keys)."""
    fast, ref = pair(name)
    mask = torch.ones(2, 14, dtype=torch.bool)
    mask[1, :4] = False
    pos = torch.stack([torch.arange(14), torch.arange(14) + 3])
    kw = {"segment_ids": (torch.arange(14) >= 7).long().expand(2, 14)} if name in NEEDS_SEGMENTS else {}
    fast.eval(), ref.eval()
    assert_same(fast, ref, lambda m: weighted(m(TOKENS, positions=pos, attention_mask=mask, **kw)[1, 4:]))
    assert all(p.contiguous for p in plans(fast)) or name in LENGTH_DEPENDENT


@pytest.mark.parametrize("name", names())
def test_packed_documents_take_the_gather_forms_and_match_reference(name):
    """Positions that restart at 0 are arbitrary: no skew (it would be wrong), the same numbers."""
    fast, ref = pair(name)
    docs = torch.tensor([[0] * 5 + [1] * 9, [0] * 8 + [1] * 6])
    pos = torch.stack([torch.cat([torch.arange(5), torch.arange(9)]), torch.cat([torch.arange(8), torch.arange(6)])])
    kw = {"segment_ids": (torch.arange(14) >= 7).long().expand(2, 14)} if name in NEEDS_SEGMENTS else {}
    fast.eval(), ref.eval()
    assert_same(fast, ref, lambda m: weighted(m(TOKENS, positions=pos, document_ids=docs, **kw)))
    assert not any(p.contiguous for p in plans(fast))
    assert "blocked" not in fast_kernels(fast)


@pytest.mark.parametrize("name", names())
def test_dropout_runs_on_the_fast_kernels(name):
    """Training with attention dropout: no silent fallback to the materialised path on CPU."""
    model = lm(name, dropout=0.3)
    model.train()
    kw = {"segment_ids": (torch.arange(13) >= 7).long().expand(2, 13)} if name in NEEDS_SEGMENTS else {}
    loss = model.loss(TOKENS, **kw)
    loss.backward()
    assert torch.isfinite(loss)
    for p in plans(model):
        assert p.dropout == 0.3
        # weights of the encoding's own (stick-breaking) take their dropout on the materialised weights
        own = "probabilities" in model.trunk.encoding.hooks()
        want = "materialised" if own or expected_kernel(model) == "materialised" else "blocked"
        assert p.kernel == want, str(p)


# ---------------------------------------------------------------- the blocked kernel's dropout and bias
def _case(seed, b=2, h=2, lq=11, lk=11, d=4):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=g, dtype=F64, requires_grad=True) for n in (lq, lk, lk))
    table = torch.randn(lq + lk - 1, h, d, generator=g, dtype=F64, requires_grad=True)
    bias = torch.randn(1, h, lq, lk, generator=g, dtype=F64, requires_grad=True)
    return q, k, v, table, bias


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lk", [11, 16])
def test_blocked_dropout_and_bias_match_the_formula_with_the_same_mask(monkeypatch, causal, lk):
    """The kernel with a known dropout mask == softmax(s·(q kᵀ + q·T) + bias + causal) ∘ M v, values and grads."""
    monkeypatch.setattr(fused, "BLOCK_BYTES", 1)  # several blocks of rows
    q, k, v, table, bias = _case(0, lk=lk)
    bias = bias[..., :lk].detach().requires_grad_()
    b, h, lq, _ = q.shape
    p_drop = 0.4
    mask = (torch.rand(b, h, lq, lk, generator=torch.Generator().manual_seed(9)) >= p_drop).to(F64) / (1 - p_drop)

    def keep(self, bi, hi, r0, r1):
        return mask[bi, hi, r0:r1, : self.plan.kend(r1)].clone()

    monkeypatch.setattr(fused._Work, "keep", keep)
    table = table[: lq + lk - 1].detach().requires_grad_()
    form = RelativeForm(q=q, k=k, query_terms=[(q, table)])
    out = relative_attention(form, v, 0.7, bias=bias, dropout=p_drop, causal=causal)
    # the formula, written out
    i = torch.arange(lq)[:, None]
    j = torch.arange(lk)[None, :]
    t = j - i + lq - 1
    pos = torch.einsum("bhid,ijhd->bhij", q, table[t])
    s = 0.7 * (q @ k.transpose(-1, -2) + pos) + bias
    if causal:
        s = s.masked_fill(j > i + lk - lq, float("-inf"))
    want = (torch.softmax(s, -1) * mask) @ v
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    w = torch.randn(out.shape, dtype=F64)
    ga = torch.autograd.grad((out * w).sum(), (q, k, v, table, bias))
    gb = torch.autograd.grad((want * w).sum(), (q, k, v, table, bias))
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-11)


def test_blocked_dropout_backward_draws_the_forwards_mask_again(monkeypatch):
    """gradcheck with the global seed reset per call: the backward's regenerated masks are the forward's."""
    monkeypatch.setattr(fused, "BLOCK_BYTES", 1)
    q, k, v, table, bias = _case(1, lq=6, lk=6)

    def f(q, k, v, bias):
        torch.manual_seed(123)
        return relative_attention(RelativeForm(q=q, k=k), v, 0.5, bias=bias, dropout=0.5, causal=True)

    assert torch.autograd.gradcheck(f, (q, k, v, bias))
    torch.manual_seed(0)
    out = relative_attention(RelativeForm(q=q, k=k), v, 0.5, dropout=0.5)
    plain = relative_attention(RelativeForm(q=q, k=k), v, 0.5)
    assert not torch.allclose(out, plain)  # dropout did act


def test_blocked_dropout_is_unbiased():
    """E[dropout(P) v] = P v: the mean of many draws approaches the dropout-free output."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 1, 8, 4, generator=g, dtype=F64) for _ in range(3))
    plain = relative_attention(RelativeForm(q=q, k=k), v, 0.5)
    torch.manual_seed(0)
    mean = sum(relative_attention(RelativeForm(q=q, k=k), v, 0.5, dropout=0.5) for _ in range(4000)) / 4000
    torch.testing.assert_close(mean, plain, rtol=0, atol=0.05)


def test_causal_bias_on_sdpa_matches_reference_with_padding():
    """ALiBi / T5 under a causal mask take CPU flash with the mask and is_causal together; with padding too."""
    for name in ("alibi", "t5"):
        fast, ref = pair(name)
        mask = torch.ones(2, 14, dtype=torch.bool)
        mask[0, :3] = False
        assert_same(fast, ref, lambda m, mask=mask: weighted(m(TOKENS, attention_mask=mask)[:, 3:]))
        assert_same(fast, ref, lambda m: weighted(m(TOKENS)))
        assert fast_kernels(fast) <= {"sdpa", "biased-sdpa", "offset-bias"}


def test_deberta_inference_memo_follows_the_weights():
    """DeBERTa keeps its projected tables between no-grad calls only while the weights are unchanged."""
    fast, ref = pair("deberta")
    fast.eval(), ref.eval()
    with torch.no_grad():
        torch.testing.assert_close(fast(TOKENS), ref(TOKENS), rtol=1e-9, atol=1e-10)
        for model in (fast, ref):  # an optimizer step would change them in place
            for m in model.modules():
                if isinstance(m, PositionalEncoding):
                    for p in m.parameters():
                        p.mul_(1.5)
        torch.testing.assert_close(fast(TOKENS), ref(TOKENS), rtol=1e-9, atol=1e-10)


def test_far_distances_build_no_sinusoid_table():
    """Transformer-XL / TENER at distances past the shared table's limit: computed for the distances in use."""
    from posenc.relative import transformer_xl as txl

    far = torch.tensor([[1 << 30, (1 << 30) + 1]])
    got = txl.sinusoid_rows(far, 8, torch.float64)
    torch.testing.assert_close(got, txl.relative_sinusoid(far, 8))
    span = txl.sinusoid_span(1 << 30, (1 << 30) + 3, 8, torch.float64, torch.device("cpu"))
    torch.testing.assert_close(span, txl.relative_sinusoid(torch.arange(1 << 30, (1 << 30) + 4), 8))
    assert all(n <= txl.SINUSOID_TABLE_LIMIT for n, _ in txl._SINUSOID_TABLES.values())
    near = torch.tensor([[-5, 0, 7]])
    torch.testing.assert_close(txl.sinusoid_rows(near, 8, torch.float64), txl.relative_sinusoid(near, 8))
    # a decoding step far out: memory of one token at 2^30, queries right after it
    model = posenc.LanguageModel(V, encoding="transformer-xl", d_model=16, n_heads=2, n_layers=1).double().eval()
    with torch.no_grad():
        base = model(TOKENS[:, :3], positions=torch.arange(3))
        shifted = model(TOKENS[:, :3], positions=torch.arange(3) + (1 << 30))
    torch.testing.assert_close(base, shifted, rtol=1e-9, atol=1e-9)  # relative: the same logits


# ---------------------------------------------------------------- decoding at the models' own thresholds
@pytest.mark.parametrize("name", names())
def test_kv_cache_decoding_at_default_thresholds_matches_the_full_forward(name):
    """One token at a time with the encodings' own ``fused_min_pairs`` (the path a real decoding step takes: the
    logits / bias hooks at ``Lq = 1``, not the blocked kernel), against the reference model's full forward."""
    if name in LENGTH_DEPENDENT or name in NEEDS_SEGMENTS:
        pytest.skip(f"{name}: its output at a position depends on the whole length (or needs segments)")
    fast, ref = pair(name)
    for m in fast.modules():
        if isinstance(m, PositionalEncoding):
            m.fused_min_pairs = type(m).fused_min_pairs
    fast.eval(), ref.eval()
    with torch.no_grad():
        full = ref(TOKENS)
        cache = posenc.KVCache()
        steps = [fast(TOKENS[:, :4], kv_cache=cache)]
        for t in range(4, 14):
            steps.append(fast(TOKENS[:, t : t + 1], kv_cache=cache))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-9, atol=1e-10)


# ---------------------------------------------------------------- the KV cache's storage
def test_kv_cache_grows_in_place_and_hands_out_views():
    model = lm("rope").eval()
    cache = posenc.KVCache()
    with torch.no_grad():
        model(TOKENS[:, :4], kv_cache=cache)
        model(TOKENS[:, 4:5], kv_cache=cache)
        k0 = cache.layers[0][0]
        for t in range(5, 14):
            model(TOKENS[:, t : t + 1], kv_cache=cache)
    k, v, pos, _ = cache.layers[0]
    assert k.shape[2] == v.shape[2] == pos.shape[1] == cache.length() == 14
    assert k.data_ptr() == k0.data_ptr()  # the same storage: no copy of the cached keys per step
    torch.testing.assert_close(pos, torch.arange(14)[None])


def test_forked_kv_caches_do_not_overwrite_each_other():
    """Continuations of one prefix (a copy of the cache's entries, with or without its storage) share the prefix's
    storage; each must keep its own later keys."""
    import dataclasses

    model = lm("alibi").eval()
    other = TOKENS.flip(1)
    with torch.no_grad():
        cache = posenc.KVCache()
        model(TOKENS[:, :6], kv_cache=cache)
        model(TOKENS[:, 6:7], kv_cache=cache)  # the storage now has room to spare
        forks = [
            dataclasses.replace(cache, layers=dict(cache.layers), owners=dict(cache.owners)),  # storage shared
            posenc.KVCache(dict(cache.layers), dict(cache.owners)),
        ]
        forks = [(cache, TOKENS), (forks[0], other), (forks[1], TOKENS.roll(3, 1))]
        got = {id(c): [] for c, _ in forks}
        for t in range(7, 12):  # interleaved: each fork writes the slot the others also write
            for c, toks in forks:
                got[id(c)].append(model(toks[:, t : t + 1], kv_cache=c))
        for c, toks in forks:
            full = model(torch.cat([TOKENS[:, :7], toks[:, 7:12]], dim=1))[:, 7:]
            torch.testing.assert_close(torch.cat(got[id(c)], dim=1), full, rtol=1e-9, atol=1e-10)


def test_kv_cache_with_autograd_keeps_gradients():
    """With autograd through the keys the cache concatenates (an in-place write would break the backward)."""
    fast, ref = pair("t5")

    def run(m):
        cache = posenc.KVCache()
        out = [m(TOKENS[:, :5], kv_cache=cache)]
        for t in range(5, 9):
            out.append(m(TOKENS[:, t : t + 1], kv_cache=cache))
        return weighted(torch.cat(out, dim=1))

    assert_same(fast, ref, run)


@pytest.mark.parametrize("heads_in_table", [False, True])
def test_key_rows_dot_matches_the_gathered_formula(heads_in_table):
    """The decoding form of a key term: runs of one row at either end (clipped / last-bucket distances) as
    matrix-vector products, the rows between gathered; any index, monotone or not."""
    from posenc.relative._skew import key_rows_dot

    g = torch.Generator().manual_seed(3)
    k = torch.randn(2, 3, 40, 5, generator=g, dtype=F64)[:, :, :37]  # a view, as a KV cache hands out
    table = torch.randn(11, 3, 5, generator=g, dtype=F64) if heads_in_table else torch.randn(11, 5, dtype=F64)
    clipped = (torch.arange(36, -1, -1) - 13).clamp(0, 10)  # 10 ... 10, 9 ... 1, 0 ... 0
    cases = [clipped, torch.randint(0, 11, (37,), generator=g), torch.full((37,), 4), torch.arange(37) % 11]
    for index in cases:
        rows = table[index]
        want = torch.einsum("bhjd,jhd->bhj", k, rows) if heads_in_table else torch.einsum("bhjd,jd->bhj", k, rows)
        torch.testing.assert_close(key_rows_dot(k, table, index), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["transformer-xl", "xlnet"])
def test_decoding_memo_of_projected_distances_follows_the_weights(name):
    """``W_{k,R} R_d`` kept between decoding steps: rebuilt when the weights change in place or a distance falls
    outside it, never used with autograd."""
    fast, ref = pair(name)
    for m in fast.modules():
        if isinstance(m, PositionalEncoding):
            m.fused_min_pairs = type(m).fused_min_pairs
    fast.eval(), ref.eval()
    kw = {"segment_ids": torch.zeros(2, 14, dtype=torch.long)} if name in NEEDS_SEGMENTS else {}

    def decode(model):
        cache, out = posenc.KVCache(), []
        for t in range(14):
            seg = {k: v[:, t : t + 1] for k, v in kw.items()}
            out.append(model(TOKENS[:, t : t + 1], kv_cache=cache, **seg))
        return torch.cat(out, dim=1)

    with torch.no_grad():
        torch.testing.assert_close(decode(fast), ref(TOKENS, **kw), rtol=1e-9, atol=1e-10)
        for model in (fast, ref):
            for m in model.modules():
                if isinstance(m, PositionalEncoding):
                    m.W_kR.weight.mul_(1.5)
        torch.testing.assert_close(decode(fast), ref(TOKENS, **kw), rtol=1e-9, atol=1e-10)
    assert any("_projected_memo" in m.__dict__ for m in fast.modules())


def test_dynamic_bias_decoding_memo_follows_the_weights():
    fast, ref = pair("dynamic-bias")
    fast.eval(), ref.eval()

    def decode(model):
        cache = posenc.KVCache()
        return torch.cat([model(TOKENS[:, t : t + 1], kv_cache=cache) for t in range(14)], dim=1)

    with torch.no_grad():
        torch.testing.assert_close(decode(fast), ref(TOKENS), rtol=1e-9, atol=1e-10)
        for model in (fast, ref):
            for m in model.modules():
                if isinstance(m, PositionalEncoding):
                    m.mlp[0].bias.add_(0.5)
        torch.testing.assert_close(decode(fast), ref(TOKENS), rtol=1e-9, atol=1e-10)
    assert any("_distance_memo" in m.__dict__ for m in fast.modules())


# ---------------------------------------------------------------- one query: the decode kernel
def _decodes(name) -> bool:
    """Whether a decoding step of this encoding's model should take the decode kernel (an offset-table form)."""
    from posenc import native

    model = lm(name)
    enc = model.trunk.blocks[0].attn.encoding
    if not native.available() or enc is None or not enc.offers_relative_form() or "bias" in enc.hooks():
        return False
    q = torch.randn(1, 2, 1, 8, dtype=F64)
    k = torch.randn(1, 2, 5, 8, dtype=F64)
    ctx = posenc.base.AttentionContext(
        q_pos=torch.tensor([[4]]),
        k_pos=torch.arange(5)[None],
        n_heads=2,
        head_dim=8,
        contiguous=True,
        q_segments=torch.zeros(1, 1, dtype=torch.long),
        k_segments=torch.zeros(1, 5, dtype=torch.long),
        attention=model.trunk.blocks[0].attn,
    )
    with torch.no_grad():
        form = enc.relative_form(q, k, ctx)
    return form is not None


@pytest.mark.parametrize("name", [n for n in names() if n not in LENGTH_DEPENDENT])
def test_decoding_steps_take_the_decode_kernel_where_the_form_fits(name):
    """KV-cache decoding with a padded batch (and XLNet's segments): the steps equal the full reference forward, and
    every step of an encoding whose offset-table form has no value table takes the one-pass decode kernel."""
    fast, ref = pair(name)
    for m in fast.modules():
        if isinstance(m, PositionalEncoding):
            m.fused_min_pairs = 1 << 30  # the prefill on the hooks; only the decode rule can pick a form
    fast.eval(), ref.eval()
    mask = torch.ones(2, 14, dtype=torch.bool)
    mask[1, :3] = False  # left padding in the second row
    seg = (torch.arange(14) >= 7).long().expand(2, 14)
    kw = (lambda sl: {"segment_ids": seg[:, sl]}) if name in NEEDS_SEGMENTS else (lambda sl: {})
    want_decode = _decodes(name)
    with torch.no_grad():
        full = ref(TOKENS, attention_mask=mask, **kw(slice(0, 14)))
        cache = posenc.KVCache()
        steps = [fast(TOKENS[:, :9], kv_cache=cache, attention_mask=mask[:, :9], **kw(slice(0, 9)))]
        for t in range(9, 14):
            steps.append(
                fast(TOKENS[:, t : t + 1], kv_cache=cache, attention_mask=mask[:, : t + 1], **kw(slice(t, t + 1)))
            )
            kernels = fast_kernels(fast)
            assert (kernels == {"decode"}) == want_decode, (name, [str(p) for p in plans(fast)])
    got = torch.cat(steps, dim=1)
    torch.testing.assert_close(got[0], full[0], rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(got[1, 3:], full[1, 3:], rtol=1e-9, atol=1e-10)


def test_a_decoding_step_the_native_kernel_declines_runs_blocked_with_the_same_numbers(monkeypatch):
    """The decode kernel returning None (a case it does not take) falls back to the blocked kernel, not to nothing."""
    from posenc import native

    if not native.available():
        pytest.skip("no native kernels here")
    monkeypatch.setattr(native, "decode_attention", lambda *a, **k: None)
    fast, ref = pair("relative-key-query")
    fast.eval(), ref.eval()
    with torch.no_grad():
        full = ref(TOKENS)
        cache = posenc.KVCache()
        steps = [fast(TOKENS[:, :9], kv_cache=cache)]
        steps += [fast(TOKENS[:, t : t + 1], kv_cache=cache) for t in range(9, 14)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-9, atol=1e-10)
