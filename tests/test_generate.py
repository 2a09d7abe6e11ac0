"""LanguageModel.generate: the same tokens with and without a cache, sampling, eos, bad arguments, train mode.

The truths the tests compare with are written here by hand: greedy decoding is a loop calling
``model(tokens)`` on the whole sequence and taking the argmax of the last logits; sampling is checked
against the softmax of those same logits.
"""

import pathlib
import re

import pytest
import torch

import posenc
from posenc.errors import ConfigError, PosencError
from posenc.registry import example_options

V, D, H, LAYERS, MAX_LEN = 50, 32, 2, 2, 64
PROMPT, NEW = 5, 12


# the settings each encoding declares (example_options), for a model trained on 8 tokens (max_len=16 halved):
# less than PROMPT + NEW, so that the length-dependent RoPE variants change their frequencies during generation,
# the case a KV cache cannot follow
def options_for(name):
    return example_options(name, dict(d_model=D, n_heads=H, head_dim=D // H, max_len=16)) or None


def recomputes(name):
    """Whether the encoding (built as build() builds it) says a cache would change its outputs here."""
    enc = posenc.registry.build(
        name, dims=dict(d_model=D, n_heads=H, head_dim=D // H, max_len=MAX_LEN, vocab_size=V), options=options_for(name)
    )
    return enc.cache_problem(PROMPT, PROMPT + NEW) is not None


MEMORY = {"transformer-xl", "xlnet"}  # XLNet keeps Transformer-XL's segment recurrence


def build(name, options=None, seed=0, **kw):
    """A float64 model whose parameters are all moved off their initial values (CoPE's zero table would hide bugs)."""
    torch.manual_seed(seed)
    dims = dict(d_model=D, n_heads=H, n_layers=LAYERS, max_len=MAX_LEN) | kw
    model = posenc.LanguageModel(V, encoding=name, encoding_options=options, **dims).double().eval()
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def cases():
    """Every registered encoding with the settings it declares; one that cannot be built is skipped, saying why."""
    for name in posenc.available():
        options = options_for(name)
        try:
            posenc.LanguageModel(
                V, encoding=name, encoding_options=options, d_model=D, n_heads=H, n_layers=LAYERS, max_len=MAX_LEN
            )
        except ConfigError as e:
            reason = f"cannot be built with its example options {options}: {e}"
            yield pytest.param(name, options, id=f"{name}-skipped", marks=pytest.mark.skip(reason=reason))
        else:
            yield pytest.param(name, options, id=name)


# the encodings whose outputs depend on the whole sequence (with the options above): generate recomputes them
RECOMPUTE = {name for name in posenc.available() if recomputes(name)}


def greedy_by_hand(model, prompt, n):
    out = prompt
    with torch.no_grad():
        for _ in range(n):
            nxt = model(out)[:, -1].argmax(-1)
            out = torch.cat([out, nxt[:, None]], 1)
    return out


def last_logits_by_hand(model, out, prompt_length):
    """The logits each generated token of ``out`` was chosen from: ``[B, new, V]``."""
    with torch.no_grad():
        return torch.stack([model(out[:, :t])[:, -1] for t in range(prompt_length, out.shape[1])], 1)


def prompt_tokens(batch=2, length=PROMPT, seed=1):
    return torch.randint(0, V, (batch, length), generator=torch.Generator().manual_seed(seed))


def generate_recording_logits(model, prompt, n, **kw):
    """``model.generate(...)`` and the last-position logits of every forward it made (from the head's output)."""
    seen = []
    handle = model.head.register_forward_hook(lambda _m, _i, out: seen.append(out[:, -1]))
    try:
        out = model.generate(prompt, n, **kw)
    finally:
        handle.remove()
    return out, torch.stack(seen, 1)


@pytest.mark.parametrize(("name", "options"), list(cases()))
def test_greedy_with_cache_equals_without_and_the_hand_written_loop(name, options):
    model = build(name, options)
    prompt = prompt_tokens()
    mode, why = model.decoding_mode(PROMPT, NEW)
    expected_mode = "recompute" if name in RECOMPUTE else "memory" if name in MEMORY else "cache"
    assert mode == expected_mode, why
    cached, cached_logits = generate_recording_logits(model, prompt, NEW)
    assert cached.shape == (2, PROMPT + NEW) and cached.dtype == torch.long
    assert torch.equal(cached, greedy_by_hand(model, prompt, NEW))
    uncached, uncached_logits = generate_recording_logits(model, prompt, NEW, use_cache=False)
    assert torch.equal(cached, uncached)
    # a random model may repeat one token, which would hide wrong positions: compare the logits too
    by_hand = last_logits_by_hand(model, cached, PROMPT)
    assert torch.allclose(cached_logits, by_hand, atol=1e-9, rtol=0)  # one forward through the head per token
    assert torch.allclose(uncached_logits, by_hand, atol=1e-9, rtol=0)


@pytest.mark.parametrize(("name", "options"), [(n, options_for(n)) for n in sorted(RECOMPUTE)])
def test_the_encodings_generate_recomputes_would_be_wrong_with_a_cache(name, options):
    # the reason for the fallback: decoding these with a KV cache changes the logits
    model = build(name, options)
    prompt = prompt_tokens()
    out = greedy_by_hand(model, prompt, NEW)
    cache = posenc.KVCache()
    with torch.no_grad():
        steps = [model(out[:, : PROMPT + 1], kv_cache=cache)]
        steps += [model(out[:, t : t + 1], kv_cache=cache) for t in range(PROMPT + 1, out.shape[1])]
        full = model(out)
    assert (torch.cat(steps, 1) - full).abs().max() > 1e-3


def test_length_dependent_rope_uses_the_cache_while_its_frequencies_stay_the_same():
    for name in ("rope-dynamic", "rope-longrope"):
        options = options_for(name) | {"original_max_len": PROMPT + NEW - 1}  # the longest sequence fed
        model = build(name, options)
        assert model.decoding_mode(PROMPT, NEW)[0] == "cache"
        assert model.decoding_mode(PROMPT, NEW + 1)[0] == "recompute"
        prompt = prompt_tokens()
        assert torch.equal(model.generate(prompt, NEW), greedy_by_hand(model, prompt, NEW))


def test_decoding_mode_of_the_other_cases():
    rope = build("rope")
    assert rope.decoding_mode(PROMPT, NEW, use_cache=False) == ("recompute", "use_cache=False")
    assert build("normalized", {"length": 40}).decoding_mode(PROMPT, NEW)[0] == "cache"
    random_at_eval = build("randomized-rope", {"at_eval": "random"})
    mode, why = random_at_eval.decoding_mode(PROMPT, NEW)
    assert mode == "recompute" and "at_eval='random'" in why
    bidirectional = build("rope", causal=False)
    assert bidirectional.decoding_mode(PROMPT, NEW)[0] == "recompute"
    prompt = prompt_tokens()
    assert torch.equal(bidirectional.generate(prompt, NEW), greedy_by_hand(bidirectional, prompt, NEW))


def test_zero_new_tokens_returns_the_prompt():
    prompt = prompt_tokens().int()
    out = build("rope").generate(prompt, 0)
    assert out.dtype == torch.long and torch.equal(out, prompt.long())


# ----------------------------------------------------------------------------------------------- sampling


@pytest.mark.parametrize("name", ["rope", "transformer-xl", "normalized", "alibi"])
def test_seeded_sampling_is_reproducible_and_the_same_with_and_without_cache(name):
    model = build(name)
    prompt = prompt_tokens()

    def sample(seed, **kw):
        return model.generate(
            prompt, NEW, do_sample=True, temperature=1.5, generator=torch.Generator().manual_seed(seed), **kw
        )

    state = torch.get_rng_state()
    first = sample(0)
    assert torch.equal(torch.get_rng_state(), state)  # only the given generator is drawn from
    assert torch.equal(first, sample(0))
    assert torch.equal(first, sample(0, use_cache=False))
    assert not torch.equal(first, sample(1))
    assert not torch.equal(first, model.generate(prompt, NEW))  # it samples: not the greedy tokens


def test_top_k_1_and_temperature_0_are_greedy():
    model = build("rope")
    prompt = prompt_tokens()
    greedy = greedy_by_hand(model, prompt, NEW)
    g = torch.Generator().manual_seed(0)
    assert torch.equal(model.generate(prompt, NEW, do_sample=True, temperature=3.0, top_k=1, generator=g), greedy)
    assert torch.equal(model.generate(prompt, NEW, do_sample=True, temperature=0.0, generator=g), greedy)
    assert torch.equal(model.generate(prompt, NEW, do_sample=True, temperature=1e-30, generator=g), greedy)


def test_sampled_tokens_lie_within_top_k():
    model = build("rope")
    prompt = prompt_tokens(batch=4)
    g = torch.Generator().manual_seed(3)
    out = model.generate(prompt, 20, do_sample=True, temperature=5.0, top_k=3, generator=g)
    logits = last_logits_by_hand(model, out, PROMPT)
    top3 = logits.topk(3, dim=-1).indices
    chosen = out[:, PROMPT:]
    assert (top3 == chosen[..., None]).any(-1).all()
    assert (chosen != top3[..., 0]).any()  # and not only the argmax


def test_sampling_frequencies_follow_the_tempered_top_k_softmax():
    model = build("alibi")
    n, temperature, k = 20000, 0.7, 5
    prompt = prompt_tokens(batch=1).expand(n, -1)
    g = torch.Generator().manual_seed(11)
    drawn = model.generate(prompt, 1, do_sample=True, temperature=temperature, top_k=k, generator=g)[:, -1]
    with torch.no_grad():
        logits = model(prompt[:1])[0, -1]
    top = logits.topk(k)
    expected = torch.zeros(V, dtype=torch.float64)
    expected[top.indices] = torch.softmax(top.values / temperature, -1)
    freq = torch.bincount(drawn, minlength=V).double() / n
    assert freq[expected == 0].sum() == 0
    assert torch.allclose(freq, expected, atol=4 * (0.25 / n) ** 0.5)
    assert expected.max() < 0.9  # a distribution worth checking, not one near-certain token


# ---------------------------------------------------------------------------------------------------- eos


def expected_with_eos(reference, prompt_length, eos):
    """Each row of ``reference`` cut after its first generated ``eos`` and filled with ``eos``; stop when all are."""
    out = reference.clone()
    ends = []
    for row in out:
        hits = (row[prompt_length:] == eos).nonzero()
        if len(hits):
            end = prompt_length + int(hits[0]) + 1
            row[end:] = eos
            ends.append(end)
        else:
            ends.append(out.shape[1])
    return out[:, : max(ends)]


@pytest.mark.parametrize(("name", "seed"), [("rope", 0), ("transformer-xl", 0), ("normalized", 1)])
def test_eos_finishes_a_row_and_pads_it_with_eos(name, seed):
    model = build(name, seed=seed)
    prompt = prompt_tokens(batch=3)
    reference = model.generate(prompt, NEW)
    gen = reference[:, PROMPT:]

    def visible(t):  # row 0 generates t and then something else; row 1 never generates t
        first = int((gen[0] == t).nonzero()[0])
        return not (gen[1] == t).any() and (gen[0, first:] != t).any()

    eos = next((int(t) for t in gen[0].unique() if visible(t)), None)
    assert eos is not None, "pick another seed: the test needs a row that finishes early, visibly"
    out = model.generate(prompt, NEW, eos_token_id=eos)
    assert out.shape[1] == PROMPT + NEW  # row 1 never finishes
    assert torch.equal(out, expected_with_eos(reference, PROMPT, eos))
    first = PROMPT + int((gen[0] == eos).nonzero()[0])
    assert (out[0, first:] == eos).all() and not torch.equal(out[0], reference[0])
    assert torch.equal(out[1], reference[1])
    assert torch.equal(out, model.generate(prompt, NEW, eos_token_id=eos, use_cache=False))


def test_generation_stops_when_every_row_has_finished():
    model = build("rope")
    prompt = prompt_tokens(batch=1, seed=5)
    reference = model.generate(prompt, NEW)
    eos = int(reference[0, PROMPT + 2])
    out = model.generate(prompt, NEW, eos_token_id=eos)
    assert torch.equal(out, expected_with_eos(reference, PROMPT, eos))
    assert out.shape[1] < PROMPT + NEW and out[0, -1] == eos


def test_eos_in_the_prompt_does_not_stop_generation():
    model = build("rope")
    prompt = prompt_tokens(batch=1, seed=5)
    reference = model.generate(prompt, NEW)
    eos = next(int(t) for t in prompt[0, 1:-1] if not (reference[0, PROMPT:] == t).any())
    assert torch.equal(model.generate(prompt, NEW, eos_token_id=eos), reference)


# ------------------------------------------------------------------------------------------ bad arguments


@pytest.mark.parametrize(
    ("tokens", "kwargs", "match"),
    [
        (torch.zeros(5, dtype=torch.long), {}, r"tokens must be \[batch, length\].*shape \(5,\)"),
        (torch.zeros(2, 0, dtype=torch.long), {}, r"at least one token"),
        (torch.zeros(2, 3), {}, r"integer token ids.*torch.float32"),
        (torch.zeros(2, 3, dtype=torch.bool), {}, r"integer token ids.*torch.bool"),
        ([[1, 2, 3]], {}, r"tokens must be a tensor.*list"),
        (torch.tensor([[1, V]]), {}, rf"token ids must be in \[0, vocab_size={V}\), got ids from 1 to {V}"),
        (torch.tensor([[-1, 2]]), {}, r"token ids must be in \[0, vocab_size=50\), got ids from -1"),
        (None, {"max_new_tokens": -1}, r"max_new_tokens must be an integer >= 0, got -1"),
        (None, {"max_new_tokens": 2.0}, r"max_new_tokens must be an integer >= 0, got 2.0"),
        (None, {"temperature": -0.5}, r"temperature must be a finite number >= 0 \(0: greedy\), got -0.5"),
        (None, {"temperature": float("nan")}, r"temperature must be a finite number"),
        (None, {"top_k": 0}, r"top_k must be an integer >= 1 \(1: greedy\) or None"),
        (None, {"eos_token_id": V}, rf"eos_token_id must be a token id in \[0, vocab_size={V}\)"),
        (None, {"generator": 0}, r"generator must be a torch.Generator"),
    ],
)
def test_bad_arguments_say_what_is_wrong(tokens, kwargs, match):
    model = build("rope")
    tokens = prompt_tokens() if tokens is None else tokens
    kwargs = {"max_new_tokens": 3} | kwargs
    with pytest.raises(ConfigError, match=match) as info:
        model.generate(tokens, **kwargs)
    assert isinstance(info.value, PosencError)


@pytest.mark.parametrize("name", ["learned", "relative-key", "randomized-learned"])
def test_a_generation_longer_than_the_encoding_takes_is_refused(name):
    model = build(name, max_len=16)
    prompt = prompt_tokens(length=5)
    with pytest.raises(ConfigError, match=rf"up to 17 tokens.*{name}' takes at most 16: use max_new_tokens <= 12"):
        model.generate(prompt, 13)
    assert model.generate(prompt, 12).shape == (2, 17)  # the limit is exact: 16 tokens are fed
    with pytest.raises(ConfigError, match=r"the prompt alone is longer: use prompt length \+ max_new_tokens - 1 <= 16"):
        model.generate(prompt_tokens(length=17), 1)


# ------------------------------------------------------------------------------------------ training mode


def test_generate_runs_in_eval_mode_and_restores_every_module():
    model = build("rope", dropout=0.5)
    prompt = prompt_tokens()
    expected = greedy_by_hand(model, prompt, NEW)  # build() gives an eval-mode model
    model.train()
    model.trunk.blocks[1].eval()  # a mix of modes comes back as it was
    before = {name: m.training for name, m in model.named_modules()}
    assert torch.equal(model.generate(prompt, NEW), expected)  # no dropout while generating
    assert {name: m.training for name, m in model.named_modules()} == before


def test_the_mode_is_restored_when_generate_raises():
    model = build("learned", max_len=16).train()
    with pytest.raises(ConfigError, match="takes at most 16"):
        model.generate(prompt_tokens(), 20)  # refused after switching to eval mode
    assert all(m.training for m in model.modules())


def test_the_docs_example_runs():
    doc = pathlib.Path(__file__).resolve().parent.parent / "docs" / "generate.md"
    blocks = re.findall(r"```python\n(.*?)```", doc.read_text(), flags=re.S)
    assert blocks
    for code in blocks:
        exec(compile(code, str(doc), "exec"), {})
