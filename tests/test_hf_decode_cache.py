"""posenc.hf decoding with a KV cache for rotations transformers' cos/sin cannot express (xPos, interleaved RoPE):
each key is rotated once, when it enters the cache, and every way a cache is used gives what the model gives with
no cache (and what the rotation of every cached key at each step, the path before, gives).

Tiny random Llama, no downloads.
"""

from __future__ import annotations

import pytest
import torch

from posenc.errors import ConfigError

transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("posenc.hf")

from test_hf_patch import LLAMA, _quiet, tokens  # noqa: E402, F401  (_quiet: the autouse fixture)
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

from posenc.hf.rotary import ROTATED_ATTR  # noqa: E402

ROTATIONS = ["xpos", "rope-interleaved"]


def llama(name: str, *, every_step: bool = False, **kw) -> LlamaForCausalLM:
    """A tiny Llama patched with ``name``; ``every_step``: with the path that rotates every cached key at each call."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA)).eval()
    with torch.no_grad():  # sharper attention than a fresh model's near-uniform one, so that position shows
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    hf.patch(model, name, **kw)
    if every_step:
        hf.patched(model).key_rotation = {}
    return model


def no_cache_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, use_cache=False).logits


def generated(model, prompt: torch.Tensor, new: int = 8, **kw):
    out = model.generate(
        prompt,
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_logits=True,
        **kw,
    )
    return out.sequences, torch.stack(out.logits, dim=1)  # [B, new, V]: the logits of each generated token


def check_against_no_cache(model, seq: torch.Tensor, logits: torch.Tensor, prompt_len: int) -> None:
    """The logits generate saw at each step equal the no-cache forward's over the whole sequence."""
    whole = no_cache_logits(model, seq)[:, prompt_len - 1 : -1]
    torch.testing.assert_close(logits, whole, atol=1e-4, rtol=1e-4)


def rotated(cache, layer: int = 0):
    return cache.layers[layer].__dict__.get(ROTATED_ATTR)


@pytest.mark.parametrize("name", ROTATIONS)
def test_generate_with_the_cache_gives_the_no_cache_logits_and_rotates_each_key_once(name, monkeypatch):
    model = llama(name)
    prompt = tokens(b=1, n=7)
    enc = hf.patched(model).cores[0].encoding
    rows: list[int] = []
    inner = type(enc).rotate

    def counting(self, q, k, ctx):
        rows.append(k.shape[-2])
        return inner(self, q, k, ctx)

    monkeypatch.setattr(type(enc), "rotate", counting)
    cache = DynamicCache()
    seq, logits = generated(model, prompt, past_key_values=cache)
    monkeypatch.setattr(type(enc), "rotate", inner)
    check_against_no_cache(model, seq, logits, prompt.shape[1])
    assert rows == [7, 7] + [1] * 14  # the prompt's keys, then one key per layer and step (8 steps, the last none)
    assert rotated(cache) == (hf.patched(model).key_rotation[0], 14)
    # the path that rotates every cached key at each step gives the same tokens and logits
    seq2, logits2 = generated(llama(name, every_step=True), prompt)
    assert torch.equal(seq, seq2)
    torch.testing.assert_close(logits, logits2, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ROTATIONS)
def test_a_static_cache_and_the_reference_path_give_the_no_cache_logits(name):
    prompt = tokens(b=1, n=5, seed=1)
    model = llama(name)
    seq, logits = generated(model, prompt, cache_implementation="static")
    check_against_no_cache(model, seq, logits, prompt.shape[1])
    ref = llama(name, path="reference")
    seq_ref, logits_ref = generated(ref, prompt)
    assert torch.equal(seq, seq_ref)
    torch.testing.assert_close(logits, logits_ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ROTATIONS)
def test_beam_search_with_the_cache_gives_the_beams_without_it(name):
    model = llama(name)
    prompt = tokens(b=1, n=6, seed=2)
    kw = dict(max_new_tokens=6, num_beams=2, do_sample=False, pad_token_id=0)
    with_cache = model.generate(prompt, **kw)
    assert torch.equal(with_cache, model.generate(prompt, use_cache=False, **kw))


def test_a_cache_passed_to_two_generate_calls_continues_exactly():
    model = llama("xpos")
    prompt = tokens(b=1, n=6, seed=3)
    cache = DynamicCache()
    first, _ = generated(model, prompt, new=4, past_key_values=cache)
    second, logits = generated(model, first, new=4, past_key_values=cache)
    whole, _ = generated(model, prompt, new=8)
    assert torch.equal(second, whole)
    check_against_no_cache(model, second, logits, first.shape[1])


