"""Stick-breaking attention (Tan et al. 2025): the paper's product written out in loops, the cumulative form in
log space, the encoder's order by distance, padding, the KV cache, gradients, the length limits, and a model that
trains."""

from __future__ import annotations

import math

import pytest
import torch
from cache_steps import cached_steps

import posenc
from posenc import MultiHeadAttention
from posenc.bias import stick_breaking as sb
from posenc.errors import ConfigError

D, H = 16, 2
DH = D // H


def _layer(seed: int = 0, **options) -> MultiHeadAttention:
    torch.manual_seed(seed)
    return MultiHeadAttention(D, H, posenc.get("stick-breaking", **options)).double()


def _sigmoid(z: float) -> float:
    return 1.0 / (1.0 + math.exp(-z))


def _loops(layer: MultiHeadAttention, x: torch.Tensor, causal: bool, attend_current: bool, remainder: bool):
    """A_ij = β_ij Π (1 - β_it) over the keys t that break before j: for a causal query the keys after j up to i - 1
    (i itself first where attend_current); without a mask by distance, the earlier of two first."""
    b, n, _ = x.shape
    q = layer.q_proj(x).view(b, n, H, DH)
    k = layer.k_proj(x).view(b, n, H, DH)
    v = layer.v_proj(x).view(b, n, H, DH)
    out = torch.zeros(b, n, H, DH, dtype=x.dtype)
    for bi in range(b):
        for h in range(H):
            for i in range(n):
                keys = [j for j in range(n) if (j <= i if causal else True) and (attend_current or j != i)]
                # breaking order: nearest first, the earlier of two at one distance first
                keys.sort(key=lambda j: (abs(i - j), j > i))
                rest, total = 1.0, 0.0
                for j in keys:
                    beta = _sigmoid(float(q[bi, i, h] @ k[bi, j, h]) / math.sqrt(DH))
                    out[bi, i, h] += rest * beta * v[bi, j, h]
                    total += rest * beta
                    rest *= 1.0 - beta
                if remainder:
                    out[bi, i, h] += (1.0 - total) * v[bi, i, h]
    return layer.o_proj(out.reshape(b, n, D))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("attend_current, remainder", [(False, True), (True, True), (False, False), (True, False)])
def test_the_paper_product_in_loops(causal: bool, attend_current: bool, remainder: bool) -> None:
    layer = _layer(attend_current=attend_current, remainder=remainder)
    x = torch.randn(2, 7, D, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(
            layer(x, causal=causal), _loops(layer, x, causal, attend_current, remainder), rtol=1e-10, atol=1e-12
        )
    assert layer.last_plan.kernel == "materialised" and "probabilities" in layer.last_plan.reason


def test_the_cumulative_form_in_log_space() -> None:
    """The causal weights as the paper's section 2 writes them for a parallel implementation:
    log A = log σ(z) + Σ_{t=j+1..i-1} log(1 - σ(z_it)), a product with a strictly lower triangular matrix of ones."""
    torch.manual_seed(1)
    n = 9
    z = torch.randn(2, 3, n, n, dtype=torch.float64) * 3
    causal = torch.ones(n, n, dtype=torch.bool).tril(-1)  # j < i
    log_beta = torch.nn.functional.logsigmoid(z).masked_fill(~causal, float("-inf"))
    log_rest = torch.nn.functional.logsigmoid(-z).masked_fill(~causal, 0.0)
    between = torch.ones(n, n, dtype=torch.float64).tril(-1)  # [t, j]: t > j
    want = (log_beta + log_rest @ between).exp()
    got = sb.stick_breaking_weights(z.masked_fill(~causal.tril(0), torch.finfo(z.dtype).min), remainder=False)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def test_weights_sum_to_one_with_the_remainder_and_at_most_one_without() -> None:
    z = torch.randn(3, 2, 11, 11, dtype=torch.float64) * 4
    with_rest = sb.stick_breaking_weights(z, remainder=True)
    without = sb.stick_breaking_weights(z, remainder=False)
    torch.testing.assert_close(with_rest.sum(-1), torch.ones(3, 2, 11, dtype=torch.float64))
    assert bool((without >= 0).all()) and bool((without.sum(-1) <= 1 + 1e-12).all())


def test_gradcheck() -> None:
    z = torch.randn(1, 2, 5, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: sb.stick_breaking_weights(t, attend_current=True), (z,))
    layer = _layer(seed=2)
    x = torch.randn(1, 5, D, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: layer(t, causal=True), (x,))


def test_left_padding_and_the_kv_cache() -> None:
    layer = _layer(seed=3)
    x = torch.randn(2, 12, D, dtype=torch.float64)
    pad = 4
    batch = torch.cat([x[:1], torch.cat([torch.randn(1, pad, D, dtype=torch.float64), x[1:, :-pad]], 1)])
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, :pad] = False
    with torch.no_grad():
        out = layer(batch, causal=True, attention_mask=mask)
        torch.testing.assert_close(out[1, pad:], layer(x[1:, :-pad], causal=True)[0], rtol=1e-10, atol=1e-12)
        want = layer(x, causal=True)
        torch.testing.assert_close(cached_steps(layer, x, 5)[0], want, rtol=1e-10, atol=1e-12)
        _, weights = layer(x, causal=True, return_weights=True)
        assert bool((weights.triu(1) == 0).all())  # nothing from later keys


