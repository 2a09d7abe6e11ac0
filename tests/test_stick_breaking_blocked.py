"""Stick-breaking attention's blocked kernel (issue 49): the log-space recurrence over blocks of query rows equals
the reference weights (float64, gradients included) for random shapes, flags and block heights; the models take
it; a call past the reference path's limits runs; torch.compile keeps it; a KV cache decodes through it."""

from __future__ import annotations

import pytest
import torch
from cache_steps import cached_steps
from hypothesis import given, settings
from hypothesis import strategies as st

import posenc
from posenc import MultiHeadAttention
from posenc.bias import stick_breaking as sb
from posenc.errors import ConfigError

D, H = 16, 2


def _on_reference_path(layer: MultiHeadAttention, x: torch.Tensor, **kw) -> torch.Tensor:
    layer.path = "reference"
    try:
        return layer(x, **kw)
    finally:
        layer.path = "auto"


def _reference(q, k, v, scale: float, attend_current: bool, remainder: bool, allowed=None) -> torch.Tensor:
    """The reference path's weights (:func:`stick_breaking_weights` on the causally masked logits, and those the
    mask ``allowed`` hides) times ``v``."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    lq, lk = s.shape[-2:]
    later = torch.arange(lk)[None, :] > torch.arange(lq)[:, None] + (lk - lq)
    s = s.masked_fill(later, torch.finfo(s.dtype).min)
    if allowed is not None:
        s = s.masked_fill(~allowed, torch.finfo(s.dtype).min)
    return torch.matmul(sb.stick_breaking_weights(s, attend_current, remainder), v)


@settings(max_examples=40, deadline=None)
@given(
    lq=st.integers(1, 40),
    extra=st.integers(0, 12),
    d=st.sampled_from([1, 3, 8]),
    attend_current=st.booleans(),
    remainder=st.booleans(),
    block_bytes=st.sampled_from([1, 3000, 2**20]),  # 1: blocks of MIN_ROWS rows, one (sequence, head) at a time
    spread=st.sampled_from([0.5, 3.0]),
    mask=st.sampled_from([None, "per-query", "per-sequence"]),
    seed=st.integers(0, 10_000),
)
def test_the_blocked_kernel_equals_the_reference_weights_with_gradients(
    lq, extra, d, attend_current, remainder, block_bytes, spread, mask, seed
) -> None:
    torch.manual_seed(seed)
    lk = lq + extra  # a KV cache's keys before the queries
    q, k, v = (torch.randn(2, 3, n, d, dtype=torch.float64) * s for n, s in ((lq, spread), (lk, spread), (lk, 1)))
    # a mask beside the causal one: random keys hidden per query (documents), or a sequence's first keys (padding)
    allowed = None
    if mask == "per-query":
        allowed = torch.rand(2, 1, lq, lk) > 0.3
    elif mask == "per-sequence":
        allowed = (torch.arange(lk) >= torch.tensor([[0], [min(lk - 1, 3)]])).view(2, 1, 1, lk)
    for t in (q, k, v):
        t.requires_grad_()
    old = sb.BLOCK_BYTES
    sb.BLOCK_BYTES = block_bytes
    try:
        got = sb.stick_breaking_attention(q, k, v, 0.7, attend_current, remainder, allowed)
        grad_out = torch.randn_like(got)
        got_grads = torch.autograd.grad(got, (q, k, v), grad_out)
    finally:
        sb.BLOCK_BYTES = old
    want = _reference(q, k, v, 0.7, attend_current, remainder, allowed)
    want_grads = torch.autograd.grad(want, (q, k, v), grad_out)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    for name, a, b in zip("qkv", got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=lambda m, n=name: f"d{n}: {m}")


@pytest.mark.parametrize("attend_current, remainder", [(False, True), (True, False)])
def test_gradcheck_of_the_kernel(attend_current: bool, remainder: bool) -> None:
    torch.manual_seed(1)
    q = torch.randn(1, 2, 5, 3, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 7, 3, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, 7, 3, dtype=torch.float64, requires_grad=True)
    fn = lambda *t: sb.stick_breaking_attention(*t, 0.9, attend_current, remainder)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_float32_stays_near_float64_at_2048() -> None:
    """The running sum of softplus in float32 over 2048 keys: near keys (where the weights are) sum few terms."""
    torch.manual_seed(2)
    q, k, v = (torch.randn(1, 2, 2048, 32) for _ in range(3))
    got = sb.stick_breaking_attention(q, k, v, 32**-0.5)
    want = sb.stick_breaking_attention(q.double(), k.double(), v.double(), 32**-0.5)
    assert float((got.double() - want).abs().max()) < 2e-5


@pytest.mark.parametrize("attend_current", [False, True])
def test_later_keys_reach_no_earlier_output_bit_for_bit(attend_current: bool) -> None:
    """Causality exactly: the keys after a query get weight 0, not e^LOG_FLOOR, so changing them (and their values)
    leaves every earlier output the same bits."""
    torch.manual_seed(8)
    q, k, v = (torch.randn(2, 2, 96, 8) * 2 for _ in range(3))
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 50:] = torch.randn(2, 2, 46, 8) * 50
    v2[:, :, 50:] = torch.randn(2, 2, 46, 8) * 1e6
    old = sb.BLOCK_BYTES
    for block_bytes in (1, old):
        sb.BLOCK_BYTES = block_bytes
        try:
            a = sb.stick_breaking_attention(q, k, v, 0.5, attend_current)
            b = sb.stick_breaking_attention(q, k2, v2, 0.5, attend_current)
        finally:
            sb.BLOCK_BYTES = old
        assert torch.equal(a[:, :, :50], b[:, :, :50])
        assert not torch.equal(a[:, :, 50:], b[:, :, 50:])


def test_the_models_take_it_and_it_equals_the_reference_path() -> None:
    torch.manual_seed(3)
    layer = MultiHeadAttention(D, H, posenc.get("stick-breaking")).double()
    x = torch.randn(2, 80, D, dtype=torch.float64, requires_grad=True)
    assert layer.plan(x, causal=True).kernel == "own-blocked"
    out = layer(x, causal=True)
    (g,) = torch.autograd.grad(out.square().sum(), x)
    ref = _on_reference_path(layer, x, causal=True)
    assert layer.last_plan.kernel == "materialised"
    (gr,) = torch.autograd.grad(ref.square().sum(), x)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(g, gr, rtol=1e-9, atol=1e-11)
    # a padding mask or an encoder: the reference weights inside the same kernel, the same numbers
    mask = torch.ones(2, 80, dtype=torch.bool)
    mask[1, :7] = False
    with torch.no_grad():
        cases = (({"causal": True, "attention_mask": mask}, "own-blocked"), ({"causal": False}, "materialised"))
        for kw, kernel in cases:
            got = layer(x, **kw)
            assert layer.last_plan.kernel == kernel  # an encoder breaks the stick by distance: the reference weights
            torch.testing.assert_close(got, _on_reference_path(layer, x, **kw), rtol=1e-10, atol=1e-12)


def test_a_call_past_the_reference_limit_runs_blocked() -> None:
    """More keys than the reference path's MAX_KEYS: refused there, computed here (no [B, H, Lq, Lk] tensor)."""
    n = sb.MAX_KEYS + 100
    torch.manual_seed(4)
    q, k, v = (torch.randn(1, 1, n, 8) for _ in range(3))
    out = sb.stick_breaking_attention(q, k, v, 8**-0.5)
    assert out.shape == (1, 1, n, 8) and bool(torch.isfinite(out).all())
    # its last rows against the reference on the keys they see (the queries among the last keys)
    tail = _reference(q[:, :, -3:].double(), k.double(), v.double(), 8**-0.5, False, True)
    torch.testing.assert_close(out[:, :, -3:].double(), tail, rtol=1e-4, atol=1e-5)
    with pytest.raises(ConfigError, match="limit of"):
        sb.check_fits("stick-breaking attention", 1, 1, n, n)


