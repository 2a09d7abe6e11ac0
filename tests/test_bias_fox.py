"""FoX (Lin et al. 2025): the forget-gate decay against the paper's formula written out here, the blocked kernel
against it at several lengths (gradients included), float32 at L = 4096 against float64, left padding, KV-cache
decoding against no cache, torch.compile, and bad input."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from cache_steps import cached_steps

import posenc
from posenc import KVCache, MultiHeadAttention
from posenc.base import AttentionContext
from posenc.bias.fox import FoX, fox_attention
from posenc.errors import ConfigError

D, H = 24, 3
DH = D // H


def _layers(
    seed: int = 0, gate_bias: float | None = None, causal: bool = True
) -> tuple[MultiHeadAttention, MultiHeadAttention]:
    """A fast layer and a reference layer with the same weights, float64."""
    torch.manual_seed(seed)
    enc = posenc.get("fox", n_heads=H, head_dim=DH, gate_bias=gate_bias, causal=causal)
    fast = MultiHeadAttention(D, H, enc).double()
    ref = MultiHeadAttention(D, H, enc, path="reference").double()
    ref.load_state_dict(fast.state_dict())
    return fast, ref


def _paper(layer: MultiHeadAttention, x: torch.Tensor, causal: bool) -> torch.Tensor:
    """The paper's attention as written, with loops: f_t = W_f k_t + b_f (the keys of every head of token t),
    D_ij = Σ_{t=j+1..i} log σ(f_t); without a causal mask, for j > i, Σ_{t=i..j-1} log σ(g_t) with an encoder's
    second gate g (rows H.. of the gate), else Σ_{t=i+1..j} log σ(f_t)."""
    enc = layer.encoding
    assert isinstance(enc, FoX)
    b, n, _ = x.shape
    q = layer.q_proj(x).view(b, n, H, DH)
    k = layer.k_proj(x).view(b, n, H, DH)
    v = layer.v_proj(x).view(b, n, H, DH)
    w, bias = enc.gate.weight, enc.gate.bias  # [H or 2H, H·DH], [H or 2H]
    out = torch.zeros(b, n, H, DH, dtype=x.dtype)

    def log_gate(row: int, bi: int, t: int) -> float:
        return math.log(1.0 / (1.0 + math.exp(-float(w[row] @ k[bi, t].reshape(-1) + bias[row]))))

    for bi in range(b):
        gates = [[log_gate(h, bi, t) for t in range(n)] for h in range(H)]
        back = None if enc.causal else [[log_gate(H + h, bi, t) for t in range(n)] for h in range(H)]
        for h in range(H):
            for i in range(n):
                keys = range(i + 1) if causal else range(n)
                logits = []
                for j in keys:
                    if j <= i:
                        decay = sum(gates[h][t] for t in range(j + 1, i + 1))
                    elif back is None:
                        decay = sum(gates[h][t] for t in range(i + 1, j + 1))
                    else:
                        decay = sum(back[h][t] for t in range(i, j))
                    logits.append(float(q[bi, i, h] @ k[bi, j, h]) / math.sqrt(DH) + decay)
                top = max(logits)
                weights = [math.exp(a - top) for a in logits]
                total = sum(weights)
                for j, wj in zip(keys, weights):
                    out[bi, i, h] += wj / total * v[bi, j, h]
    return layer.o_proj(out.reshape(b, n, D))


@pytest.mark.parametrize("causal, two_gates", [(True, False), (False, False), (False, True)])
def test_the_paper_formula_in_float64(causal: bool, two_gates: bool) -> None:
    fast, ref = _layers(causal=not two_gates)
    x = torch.randn(2, 7, D, dtype=torch.float64)
    with torch.no_grad():
        want = _paper(ref, x, causal)
        torch.testing.assert_close(ref(x, causal=causal), want, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(fast(x, causal=causal), want, rtol=1e-10, atol=1e-12)


def test_decay_is_the_cumulative_difference_and_never_positive() -> None:
    fast, _ = _layers(gate_bias=0.0)
    x = torch.randn(1, 9, D, dtype=torch.float64)
    k = fast.k_proj(x).view(1, 9, H, DH).transpose(1, 2)
    enc = fast.encoding
    c = enc.cumulative(k)  # c_t = Σ_{s<=t} log σ(f_s)
    f = enc.gate(k.transpose(1, 2).reshape(1, 9, H * DH)).transpose(1, 2)
    torch.testing.assert_close(c[..., 5] - c[..., 2], F.logsigmoid(f[..., 3:6]).sum(-1))
    assert bool((c[..., 1:] < c[..., :-1]).all())  # every gate < 1: the sums fall


@pytest.mark.parametrize("length", [5, 64, 300, 600])
def test_the_blocked_kernel_equals_the_reference_with_gradients(length: int) -> None:
    fast, ref = _layers(seed=length)
    x = torch.randn(2, length, D, dtype=torch.float64)
    assert fast.plan(x, causal=True).kernel == ("own-blocked" if length * length >= 64 * 64 else "biased-sdpa")
    grads = []
    for layer in (fast, ref):
        layer.zero_grad()
        xx = x.clone().requires_grad_()
        out = layer(xx, causal=True)
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        grads.append((out.detach(), xx.grad, {n: p.grad for n, p in layer.named_parameters()}))
    (a, ga, pa), (b, gb, pb) = grads
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ga, gb, rtol=1e-9, atol=1e-11)
    for name in pa:
        torch.testing.assert_close(pa[name], pb[name], rtol=1e-9, atol=1e-11, msg=lambda m, n=name: f"{n}: {m}")
    assert fast.encoding.gate.weight.grad.abs().sum() > 0  # the gates learn


@pytest.mark.parametrize("lq, lk", [(6, 6), (4, 9), (1, 5)])
def test_gradcheck_of_the_kernel(lq: int, lk: int) -> None:
    torch.manual_seed(lq * 10 + lk)
    q = torch.randn(1, 2, lq, 3, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, lk, 3, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, lk, 3, dtype=torch.float64, requires_grad=True)
    c = F.logsigmoid(torch.randn(1, 2, lk, dtype=torch.float64)).cumsum(-1).detach().requires_grad_()
    assert torch.autograd.gradcheck(lambda *t: fox_attention(*t, 0.7), (q, k, v, c))

    # and the same numbers as the formula: softmax_j(s q·k + c_i - c_j) over j <= i + lk - lq
    i = torch.arange(lq)[:, None] + lk - lq
    allowed = torch.arange(lk)[None, :] <= i
    bias = (c[..., lk - lq :, None] - c[..., None, :]).masked_fill(~allowed, float("-inf"))
    want = torch.softmax(0.7 * q @ k.transpose(-1, -2) + bias, dim=-1) @ v
    torch.testing.assert_close(fox_attention(q, k, v, c, 0.7), want, rtol=1e-12, atol=1e-12)


def test_float32_at_4096_keeps_the_float32_floor_of_a_bias() -> None:
    """c_t falls by thousands over 4096 tokens; one float32 row of -c_j would put errors of ulp(|c|) ~ 2e-4 into
    the logits (1.7e-3 off in the output, measured). The kernel's output stays within the floor of a materialised
    float32 bias (the same attention with the bias computed in float64 and rounded once), for a head that forgets
    fast (σ(f) ~ 0.12), one near 1/2 and one that barely forgets."""
    torch.manual_seed(0)
    b, h, n, d = 1, 3, 4096, 16
    q, k, v = (torch.randn(b, h, n, d, dtype=torch.float64) for _ in range(3))
    f = torch.tensor([-2.0, 0.0, 4.0], dtype=torch.float64)[None, :, None] + torch.randn(b, h, n, dtype=torch.float64)
    c = F.logsigmoid(f).cumsum(-1)
    assert float(c[..., -1].min()) < -5000
    scale = d**-0.5
    bias = (c[..., :, None] - c[..., None, :]).masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
    floor = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=bias.float(), scale=scale)
    got = fox_attention(q.float(), k.float(), v.float(), c, scale)
    floor_err = (floor.double() - want).abs().amax((0, 2, 3))
    err = (got.double() - want).abs().amax((0, 2, 3))
    assert bool((err <= 2 * floor_err + 1e-6).all()), (err, floor_err)
    # the naive form (one row of -c_j for every query) is far off: the test can tell the two apart
    naive = F.scaled_dot_product_attention(
        q.float(),
        k.float(),
        v.float(),
        attn_mask=(-c[..., None, :])
        .float()
        .expand(b, h, n, n)
        .tril()
        .masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf")),
        scale=scale,
    )
    assert float((naive.double() - want).abs().max()) > 20 * float(err.max())


@pytest.mark.parametrize("causal", [True, False])
def test_left_padding_leaves_the_real_tokens_as_they_are(causal: bool) -> None:
    fast, ref = _layers(seed=3, causal=causal)
    x = torch.randn(2, 40, D, dtype=torch.float64)
    pad = 11
    padded = torch.cat([torch.randn(1, pad, D, dtype=torch.float64), x[1:, : 40 - pad]], dim=1)
    batch = torch.cat([x[:1], padded], dim=0)
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[1, :pad] = False
    for layer in (fast, ref):
        with torch.no_grad():
            out = layer(batch, causal=causal, attention_mask=mask)
            alone = layer(x[1:, : 40 - pad], causal=causal)
            torch.testing.assert_close(out[1, pad:], alone[0], rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(out[0], layer(x[:1], causal=causal)[0], rtol=1e-10, atol=1e-12)


def test_an_encoder_tells_before_from_after() -> None:
    """causal=False: the keys after the query decay by a gate of their own, so the same content one token before
    and one token after scores differently (a symmetric extension could not tell them apart)."""
    torch.manual_seed(8)
    k = torch.randn(1, H, 1, DH).expand(1, H, 5, DH)  # the same key at every position
    q = torch.randn(1, H, 5, DH)
    ctx = AttentionContext(torch.arange(5)[None], torch.arange(5)[None], H, DH, reference=True)
    two = FoX(n_heads=H, head_dim=DH, causal=False).logits(q, k, ctx)
    one = FoX(n_heads=H, head_dim=DH).logits(q, k, ctx)
    torch.testing.assert_close(one[..., 2, 1], one[..., 2, 3])
    assert not torch.allclose(two[..., 2, 1], two[..., 2, 3])


@pytest.mark.parametrize("chunks", [(1,) * 12, (5, 1, 1, 4, 1), (30, 7, 1, 1)])
def test_kv_cache_decoding_equals_no_cache(chunks: tuple[int, ...]) -> None:
    fast, ref = _layers(seed=4)
    total = 60 + sum(chunks)
    x = torch.randn(2, total, D, dtype=torch.float64)
    with torch.no_grad():
        want = ref(x, causal=True)
        for layer in (fast, ref):
            cache = KVCache()
            outs = [layer(x[:, :60], causal=True, kv_cache=cache)]
            at = 60
            for m in chunks:
                outs.append(layer(x[:, at : at + m], causal=True, kv_cache=cache))
                at += m
            torch.testing.assert_close(torch.cat(outs, dim=1), want, rtol=1e-10, atol=1e-12)
            # the cache holds the keys as they are (contiguous, head_dim wide) and c beside them (float64);
            # the running sum is the sum of the gates
            keys, state = cache.get(0)[0], cache.state(0)
            assert keys.shape[-1] == DH and keys.stride(-2) == DH  # rows of head_dim: no channels between them
            assert state is not None and state.shape == (*keys.shape[:3], FoX.key_state_channels)
            torch.testing.assert_close(state[..., 0], layer.encoding.cumulative(keys))


def test_generate_with_and_without_a_cache() -> None:
    torch.manual_seed(5)
    lm = posenc.LanguageModel(50, d_model=D, n_heads=H, n_layers=2, encoding="fox")
    prompt = torch.randint(0, 50, (2, 6))
    assert lm.decoding_mode(6, 10)[0] == "cache"
    torch.testing.assert_close(lm.generate(prompt, 10), lm.generate(prompt, 10, use_cache=False))


def test_compiled_layer_keeps_the_kernel() -> None:
    fast, _ = _layers(seed=6)
    fast = fast.float()
    x = torch.randn(1, 300, D, requires_grad=True)
    want = fast(x, causal=True)
    (gw,) = torch.autograd.grad(want.square().sum(), x)
    assert fast.last_plan.kernel == "own-blocked"
    torch._dynamo.reset()
    compiled = torch.compile(fast, fullgraph=True, backend="aot_eager")
    got = compiled(x, causal=True)
    (gg,) = torch.autograd.grad(got.square().sum(), x)
    assert fast.last_plan.kernel == "own-blocked"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gg, gw, rtol=1e-4, atol=1e-5)


def test_a_model_trains_with_it() -> None:
    torch.manual_seed(7)
    lm = posenc.LanguageModel(30, d_model=D, n_heads=H, n_layers=2, encoding="fox")
    opt = torch.optim.Adam(lm.parameters(), lr=3e-3)
    data = torch.arange(30).repeat(4, 3)[:, :48] % 30  # a counting pattern
    first = None
    for _ in range(40):
        loss = lm.loss(data)
        first = float(loss.detach()) if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(loss.detach()) < 0.5 * first


def test_bad_input() -> None:
    enc = FoX(n_heads=2, head_dim=4)
    with pytest.raises(ConfigError, match="keys of 3 heads"):
        enc.log_gates(torch.randn(1, 3, 5, 4))
    with pytest.raises(ConfigError, match="width 5"):
        enc.log_gates(torch.randn(1, 2, 5, 5))
    # grouped keys (a transformers model): the key head serves both query heads
    k = torch.randn(1, 1, 5, 4)
    torch.testing.assert_close(enc.log_gates(k), enc.log_gates(k.expand(1, 2, 5, 4)))
    with pytest.raises(ConfigError, match="gate_bias"):
        FoX(n_heads=2, head_dim=4, gate_bias=float("nan"))
    with pytest.raises(ConfigError, match=r"c must be \[1, 2, 5\]"):
        fox_attention(
            torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4), torch.zeros(1, 2, 4), 1.0
        )
    # a cache filled by another encoding: its keys carry no running sum
    torch.manual_seed(0)
    other = MultiHeadAttention(8, 2, posenc.get("alibi", n_heads=2))
    cache = KVCache()
    other(torch.randn(1, 4, 8), causal=True, kv_cache=cache)
    fox = MultiHeadAttention(8, 2, FoX(n_heads=2, head_dim=4))
    with pytest.raises(ConfigError, match="without FoX's running sums.*start a new posenc.KVCache"):
        fox(torch.randn(1, 1, 8), causal=True, kv_cache=cache)

    # an encoding whose per-key state does not match its keys is refused by the cache, not stored misaligned
    class Misaligned(FoX):
        def rotate(self, q, k, ctx):
            q, k = super().rotate(q, k, ctx)
            ctx.key_state = ctx.key_state[:, :, 1:]
            return q, k

    bad = MultiHeadAttention(8, 2, Misaligned(n_heads=2, head_dim=4))
    with pytest.raises(ConfigError, match=r"per-key state \(ctx.key_state\) is \(1, 2, 3, 1\) for keys \(1, 2, 4, 4\)"):
        bad(torch.randn(1, 4, 8), causal=True, kv_cache=KVCache())


def test_a_query_temperature_over_it_decodes_with_a_cache() -> None:
    """SSMax over FoX: the running sums go through the wrapper into the KV cache and back."""
    torch.manual_seed(9)
    enc = posenc.get("ssmax", inner="fox", n_heads=H, head_dim=DH, max_len=128)
    layer = MultiHeadAttention(D, H, enc).double()
    x = torch.randn(2, 80, D, dtype=torch.float64)
    with torch.no_grad():
        full = layer(x, causal=True)
        steps, cache = cached_steps(layer, x, 70)
    torch.testing.assert_close(steps, full, rtol=1e-10, atol=1e-12)
    state = cache.state(0)
    assert state is not None and state.shape[-1] == FoX.key_state_channels and cache.get(0)[0].shape[-1] == DH


def test_randomized_positions_over_it_decode_with_a_cache() -> None:
    from posenc.randomized import randomized

    torch.manual_seed(10)
    layer = MultiHeadAttention(D, H, randomized(FoX(n_heads=H, head_dim=DH), max_len=256)).double().eval()
    x = torch.randn(1, 75, D, dtype=torch.float64)
    with torch.no_grad():
        full = layer(x, causal=True)
        steps, _ = cached_steps(layer, x, 70)
    torch.testing.assert_close(steps, full, rtol=1e-10, atol=1e-12)


def test_a_decoding_step_takes_the_decay_row_in_one_pass_at_the_float32_floor() -> None:
    """A cached step (one query) runs FoX's own decode (``own-blocked``: the row ``c_i - c_j`` from the cached
    channels into the native decoding kernel). With fast-forgetting gates ``c`` falls to about ``-2600`` over 2,048
    keys, where one float32 row ``-c_j`` would be off by ``ulp(2600)``: the step stays as close to float64 as the
    float32 attention with the float64 decays rounded once (the floor of any float32 bias)."""
    torch.manual_seed(6)
    enc = posenc.get("fox", n_heads=H, head_dim=DH, gate_bias=-1.0)
    layer = MultiHeadAttention(D, H, enc)
    wide = MultiHeadAttention(D, H, posenc.get("fox", n_heads=H, head_dim=DH), path="reference").double()
    wide.load_state_dict(layer.state_dict())
    x = torch.randn(1, 2049, D)
    with torch.no_grad():
        cache = KVCache()
        layer(x[:, :2048], causal=True, kv_cache=cache)
        step = layer(x[:, 2048:], causal=True, kv_cache=cache)
        assert layer.last_plan is not None and layer.last_plan.kernel == "own-blocked", layer.last_plan
        keys, state = cache.get(0)[0], cache.state(0)
        assert state is not None and float(state[..., 0].min()) < -1500  # where float32 of c itself loses digits
        want = wide(x.double(), causal=True)[:, -1:]
        # the float32 floor: the same step with the float64 decays rounded to float32 once, through SDPA
        q = layer.q_proj(x[:, -1:]).view(1, 1, H, DH).transpose(1, 2)
        k = keys
        v = cache.get(0)[1]
        c = enc.cumulative(k)
        row = (c[..., -1:] - c).float()[:, :, None, :]
        floor = F.scaled_dot_product_attention(q, k, v, attn_mask=row, scale=DH**-0.5)
        floor = layer.o_proj(floor.transpose(1, 2).reshape(1, 1, D))
    err = float((step.double() - want).abs().max())
    base = float((floor.double() - want).abs().max())
    assert err <= 2 * base + 1e-6, (err, base)


def test_decoding_a_left_padded_batch_equals_each_sequence_alone() -> None:
    """The step's own decode drops the padded keys (the row gets -inf there): each row as if decoded alone."""
    fast, _ = _layers(seed=7)
    pad = 5
    x = torch.randn(2, 30, D, dtype=torch.float64)
    batch = torch.cat([x[:1], torch.cat([torch.randn(1, pad, D, dtype=torch.float64), x[1:, : 30 - pad]], 1)])
    mask = torch.ones(2, 30, dtype=torch.bool)
    mask[1, :pad] = False
    with torch.no_grad():
        cache = KVCache()
        outs = [fast(batch[:, :20], causal=True, kv_cache=cache, attention_mask=mask[:, :20])]
        for t in range(20, 30):
            outs.append(fast(batch[:, t : t + 1], causal=True, kv_cache=cache, attention_mask=mask[:, : t + 1]))
            assert fast.last_plan is not None and fast.last_plan.kernel == "own-blocked"
        got = torch.cat(outs, 1)
        alone = fast(x[1:, : 30 - pad], causal=True)
        torch.testing.assert_close(got[1, pad:], alone[0], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(got[0], fast(x[:1], causal=True)[0], rtol=1e-10, atol=1e-12)


def test_cached_steps_of_a_left_padded_batch_equal_the_paper_on_each_sequence() -> None:
    """A KV cache, one token a step (FoX's own decode: the new key's gate added to the cached sum, the scores added
    into the decay row), float64, a batch whose second sequence is left-padded and has one token in the middle that
    no query may see: every real token's output is the paper's attention written out with loops (:func:`_paper`) over
    that sequence alone, without its pads and without the hidden token (a key no query sees gates nothing)."""
    fast, _ = _layers(seed=11)
    pad, n, hidden = 3, 14, 9  # sequence 1: 3 pads, then 11 tokens; the token at 9 is hidden from every query
    torch.manual_seed(12)
    x = torch.randn(2, n, D, dtype=torch.float64)
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[1, :pad] = False
    mask[1, hidden] = False
    with torch.no_grad():
        cache = KVCache()
        outs = [fast(x[:, :5], causal=True, kv_cache=cache, attention_mask=mask[:, :5])]
        for t in range(5, n):
            outs.append(fast(x[:, t : t + 1], causal=True, kv_cache=cache, attention_mask=mask[:, : t + 1]))
            assert fast.last_plan is not None and fast.last_plan.kernel == "own-blocked", fast.last_plan
        got = torch.cat(outs, 1)
        first = _paper(fast, x[:1], causal=True)[0]
        kept = [t for t in range(pad, n) if t != hidden]
        second = _paper(fast, x[1:, kept], causal=True)[0]
        state = cache.state(0)
    torch.testing.assert_close(got[0], first, rtol=1e-10, atol=1e-12)
    after = [i for i, t in enumerate(kept) if t != hidden]  # the hidden token's own query row is no one's alone
    torch.testing.assert_close(got[1, [kept[i] for i in after]], second[after], rtol=1e-10, atol=1e-12)
    # the hidden token decays nothing: the running sum stands still over it (and over the pads, at 0)
    assert state is not None
    assert float(state[1, :, hidden, 0].sub(state[1, :, hidden - 1, 0]).abs().max()) == 0.0
    assert float(state[1, :, :pad, 0].abs().max()) == 0.0


def test_a_decoding_step_keeps_the_precision_contract() -> None:
    """The step's running sum is float64 (the cached ``c`` plus the new key's log-gate), and its decay row is the
    float64 difference ``c_i - c_j`` rounded to float32 once: bit for bit what the plain expressions give."""
    torch.manual_seed(13)
    enc = posenc.get("fox", n_heads=H, head_dim=DH, gate_bias=-1.0)
    layer = MultiHeadAttention(D, H, enc).eval()
    x = torch.randn(2, 300, D)
    with torch.no_grad():
        cache = KVCache()
        layer(x[:, :299], causal=True, kv_cache=cache)
        before = cache.state(0)[:, :, -1, 0].clone()
        k_new = layer.k_proj(x[:, 299:]).view(2, 1, H, DH).transpose(1, 2)
        layer(x[:, 299:], causal=True, kv_cache=cache)
        keys, state = cache.get(0)[0], cache.state(0)
        gate = F.logsigmoid(enc.gate(k_new.transpose(1, 2).reshape(2, 1, D)).double())[:, 0]  # [B, H]
        ctx = AttentionContext(torch.arange(300)[None], torch.arange(300)[None], H, DH)
        ctx.key_state = state
        row = enc.decode_row(keys, ctx, torch.float32)
    assert state.dtype == torch.float64 and float(state[..., 0].min()) < -150
    assert torch.equal(state[:, :, -1, 0], before + gate)
    c = state[..., 0]
    assert row.dtype == torch.float32 and torch.equal(row, (c[..., -1:] - c).float()[:, :, None, :])
    assert not torch.equal(row, (c[..., -1:].float() - c.float())[:, :, None, :])  # float32 sums would differ


def test_a_compiled_decoding_step_equals_the_eager_one() -> None:
    """torch.compile (fullgraph) of a cached step: the same output and the same running sums as eager."""
    fast, _ = _layers(seed=14)
    fast = fast.float().eval()
    x = torch.randn(2, 40, D)
    with torch.no_grad():
        eager_cache, compiled_cache = KVCache(), KVCache()
        fast(x[:, :36], causal=True, kv_cache=eager_cache)
        fast(x[:, :36], causal=True, kv_cache=compiled_cache)
        torch._dynamo.reset()
        compiled = torch.compile(fast, fullgraph=True, backend="aot_eager")
        for t in range(36, 40):
            want = fast(x[:, t : t + 1], causal=True, kv_cache=eager_cache)
            got = compiled(x[:, t : t + 1], causal=True, kv_cache=compiled_cache)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(compiled_cache.state(0), eager_cache.state(0), rtol=0, atol=1e-12)
