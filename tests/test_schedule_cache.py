"""KV caches of schedule models: a local layer keeps only its window (or its chunk), decoding with the cache gives the
logits and tokens of recomputing the whole sequence, the encodings see true positions, and the done-when case of
issue 36 (a 4-layer rope, rope, rope, nope model with windows on the RoPE layers trains, generates, and its cache
stays within its windows)."""

from __future__ import annotations

import pytest
import torch

import posenc
from posenc.schedule import Span

VOCAB = 24


def _model(encoding: str, n_layers: int = 4, seed: int = 0) -> posenc.LanguageModel:
    torch.manual_seed(seed)
    return posenc.LanguageModel(VOCAB, encoding=encoding, n_layers=n_layers, d_model=32, n_heads=4).eval()


def _spans(model: posenc.LanguageModel) -> list[Span | None]:
    return [b.attn.span for b in model.trunk.blocks]


def _check_held(model: posenc.LanguageModel, cache: posenc.KVCache) -> None:
    """Every local layer holds at most what a later query may see; a global one holds everything."""
    seen = cache.length()
    for i, span in enumerate(_spans(model)):
        held = cache.cached(i)
        assert cache.seen(i) == seen
        if span is None:
            assert held == seen
        elif span.kind == "window":
            assert held == min(seen, span.size - 1) <= span.size
        else:
            assert held == seen % span.size < span.size
        # the positions held are the true positions of the last `held` tokens (never places in the storage)
        pos = cache.layers[i][2]
        assert torch.equal(pos[0], torch.arange(seen - held, seen)), (i, pos)
        # an encoding's per-key state is held for exactly the keys held
        state = cache.state(i)
        assert state is None or state.shape[2] == held, (i, None if state is None else state.shape)


SCHEDULES = [
    "rope@w4*3+nope",
    "rope@c5*2+nope+rope",
    "nope@w1+rope@w2",
    "alibi@w3+rope",  # a bias per offset: SDPA with the bias and the window as one mask
    "shaw@w4+rope@c3",  # a relative encoding: blocked kernel for the prompt, decode kernel per step
    "t5@c4+nope",
    "rope@w4*3+ssmax",  # the query temperatures (issue 36, part 2): SSMax counts the keys of its span
    "ssmax@w3+qtemp-llama4@c4",
    "fox@w4+fox@c3+fox*2",  # per-key state beside the keys (FoX's running sums): rolled and cut with them
]


@pytest.mark.parametrize("encoding", SCHEDULES)
def test_cached_decoding_equals_recomputing(encoding: str) -> None:
    model = _model(encoding)
    torch.manual_seed(1)
    out = torch.randint(0, VOCAB, (2, 7))
    cache = posenc.KVCache()
    with torch.no_grad():
        logits = model(out, kv_cache=cache)[:, -1]
        for _ in range(14):
            _check_held(model, cache)
            torch.testing.assert_close(logits, model(out)[:, -1], rtol=1e-4, atol=1e-5)
            nxt = logits.argmax(-1, keepdim=True)
            out = torch.cat([out, nxt], 1)
            logits = model(nxt, kv_cache=cache)[:, -1]
    greedy = model.generate(out[:, :7], 14)
    assert model.decoding_mode(7, 14)[0] == "cache"
    assert torch.equal(greedy, model.generate(out[:, :7], 14, use_cache=False))
    assert torch.equal(greedy, out)


def test_prompt_longer_than_the_window_then_chunked_steps() -> None:
    """A prompt of 13 tokens into windows of 4 and chunks of 5, then steps of 3 tokens at a time."""
    model = _model("rope@w4+rope@c5+nope+rope")
    torch.manual_seed(2)
    tokens = torch.randint(0, VOCAB, (3, 25))
    want = model(tokens)
    cache = posenc.KVCache()
    got = [model(tokens[:, :13], kv_cache=cache)]
    _check_held(model, cache)
    for start in range(13, 25, 3):
        got.append(model(tokens[:, start : start + 3], kv_cache=cache))
        _check_held(model, cache)
    torch.testing.assert_close(torch.cat(got, 1), want, rtol=1e-4, atol=1e-5)