def test_a_kv_cache_decodes_through_the_kernel() -> None:
    torch.manual_seed(5)
    layer = MultiHeadAttention(D, H, posenc.get("stick-breaking", attend_current=True)).double()
    x = torch.randn(2, 90, D, dtype=torch.float64)
    with torch.no_grad():
        want = _on_reference_path(layer, x, causal=True)
        got, _ = cached_steps(layer, x, 70)
        assert layer.last_plan.kernel == "own-blocked"  # a decoding step: decodes_itself
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_generate_with_and_without_a_cache() -> None:
    torch.manual_seed(6)
    lm = posenc.LanguageModel(40, d_model=D, n_heads=H, n_layers=2, encoding="stick-breaking")
    prompt = torch.randint(0, 40, (2, 70))
    torch.testing.assert_close(lm.generate(prompt, 5), lm.generate(prompt, 5, use_cache=False))


def test_compiled_layer_keeps_the_kernel() -> None:
    torch.manual_seed(7)
    layer = MultiHeadAttention(D, H, posenc.get("stick-breaking"))
    x = torch.randn(1, 200, D, requires_grad=True)
    want = layer(x, causal=True)
    (gw,) = torch.autograd.grad(want.square().sum(), x)
    assert layer.last_plan.kernel == "own-blocked"
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    got = compiled(x, causal=True)
    (gg,) = torch.autograd.grad(got.square().sum(), x)
    assert layer.last_plan.kernel == "own-blocked"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gg, gw, rtol=1e-4, atol=1e-5)