def test_a_call_too_long_is_refused_with_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    enc = posenc.get("stick-breaking")
    ctx = None
    with pytest.raises(ConfigError, match=f"{sb.MAX_KEYS + 1} keys is more than its limit of {sb.MAX_KEYS}"):
        enc.probabilities(torch.zeros(1, 1, 1, sb.MAX_KEYS + 1), ctx)
    monkeypatch.setattr(sb, "MAX_PAIRS", 100)
    with pytest.raises(ConfigError, match="= 128 pairs is more than its limit of 100"):
        enc.probabilities(torch.zeros(2, 1, 8, 8), ctx)
    with pytest.raises(ConfigError, match="attend_current"):
        posenc.get("stick-breaking", attend_current="yes")


def test_a_model_trains_with_it() -> None:
    torch.manual_seed(4)
    lm = posenc.LanguageModel(30, d_model=D, n_heads=H, n_layers=2, encoding="stick-breaking")
    opt = torch.optim.Adam(lm.parameters(), lr=1e-2)
    data = torch.arange(30).repeat(4, 2)[:, :40]
    losses = []
    for _ in range(60):
        loss = lm.loss(data)
        losses.append(float(loss.detach()))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert losses[-1] < 0.5 * losses[0]
    prompt = torch.randint(0, 30, (2, 5))
    torch.testing.assert_close(lm.generate(prompt, 6), lm.generate(prompt, 6, use_cache=False))


def test_a_query_temperature_over_it_keeps_its_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """A temperature (SSMax) over stick-breaking: the attention still asks the inner encoding for its weights."""
    calls = []
    real = sb.StickBreaking.probabilities

    def spy(self, logits, ctx):
        calls.append(logits.shape)
        return real(self, logits, ctx)

    monkeypatch.setattr(sb.StickBreaking, "probabilities", spy)
    torch.manual_seed(5)
    enc = posenc.get("ssmax", inner="stick-breaking", n_heads=H, head_dim=DH, max_len=64)
    layer = MultiHeadAttention(D, H, enc).double()
    x = torch.randn(1, 6, D, dtype=torch.float64)
    with torch.no_grad():
        _, weights = layer(x, causal=True, return_weights=True)
    assert calls and layer.last_plan.kernel == "materialised"
    torch.testing.assert_close(weights.sum(-1), torch.ones(1, H, 6, dtype=torch.float64))


def test_randomized_positions_over_it_keep_its_weights() -> None:
    """posenc.randomized over stick-breaking (positions it does not read): the same attention as the bare one."""
    from posenc.randomized import randomized

    torch.manual_seed(6)
    bare = _layer(seed=6).eval()
    wrapped = MultiHeadAttention(D, H, randomized(posenc.get("stick-breaking"), max_len=64)).double().eval()
    wrapped.load_state_dict(bare.state_dict())
    x = torch.randn(1, 7, D, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(wrapped(x, causal=True), bare(x, causal=True), rtol=1e-12, atol=1e-12)


def test_a_patched_model_whose_attention_soft_caps_keeps_the_stick_breaking_weights() -> None:
    """posenc.hf computes soft-capped attention (Gemma 2) by the formula: its own weights must go there too. With a
    cap too high to bend any logit, the capped model gives the uncapped one's outputs (softmax would differ)."""
    transformers = pytest.importorskip("transformers")
    hf = pytest.importorskip("posenc.hf")
    cfg = dict(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=64, head_dim=16, sliding_window=64,
        final_logit_softcapping=None,
    )
    outs = []
    for cap in (1e9, None):
        torch.manual_seed(0)
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**cfg, attn_logit_softcapping=cap)).eval()
        hf.patch(model, "stick-breaking")
        with torch.no_grad():
            outs.append(model(torch.arange(1, 9)[None], use_cache=False).logits)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