def test_a_local_layer_stays_bounded_over_a_long_decode() -> None:
    model = _model("rope@w6*3+nope", n_layers=4)
    cache = posenc.KVCache()
    step = torch.randint(0, VOCAB, (1, 1))
    with torch.no_grad():
        model(torch.randint(0, VOCAB, (1, 40)), kv_cache=cache)
        for _ in range(300):
            step = model(step, kv_cache=cache)[:, -1].argmax(-1, keepdim=True)
            for i in range(3):
                assert cache.cached(i) == 5
                assert cache.layers[i][0].untyped_storage().nbytes() < 4 * 1024 * 4 * 8  # < 128 slots of storage
    assert cache.cached(3) == cache.length() == 340


def test_plan_leaves_a_rolling_cache_as_it_was() -> None:
    model = _model("rope@w3*2", n_layers=2)
    cache = posenc.KVCache()
    model(torch.randint(0, VOCAB, (1, 9)), kv_cache=cache)
    attn = model.trunk.blocks[0].attn
    x = torch.randn(1, 1, 32)
    before = {i: (cache.seen(i), cache.cached(i), cache.layers[i][0].clone()) for i in range(2)}
    plan = attn.plan(x, kv_cache=cache, causal=True)
    assert plan.kernel == "sdpa"
    for i, (seen, held, k) in before.items():
        assert (cache.seen(i), cache.cached(i)) == (seen, held) == (9, 2)
        assert torch.equal(cache.layers[i][0], k)


def test_generate_with_a_rolling_cache_counts_positions_past_the_window() -> None:
    # with the window smaller than the prompt, default positions must go on from the tokens seen (not held)
    model = _model("rope@w3+rope")
    prompt = torch.randint(0, VOCAB, (1, 10))
    assert torch.equal(model.generate(prompt, 6), model.generate(prompt, 6, use_cache=False))


# ------------------------------------------------------------------------------------------------ done when


def _copy_batch(gen: torch.Generator, batch: int = 32, n: int = 6) -> torch.Tensor:
    """``x_1 .. x_n SEP x_1 .. x_n``: the second half is predictable only by copying."""
    body = torch.randint(2, VOCAB, (batch, n), generator=gen)
    sep = torch.ones(batch, 1, dtype=torch.long)
    return torch.cat([body, sep, body], 1)


def _copy_loss(model: posenc.LanguageModel, tokens: torch.Tensor) -> torch.Tensor:
    n = (tokens.shape[1] - 1) // 2
    logits = model(tokens[:, :-1])[:, n:]  # predictions of the copied half
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, n + 1 :].reshape(-1))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_done_when_hybrid_trains_generates_and_caches_within_windows(seed: int) -> None:
    encoding = posenc.schedule("rope", "rope", "rope", "nope")
    windowed = posenc.schedule(*[(s.name, {}, ("window", 8) if s.name == "rope" else None) for s in encoding])
    assert str(windowed) == "rope@w8*3+nope"
    torch.manual_seed(seed)
    model = posenc.LanguageModel(VOCAB, encoding=windowed, n_layers=4, d_model=32, n_heads=4)
    assert _spans(model) == [Span("window", 8)] * 3 + [None]
    gen = torch.Generator().manual_seed(100 + seed)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    fixed = _copy_batch(torch.Generator().manual_seed(7), batch=64)
    with torch.no_grad():
        before = _copy_loss(model, fixed).item()
    for _ in range(40):
        loss = _copy_loss(model, _copy_batch(gen))
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        after = _copy_loss(model, fixed).item()
    assert after < before - 0.3, (before, after)
    for block in model.trunk.blocks:
        assert block.attn.last_plan is not None and block.attn.last_plan.kernel == "sdpa"
    # generation: cached tokens equal uncached, logits at every step, the local layers within their windows
    model.eval()
    prompt = fixed[:4, :7]
    tokens = model.generate(prompt, 12)
    assert torch.equal(tokens, model.generate(prompt, 12, use_cache=False))
    cache = posenc.KVCache()
    with torch.no_grad():
        logits = model(prompt, kv_cache=cache)[:, -1]
        for t in range(7, 19):
            torch.testing.assert_close(logits, model(tokens[:, :t])[:, -1], rtol=1e-4, atol=1e-5)
            assert all(cache.cached(i) <= 8 for i in range(3)) and cache.cached(3) == t
            logits = model(tokens[:, t : t + 1], kv_cache=cache)[:, -1]