def test_bad_input_is_refused_with_what_would_be_right() -> None:
    q = torch.randn(1, 2, 5, 4)
    with pytest.raises(ConfigError, match=r"k must be a tensor \[batch, heads, length, head_dim\]"):
        sb.stick_breaking_attention(q, q[0], q, 0.5)
    with pytest.raises(ConfigError, match="causal needs at least as many keys as queries, got Lk=3 < Lq=5"):
        sb.stick_breaking_attention(q, q[:, :, :3], q[:, :, :3], 0.5)
    with pytest.raises(ConfigError, match="float32 or float64"):
        sb.stick_breaking_attention(q.half(), q.half(), q.half(), 0.5)
    with pytest.raises(ConfigError, match=r"allowed must be a boolean mask \[B\|1, H\|1, Lq\|1, Lk\]"):
        sb.stick_breaking_attention(q, q, q, 0.5, allowed=torch.ones(1, 2, 5, 4, dtype=torch.bool))


def test_a_patched_transformers_model_takes_the_kernel_and_equals_its_reference_path() -> None:
    transformers = pytest.importorskip("transformers")
    hf = pytest.importorskip("posenc.hf")
    cfg = transformers.LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512,
    )
    torch.manual_seed(9)
    model = transformers.LlamaForCausalLM(cfg).double().eval()
    hf.patch(model, "stick-breaking")
    cores = [m.__dict__["_posenc_core"] for m in model.modules() if "_posenc_core" in m.__dict__]
    x = torch.randint(0, 97, (2, 120))
    pad = torch.ones(2, 120, dtype=torch.long)
    pad[1, :9] = 0  # a left-padded row: its mask goes into the kernel beside the causal one
    with torch.no_grad():
        fast = [model(x, use_cache=False).logits, model(x, attention_mask=pad, use_cache=False).logits]
        assert [c.last_plan.kernel for c in cores] == ["own-blocked"] * 2
        for c in cores:
            c.path = "reference"
        ref = [model(x, use_cache=False).logits, model(x, attention_mask=pad, use_cache=False).logits]
        assert [c.last_plan.kernel for c in cores] == ["materialised"] * 2
    torch.testing.assert_close(fast[0], ref[0], rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(fast[1][:, 9:], ref[1][:, 9:], rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(fast[1][0], ref[1][0], rtol=1e-9, atol=1e-10)