@pytest.mark.parametrize("name", ROTATIONS)
def test_a_cropped_cache_rotates_the_keys_written_again(name):
    """Assisted decoding's pattern: a few tokens in, cropped back, other tokens in their place."""
    model = llama(name)
    ids = tokens(b=1, n=12, seed=4)
    other = tokens(b=1, n=3, seed=5)
    cache = DynamicCache()
    with torch.no_grad():
        model(ids[:, :9], past_key_values=cache, use_cache=True)
        model(ids[:, 9:], past_key_values=cache, use_cache=True)
        assert rotated(cache) is not None and rotated(cache)[1] == 12
        cache.crop(-3)
        got = model(other, past_key_values=cache, use_cache=True).logits
    want = no_cache_logits(model, torch.cat([ids[:, :9], other], dim=1))[:, 9:]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_a_step_with_gradients_reads_the_rotated_cache_without_writing_it():
    model = llama("xpos")
    ids = tokens(b=1, n=10, seed=6)
    cache = DynamicCache()
    with torch.no_grad():
        model(ids[:, :8], past_key_values=cache, use_cache=True)
    got = model(ids[:, 8:], past_key_values=cache, use_cache=True).logits  # gradients on: keys not written
    assert got.requires_grad and rotated(cache)[1] == 8
    torch.testing.assert_close(got.detach(), no_cache_logits(model, ids)[:, 8:], atol=1e-4, rtol=1e-4)
    with torch.no_grad():  # the next step rotates the two keys the step with gradients left as they were
        step = model(tokens(b=1, n=1, seed=7), past_key_values=cache, use_cache=True).logits
    assert rotated(cache)[1] == 11
    want = no_cache_logits(model, torch.cat([ids, tokens(b=1, n=1, seed=7)], dim=1))[:, -1:]
    torch.testing.assert_close(step, want, atol=1e-4, rtol=1e-4)


def test_a_cache_filled_by_another_path_is_rotated_on_its_first_step():
    """A cache whose keys posenc.hf stored as projected (the path that rotates every step) is taken over."""
    slow, fast = llama("xpos", every_step=True), llama("xpos")
    ids = tokens(b=1, n=9, seed=8)
    cache = DynamicCache()
    with torch.no_grad():
        slow(ids[:, :8], past_key_values=cache, use_cache=True)
        assert rotated(cache) is None
        got = fast(ids[:, 8:], past_key_values=cache, use_cache=True).logits
    assert rotated(cache)[1] == 9
    torch.testing.assert_close(got, no_cache_logits(fast, ids)[:, 8:], atol=1e-4, rtol=1e-4)


def test_a_left_padded_batch_decodes_as_each_prompt_alone():
    model = llama("xpos")
    a, b = tokens(b=1, n=4, seed=2), tokens(b=1, n=7, seed=3)
    batch = torch.cat([torch.cat([torch.zeros(1, 3, dtype=torch.long), a], 1), b])
    mask = torch.ones_like(batch)
    mask[0, :3] = 0
    both, _ = generated(model, batch, new=6, attention_mask=mask)
    alone, _ = generated(model, a, new=6)
    assert torch.equal(both[0, 3:], alone[0])


def test_a_cache_rotated_by_another_encoding_is_refused():
    ids = tokens(b=1, n=8, seed=9)
    cache = DynamicCache()
    with torch.no_grad():
        llama("xpos")(ids, past_key_values=cache, use_cache=True)
        other = llama("rope-interleaved")
        with pytest.raises(ConfigError, match="stored rotated by xpos"):
            other(tokens(b=1, n=1), past_key_values=cache, use_cache=True)
        # the same rotation, another patch (a reloaded model) continues; the refused forward left its key in the
        # cache (transformers updates the cache before the attention), not rotated, and this step rotates it too
        again = llama("xpos")
        again(tokens(b=1, n=1), past_key_values=cache, use_cache=True)
    assert rotated(cache)[1] == 10


@pytest.mark.parametrize("name", ["xpos", "alibi"])
def test_a_decoding_step_on_a_dynamic_cache_needs_no_mask_and_a_static_one_keeps_it(name, monkeypatch):
    """One query after every cached key sees them all: no mask (as transformers' own SDPA decodes); a static
    cache's empty slots stay masked."""
    from posenc.attention import AttentionCore

    seen: list[tuple[int, bool]] = []
    attend = AttentionCore.attend

    def spy(self, call, *args, **kwargs):
        seen.append((call.q.shape[2], call.allowed is None))
        return attend(self, call, *args, **kwargs)

    monkeypatch.setattr(AttentionCore, "attend", spy)
    model = llama(name)
    prompt = tokens(b=1, n=6, seed=10)
    seq, logits = generated(model, prompt, new=3, past_key_values=DynamicCache())
    assert [unmasked for lq, unmasked in seen if lq == 1] == [True] * 4
    seen.clear()
    seq_static, logits_static = generated(model, prompt, new=3, cache_implementation="static")
    assert [unmasked for lq, unmasked in seen if lq == 1] == [False] * 4
    assert torch.equal(seq, seq_static)
    check_against_no_cache(model, seq, logits, prompt.shape[1])
    torch.testing.assert_close(logits_static, logits, atol=1e-4, rtol=1e-4)
