"""posenc.hf with what transformers users combine with a patch: per-layer RoPE settings, every attention keyword,
every cache, changing the attention afterwards, plain save / Auto classes, PEFT, dtypes, settings read from the
config, more families. Each class of failure that used to be silent has its test here; tiny random configs.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import posenc
from posenc.errors import ConfigError

transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("posenc.hf")

from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    FalconConfig,
    FalconForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
)

VOCAB = 97
DEC = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=32,
)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.logging.set_verbosity_error()
        yield


def build(cls, config):
    torch.manual_seed(0)
    return cls(config).eval()


def llama(**kw) -> LlamaForCausalLM:
    return build(LlamaForCausalLM, LlamaConfig(**{**DEC, **kw}))


def tokens(b: int = 2, n: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, VOCAB, (b, n), generator=torch.Generator().manual_seed(seed))


def greedy(model, x, n: int = 10, **kw) -> torch.Tensor:
    return model.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, **kw)


def gemma3(rope_parameters=None) -> Gemma3ForCausalLM:
    cfg = Gemma3TextConfig(
        **{**DEC, "max_position_embeddings": 128}, head_dim=16, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        **({"rope_parameters": rope_parameters} if rope_parameters else {}),
    )
    return build(Gemma3ForCausalLM, cfg)


# ------------------------------------------------------------------------------------------ per-layer RoPE settings
def test_gemma3_rope_gives_each_layer_type_its_own_theta():
    model = gemma3()
    assert model.config.rope_parameters["sliding_attention"]["rope_theta"] != (
        model.config.rope_parameters["full_attention"]["rope_theta"]
    )
    x = tokens(n=40)
    want = model(x).logits
    hf.patch(model, "rope")
    state = hf.patched(model)
    assert state.rotary_mode == "cos-sin"
    assert {t: e.base for t, e in state.by_type.items()} == {"sliding_attention": 1e4, "full_attention": 1e6}
    torch.testing.assert_close(model(x).logits, want, atol=1e-5, rtol=0)  # was 8.5e-2 off with one theta


def test_gemma3_each_layer_type_reads_its_own_scaling():
    model = gemma3(
        {
            "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        }
    )
    x = tokens(n=60)
    want = model(x).logits
    hf.patch(model, "rope-linear")
    assert {t: e.factor for t, e in hf.patched(model).by_type.items()} == {
        "sliding_attention": 2.0, "full_attention": 8.0,
    }
    torch.testing.assert_close(model(x).logits, want, atol=1e-5, rtol=0)


def test_gemma3_attention_encoding_acts_in_both_layer_types():
    model = gemma3()
    hf.patch(model, "xpos")
    assert hf.patched(model).rotary_mode == "identity" and len(hf.patched(model).cores) == 2
    prompt = tokens(b=1, n=6)
    assert torch.equal(greedy(model, prompt), greedy(model, prompt, use_cache=False))


def test_a_rotation_in_the_attention_keeps_smollm3s_layers_without_rope_without_it():
    from transformers import SmolLM3Config, SmolLM3ForCausalLM

    model = build(SmolLM3ForCausalLM, SmolLM3Config(**DEC, no_rope_layers=[1, 0], pad_token_id=0))  # layer 1: no RoPE
    torch.manual_seed(3)
    hidden = torch.randn(2, 9, 64)
    one = torch.ones(2, 9, 16)
    rope = (one, torch.zeros_like(one))
    layers = [layer.self_attn for layer in model.model.layers]
    with torch.no_grad():  # sharper attention than a fresh model's near-uniform one, so that position shows
        for attn in layers:
            attn.q_proj.weight.mul_(10)
            attn.k_proj.weight.mul_(10)
    before = [attn(hidden, position_embeddings=rope, attention_mask=None)[0] for attn in layers]
    hf.patch(model, "rope-interleaved")  # rotates inside posenc's attention
    # layer 1 is left as the model has it: in posenc's attention (the model's attention implementation is posenc's
    # now) with no encoding of its own
    assert [(c.layer, c.encoding.info.name) for c in hf.patched(model).cores] == [(0, "rope-interleaved"), (1, "nope")]
    after = [attn(hidden, position_embeddings=rope, attention_mask=None)[0] for attn in layers]
    assert (after[0] - before[0]).abs().max() > 1e-3  # rotated now
    torch.testing.assert_close(after[1], before[1], atol=1e-5, rtol=1e-5)  # still no position
    hf.patch(model, "alibi")  # not a rotation: every layer
    assert len(hf.patched(model).cores) == 2
    prompt = tokens(b=1, n=6)
    assert torch.equal(greedy(model, prompt), greedy(model, prompt, use_cache=False))


def test_layer_types_without_rope_settings_are_refused_for_a_rotary_encoding_only():
    from types import SimpleNamespace

    cfg = SimpleNamespace(
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4}, "full_attention": None},
    )
    with pytest.raises(ConfigError, match="none for full_attention"):
        hf._rope_parameters_by_type(cfg, 2)
    assert hf._rope_parameters_by_type(cfg, 2, rotary_encoding=False) == [
        ("sliding_attention", {}), ("full_attention", {}),
    ]
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": 1e4}  # one set for every layer
    assert hf._rope_parameters_by_type(cfg, 2) is None


# ------------------------------------------------------------------------------------------ attention keywords
def alibi_by_hand(attn, hidden, *, scaling: float, window: int | None = None, softcap: float | None = None):
    """One Llama-style attention layer with ALiBi, the formula written out (Press et al.), no rotation; soft-capped
    logits as Gemma 2's (``cap · tanh(x / cap)`` on the scaled q·k, before the bias and the mask)."""
    b, n, _ = hidden.shape
    h, d = attn.config.num_attention_heads, attn.head_dim
    hkv = attn.config.num_key_value_heads
    q = attn.q_proj(hidden).view(b, n, h, d).transpose(1, 2)
    k = attn.k_proj(hidden).view(b, n, hkv, d).transpose(1, 2).repeat_interleave(h // hkv, dim=1)
    v = attn.v_proj(hidden).view(b, n, hkv, d).transpose(1, 2).repeat_interleave(h // hkv, dim=1)
    slopes = torch.tensor([2 ** (-8 * (i + 1) / h) for i in range(h)])
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    scores = q @ k.transpose(-1, -2) * scaling
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores - slopes[:, None, None] * (i - j).clamp(min=0)
    hidden_keys = j > i if window is None else (j > i) | (j <= i - window)
    scores = scores.masked_fill(hidden_keys, float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, h * d)
    return attn.o_proj(out)


def gemma2(**kw) -> Gemma2ForCausalLM:
    return build(Gemma2ForCausalLM, Gemma2Config(**{**DEC, "head_dim": 16, **kw}))


def test_the_models_scaling_and_sliding_window_are_honoured():
    # query_pre_attn_scalar=4: scaling 1/2, not 1/sqrt(16); layer 0 slides over 3 keys, layer 1 sees all
    model = gemma2(attn_logit_softcapping=None, query_pre_attn_scalar=4, sliding_window=3)
    hf.patch(model, "alibi")
    torch.manual_seed(3)
    hidden = torch.randn(2, 9, 64)
    one = torch.ones(2, 9, 16)
    for layer, window in ((0, 3), (1, None)):
        attn = model.model.layers[layer].self_attn
        assert attn.sliding_window == window
        got, _ = attn(hidden, position_embeddings=(one, torch.zeros_like(one)), attention_mask=None)
        torch.testing.assert_close(got, alibi_by_hand(attn, hidden, scaling=0.5, window=window), atol=1e-5, rtol=1e-5)


def test_softcap_is_honoured_as_gemma2s_eager_attention_does():
    model = gemma2(attn_logit_softcapping=0.5, query_pre_attn_scalar=4, sliding_window=3)  # a cap that bites
    x = tokens()
    want = model(x).logits
    hf.patch(model, "rope")  # through the rotary module: the model's own attention and its soft-capping
    torch.testing.assert_close(model(x).logits, want, atol=1e-5, rtol=0)
    hf.patch(model, "alibi")
    torch.manual_seed(3)
    hidden = torch.randn(2, 9, 64) * 5
    one = torch.ones(2, 9, 16)
    for layer, window in ((0, 3), (1, None)):
        attn = model.model.layers[layer].self_attn
        got, _ = attn(hidden, position_embeddings=(one, torch.zeros_like(one)), attention_mask=None)
        want = alibi_by_hand(attn, hidden, scaling=0.5, window=window, softcap=0.5)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert (got - alibi_by_hand(attn, hidden, scaling=0.5, window=window)).abs().max() > 1e-3  # it bites
    prompt = tokens(b=1, n=6)
    assert torch.equal(greedy(model, prompt), greedy(model, prompt, use_cache=False))


def test_attention_sinks_are_honoured_as_gpt_oss_eager_attention_does():
    cfg = GptOssConfig(**{**DEC, "intermediate_size": 64}, head_dim=16, num_local_experts=4, num_experts_per_tok=2)
    model = build(GptOssForCausalLM, cfg)
    hf.patch(model, "alibi")
    attn = model.model.layers[1].self_attn  # a full-attention layer
    with torch.no_grad():
        attn.sinks.copy_(torch.tensor([2.0, -1.0, 0.5, 3.0]))
    torch.manual_seed(3)
    hidden = torch.randn(2, 9, 64)
    one = torch.ones(2, 9, 8)
    got, _ = attn(hidden, position_embeddings=(one, torch.zeros_like(one)), attention_mask=None)
    # the formula: one more logit per head in the softmax (its probability dropped), ALiBi's bias, causal mask
    b, n, h, d = 2, 9, 4, 16
    q = attn.q_proj(hidden).view(b, n, h, d).transpose(1, 2)
    k = attn.k_proj(hidden).view(b, n, 2, d).transpose(1, 2).repeat_interleave(2, dim=1)
    v = attn.v_proj(hidden).view(b, n, 2, d).transpose(1, 2).repeat_interleave(2, dim=1)
    slopes = torch.tensor([2 ** (-8 * (i + 1) / h) for i in range(h)])
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    scores = (q @ k.transpose(-1, -2)) * attn.scaling - slopes[:, None, None] * (i - j).clamp(min=0)
    scores = scores.masked_fill(j > i, float("-inf"))
    sink = attn.sinks.reshape(1, h, 1, 1).expand(b, h, n, 1)
    probs = torch.cat([scores, sink], -1).softmax(-1)[..., :-1]
    want = attn.o_proj((probs @ v).transpose(1, 2).reshape(b, n, h * d))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    prompt = tokens(b=1, n=6)
    assert torch.equal(greedy(model, prompt), greedy(model, prompt, use_cache=False))


def test_an_unknown_attention_keyword_is_refused_naming_it():
    model = llama()
    hf.patch(model, "alibi")
    attn = model.model.layers[0].self_attn
    q = torch.randn(1, 4, 3, 16)
    with pytest.raises(ConfigError, match="frobnicate="):
        hf.posenc_attention(attn, q, q, q, None, scaling=0.25, frobnicate=torch.ones(1))


def test_is_causal_from_the_call_overrides_the_module():
    model = llama()
    hf.patch(model, "alibi")
    attn = model.model.layers[0].self_attn
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 5, 16) for _ in range(3))
    causal, _ = hf.posenc_attention(attn, q, k, v, None, scaling=0.25)
    both, _ = hf.posenc_attention(attn, q, k, v, None, scaling=0.25, is_causal=False)
    # the last query sees every key either way; the first sees only itself when causal
    torch.testing.assert_close(causal[:, -1], both[:, -1], atol=1e-6, rtol=0)
    torch.testing.assert_close(causal[0, 0], v[0, :, 0], atol=1e-6, rtol=0)
    assert (both[:, 0] - causal[:, 0]).abs().max() > 1e-3


def test_attention_dropout_is_applied_while_training_only():
    model = llama(attention_dropout=0.5)
    hf.patch(model, "t5")
    x = tokens()
    with torch.no_grad():
        model.train()
        torch.manual_seed(1)
        a = model(x).logits
        torch.manual_seed(2)
        b = model(x).logits
        model.eval()
        c, d = model(x).logits, model(x).logits
    assert (a - b).abs().max() > 1e-3  # dropout on the probabilities
    torch.testing.assert_close(c, d, atol=0, rtol=0)


@pytest.mark.parametrize("name", ["t5", "fire", "shaw", "xpos"])
def test_gradient_checkpointing_gives_the_gradients_of_a_plain_backward(name):
    plain, ckpt = llama().train(), llama().train()
    hf.patch(plain, name)
    hf.patch(ckpt, name)
    ckpt.load_state_dict(plain.state_dict())
    ckpt.gradient_checkpointing_enable()  # crashed: the recomputed layer found the other layers' memo
    x = tokens()
    plain(x, labels=x).loss.backward()
    ckpt(x, labels=x).loss.backward()
    for (n, p), q in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-6, rtol=1e-5, msg=n)


# ------------------------------------------------------------------------------------------ caches
def mistral_sliding() -> MistralForCausalLM:
    return build(MistralForCausalLM, MistralConfig(**{**DEC, "max_position_embeddings": 64}, sliding_window=4))


@pytest.mark.parametrize("cache", ["dynamic", "static", "sliding_window", "hybrid"])
@pytest.mark.parametrize("name", ["alibi", "t5", "xpos", "shaw"])
@pytest.mark.parametrize("make", [llama, mistral_sliding], ids=["llama", "mistral-window-4"])
def test_every_cache_gives_the_tokens_of_no_cache(make, name, cache):
    model = make()
    hf.patch(model, name)
    prompt = tokens(b=1, n=6)
    assert torch.equal(greedy(model, prompt, cache_implementation=cache), greedy(model, prompt, use_cache=False))


@pytest.mark.parametrize(
    ("name", "grouped"),
    [("alibi", True), ("t5", True), ("kerple-log", True), ("fire", True), ("dynamic-bias", True), ("xpos", True),
     ("rope-interleaved", True), ("shaw", True), ("nezha", True), ("relative-key-query", True),
     ("transformer-xl", True), ("xlnet", True), ("cope", False)],
)
def test_a_decoding_step_keeps_grouped_keys_and_equals_them_repeated(name, grouped, monkeypatch):
    """One query on grouped keys (4 query heads, 2 key heads) with an encoding acting by a bias or a rotation alone
    (rotated before the kernel, in posenc's attention function: xPos, interleaved RoPE), or by offset tables (the
    native decode kernel reads key head h // group): the keys are not repeated (the plan says so), and the logits
    equal those of the same step with the keys repeated first. CoPE, whose gates read q·kᵀ through the
    materialised kernel, gets them repeated."""
    from transformers import DynamicCache

    from posenc.attention import AttentionCore

    model = llama()
    hf.patch(model, name)
    x = tokens(b=2, n=9, seed=4)
    attention_mask = torch.ones(2, 9, dtype=torch.long)
    attention_mask[1, :2] = 0  # left padding in the second row: the mask goes through the folded path too

    def step():
        cache = DynamicCache()
        with torch.no_grad():
            model(x[:, :8], attention_mask=attention_mask[:, :8], past_key_values=cache, use_cache=True)
            return model(x[:, 8:], attention_mask=attention_mask, past_key_values=cache, use_cache=True).logits

    got = step()
    plans = [core.last_plan for core in hf.patched(model).cores]
    assert plans and all(p is not None and p.grouped == grouped for p in plans), [str(p) for p in plans]
    monkeypatch.setattr(AttentionCore, "_keeps_groups", lambda self, call, weights: False)
    want = step()
    assert not any(core.last_plan.grouped for core in hf.patched(model).cores)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["shaw", "relative-key-query"])
def test_a_grouped_decoding_step_the_native_kernel_declines_repeats_the_keys(name, monkeypatch):
    """Where the decode kernel declines at run time (it returns None), the step runs the blocked kernel on the keys
    repeated per query head, with the same logits."""
    from transformers import DynamicCache

    from posenc import native

    model = llama()
    hf.patch(model, name)
    x = tokens(b=2, n=9, seed=5)

    def step():
        cache = DynamicCache()
        with torch.no_grad():
            model(x[:, :8], past_key_values=cache, use_cache=True)
            return model(x[:, 8:], past_key_values=cache, use_cache=True).logits

    want = step()
    assert all(core.last_plan.kernel == "decode" and core.last_plan.grouped for core in hf.patched(model).cores)
    calls = []

    def declines(*args, **kwargs):
        calls.append(args[1].shape)
        return None

    monkeypatch.setattr(native, "decode_attention", declines)
    got = step()
    assert calls and all(shape[1] == 2 for shape in calls)  # offered the grouped keys, then declined
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_decoding_step_that_asks_for_the_weights_repeats_grouped_keys():
    """output_attentions=True needs one weight row per query head: the keys are repeated, the weights are [B, H, 1,
    Lk] and sum to one, and the logits are those of the grouped step."""
    from transformers import DynamicCache

    model = llama()
    hf.patch(model, "alibi")
    x = tokens(b=1, n=7, seed=6)

    def step(**kw):
        cache = DynamicCache()
        with torch.no_grad():
            model(x[:, :6], past_key_values=cache, use_cache=True)
            return model(x[:, 6:], past_key_values=cache, use_cache=True, **kw)

    grouped = step().logits
    out = step(output_attentions=True)
    assert not any(core.last_plan.grouped for core in hf.patched(model).cores)
    weights = out.attentions[0]
    assert weights.shape == (1, 4, 1, 7)
    torch.testing.assert_close(weights.sum(-1), torch.ones(1, 4, 1))
    torch.testing.assert_close(out.logits, grouped, atol=1e-5, rtol=1e-5)


def test_grouped_keys_that_do_not_divide_the_heads_are_refused():
    from posenc.attention import check_groups

    assert check_groups(9, 3) == 3
    with pytest.raises(ConfigError, match="multiple of the key/value heads"):
        check_groups(9, 2)


def test_beam_search_with_the_cache_gives_the_beams_without_it():
    model = llama()
    hf.patch(model, "alibi")
    prompt = tokens(b=1, n=5)
    assert torch.equal(greedy(model, prompt, 6, num_beams=3), greedy(model, prompt, 6, num_beams=3, use_cache=False))


def test_static_cache_with_left_padding_matches_each_prompt_alone():
    model = llama()
    hf.patch(model, "alibi")
    a, b = tokens(b=1, n=4, seed=2), tokens(b=1, n=7, seed=3)
    batch = torch.cat([torch.cat([torch.zeros(1, 3, dtype=torch.long), a], 1), b])
    mask = torch.ones_like(batch)
    mask[0, :3] = 0
    both = greedy(model, batch, 6, attention_mask=mask, cache_implementation="static")
    assert torch.equal(both[0, 3:], greedy(model, a, 6)[0])
    assert torch.equal(both[1], greedy(model, b, 6)[0])


def test_the_quantized_cache_puts_keys_where_the_dynamic_cache_does():
    from posenc.hf import matrix as hf_matrix

    hf_matrix.quantized_cache(lambda: LlamaForCausalLM(LlamaConfig(**DEC)))  # asserts inside


def test_offloaded_caches_where_transformers_runs_them():
    if not torch.cuda.is_available():
        pytest.skip("transformers' offloaded caches move layers to and from a CUDA device")
    model = llama().cuda()
    hf.patch(model, "alibi")
    prompt = tokens(b=1, n=6).cuda()
    for cache in ("offloaded", "offloaded_static"):
        assert torch.equal(greedy(model, prompt, cache_implementation=cache), greedy(model, prompt, use_cache=False))


# ------------------------------------------------------------------------------------------ changing the attention
def test_set_attn_implementation_after_an_attention_patch_is_refused():
    model = llama()
    hf.patch(model, "alibi")
    with pytest.raises(ConfigError, match=r"set_attn_implementation\('eager'\) would drop the encoding"):
        model.set_attn_implementation("eager")
    assert model.config._attn_implementation == "posenc"
    model.config._attn_implementation = "sdpa"  # behind posenc's back: the next forward says so
    with pytest.raises(ConfigError, match=r"now 'sdpa' \(changed after patching\)"):
        model(tokens())
    hf.patch(model, "alibi")  # patching again mends it
    model(tokens())
    hf.unpatch(model)
    model.set_attn_implementation("eager")  # the model's own again: free to change
    assert model.config._attn_implementation == "eager"


def test_set_attn_implementation_keeps_a_rotary_patch():
    model = llama()
    hf.patch(model, "rope-yarn", factor=4.0)
    x = tokens(n=80)
    want = model(x).logits
    model.set_attn_implementation("eager")  # HF's attention applies the cos/sin: the encoding stays
    torch.testing.assert_close(model(x).logits, want, atol=1e-5, rtol=0)
    assert hf.patched(model).name == "rope-yarn"


# ------------------------------------------------------------------------------------------ save / Auto classes
@pytest.mark.parametrize("name", ["t5", "fire", "shaw"])
def test_plain_save_pretrained_and_the_auto_classes_restore_the_patch(tmp_path, name):
    model = llama()
    hf.patch(model, name)
    with torch.no_grad():
        for p in hf.patched(model).parameters():
            p.add_(torch.randn_like(p) * 0.1)
    x = tokens()
    want = model(x).logits
    model.save_pretrained(tmp_path)  # raised "shared tensors" for t5 / fire
    saved = json.loads((tmp_path / "config.json").read_text())["posenc"]
    assert saved["encoding"] == name and saved["version"] == posenc.__version__
    back = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert hf.patched(back).name == name
    torch.testing.assert_close(back(x).logits, want, atol=0, rtol=0)
    fresh = AutoModelForCausalLM.from_config(model.config)  # was silently the unpatched model
    assert hf.patched(fresh).name == name


def test_unpatch_removes_the_record_from_the_config():
    model = llama()
    hf.patch(model, "alibi")
    assert model.config.posenc["encoding"] == "alibi"
    hf.unpatch(model)
    assert not hasattr(model.config, "posenc")
    assert hf.patched(AutoModelForCausalLM.from_config(model.config)) is None


def test_a_record_that_cannot_be_restored_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    model = llama()
    hf.patch(model, "t5")
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    save_file({k: v for k, v in weights.items() if "posenc" not in k}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"records a t5 patch but lacks its parameters"):
        AutoModelForCausalLM.from_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["posenc"] = {"encoding": "t5", "unsaveable": "its options cannot be written as JSON"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="could not be recorded"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_posenc_from_pretrained_with_a_damaged_spec_or_missing_weights_says_so(tmp_path):
    model = llama()
    hf.patch(model, "t5")
    hf.save_pretrained(model, tmp_path)
    spec = tmp_path / hf.SPEC_FILE
    good = spec.read_text()
    spec.write_text(good[: len(good) // 2])  # cut short
    with pytest.raises(ConfigError, match=r"posenc.json is damaged"):
        hf.from_pretrained(LlamaForCausalLM, tmp_path)
    spec.write_text('["t5"]')
    with pytest.raises(ConfigError, match=r"damaged .*'encoding'"):
        hf.from_pretrained(LlamaForCausalLM, tmp_path)
    spec.write_text(good)
    (tmp_path / hf.WEIGHTS_FILE).write_bytes(b"not a torch file")
    with pytest.raises(ConfigError, match="cannot be read as the encoding's parameters"):
        hf.from_pretrained(LlamaForCausalLM, tmp_path)
    (tmp_path / hf.WEIGHTS_FILE).unlink()
    with pytest.raises(ConfigError, match=r"has posenc.json but not posenc_encoding.pt"):
        hf.from_pretrained(LlamaForCausalLM, tmp_path)
    spec.unlink()
    with pytest.raises(ConfigError, match="records no posenc patch"):
        hf.from_pretrained(LlamaForCausalLM, tmp_path)


def test_encoding_weights_saved_in_the_earlier_layout_still_load(tmp_path):
    model = llama()
    hf.patch(model, "t5")
    with torch.no_grad():
        for p in hf.patched(model).parameters():
            p.normal_()
    x = tokens()
    want = model(x).logits
    hf.save_pretrained(model, tmp_path)
    # before the encodings were held once: encoding.* and cores.<layer>.encoding.* (the same tensors again)
    weights = torch.load(tmp_path / hf.WEIGHTS_FILE, weights_only=True)
    old = {}
    for k, v in weights.items():
        rest = k.split(".", 2)[2]
        old[f"encoding.{rest}"] = v
        old.update({f"cores.{i}.encoding.{rest}": v for i in range(2)})
    torch.save(old, tmp_path / hf.WEIGHTS_FILE)
    back = hf.from_pretrained(LlamaForCausalLM, tmp_path)
    torch.testing.assert_close(back.eval()(x).logits, want, atol=0, rtol=0)


# ------------------------------------------------------------------------------------------ PEFT
def test_peft_wrapped_model_keeps_the_patch_and_says_when_it_froze_the_encoding():
    peft = pytest.importorskip("peft")
    model = llama()
    hf.patch(model, "t5")
    x = tokens()
    want = model(x).logits
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    assert hf.patched(wrapped) is hf.patched(model)
    torch.testing.assert_close(wrapped(x).logits, want, atol=1e-6, rtol=0)
    assert not any(p.requires_grad for p in hf.patched(wrapped).parameters())  # PEFT froze them
    wrapped.train()
    with pytest.warns(UserWarning, match="frozen"):
        wrapped(x).logits.sum().backward()
    for p in hf.patched(wrapped).parameters():
        p.requires_grad_(True)
    wrapped(x).logits.sum().backward()
    assert all(p.grad is not None for p in hf.patched(wrapped).parameters())
    hf.unpatch(wrapped)
    assert hf.patched(wrapped) is None and hf.patched(model) is None


def test_patching_a_peft_wrapped_model_trains_the_encoding_with_the_adapters():
    peft = pytest.importorskip("peft")
    wrapped = peft.get_peft_model(llama(), peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    hf.patch(wrapped, "fire")
    wrapped.train()
    x = tokens()
    wrapped(x, labels=x).loss.backward()
    params = list(hf.patched(wrapped).parameters())
    assert params and all(p.requires_grad and p.grad is not None for p in params)


def test_peft_modules_to_save_on_the_patch_is_refused_and_merge_and_unload_keeps_it(tmp_path):
    peft = pytest.importorskip("peft")
    model = llama()
    hf.patch(model, "t5")
    lora = peft.LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["posenc"])
    with pytest.raises(ConfigError, match=r"posenc was replaced .*modules_to_save"):
        peft.get_peft_model(model, lora)(tokens())  # PEFT's copy would train nothing the hooks use
    model = llama()
    hf.patch(model, "t5")
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    x = tokens()
    want = wrapped(x).logits
    merged = wrapped.merge_and_unload()
    merged.save_pretrained(tmp_path)
    back = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert hf.patched(back).name == "t5"
    torch.testing.assert_close(back(x).logits, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["t5", "rope-yarn", "sinusoidal"])
def test_a_deep_copy_of_a_patched_model_is_patched_with_its_own_encoding(name):
    import copy

    model = llama()
    hf.patch(model, name, **({"factor": 2.0} if name == "rope-yarn" else {}))
    x = tokens(n=40)
    want = model(x).logits
    twin = copy.deepcopy(model)  # TRL's reference model, an EMA copy ...
    torch.testing.assert_close(twin(x).logits, want, atol=0, rtol=0)
    assert hf.patched(twin) is not hf.patched(model)
    torch.manual_seed(1)
    with torch.no_grad():  # the copy's encoding is its own
        for p in hf.patched(twin).parameters():
            p.add_(torch.randn_like(p))
    if list(hf.patched(twin).parameters()):
        assert (twin(x).logits - want).abs().max() > 1e-4
    torch.testing.assert_close(model(x).logits, want, atol=0, rtol=0)
    hf.unpatch(twin)  # takes the copy's hooks off, not the original's
    assert hf.patched(twin) is None and hf.patched(model) is not None
    torch.testing.assert_close(model(x).logits, want, atol=0, rtol=0)
    assert (twin(x).logits - want).abs().max() > 1e-4  # the copy is the plain model again
    if name == "t5":
        with pytest.raises(ConfigError, match="would drop the encoding"):
            copy.deepcopy(model).set_attn_implementation("eager")  # the copy's own guard
        assert model.config._attn_implementation == "posenc"


def test_torch_save_of_a_whole_patched_model_loads_patched():
    import io

    model = llama()
    hf.patch(model, "t5")
    x = tokens()
    want = model(x).logits
    buffer = io.BytesIO()
    torch.save(model, buffer)  # pickles the hooks too: they failed as local closures
    buffer.seek(0)
    back = torch.load(buffer, weights_only=False)
    assert hf.patched(back) is not None and hf.patched(back) is not hf.patched(model)
    torch.testing.assert_close(back(x).logits, want, atol=0, rtol=0)


# ------------------------------------------------------------------------------------------ dtypes
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("name", [n for n in posenc.available() if n != "tener"])
def test_every_encoding_runs_in_every_dtype_or_is_refused_when_patching(name, dtype):
    from posenc.registry import example_options

    options = example_options(name, {"d_model": 64, "n_heads": 4, "head_dim": 16, "max_len": 32})
    ref = llama(num_key_value_heads=4)
    hf.patch(ref, name, **options)
    model = llama(num_key_value_heads=4).to(dtype)
    # deberta and contextual-2 project their float32 tables with the model's own half-precision q_proj / k_proj
    # at the tables' dtype (they were refused in half precision before; tests/test_hf_cast.py casts after patching)
    hf.patch(model, name, **options)
    hf.patched(model).load_state_dict(hf.patched(ref).state_dict())
    x = tokens(n=10)
    with torch.no_grad():
        got, want = model(x).logits, ref(x).logits
    assert got.dtype == dtype and torch.isfinite(got).all()
    if hf.patched(ref).encoding.cache_problem(10, 10) is None and "random" not in name:
        tol = 1e-4 if dtype == torch.float64 else 0.05 * float(want.abs().max()) + 0.05
        assert (got.double() - want.double()).abs().max() <= tol


def test_casting_a_patched_model_afterwards_keeps_it_working():
    model = llama()
    hf.patch(model, "complex-order")
    x = tokens()
    want = model(x).logits
    model.to(torch.float64)
    torch.testing.assert_close(model(x).logits, want.double(), atol=1e-4, rtol=1e-4)
    model.to(torch.bfloat16)
    assert torch.isfinite(model(x).logits).all()
    assert all(t.dtype == torch.float32 for t in hf.patched(model).parameters())  # float32 in a half model


# ------------------------------------------------------------------------------------------ settings from the config
CONFIGS = {
    "rope-yarn": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 16.0,
        "beta_slow": 2.0, "mscale": 1.0, "mscale_all_dim": 0.5,
    },
    "rope-llama3": {
        "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
        "original_max_position_embeddings": 32,
    },
    # extended max_position_embeddings (128), trained length 32, no factor: HF derives factor = 4
    "rope-longrope": {
        "rope_type": "longrope", "original_max_position_embeddings": 32,
        "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [1.0 + 0.5 * i for i in range(8)],
    },
    "rope-linear": {"rope_type": "linear", "factor": 3.0},
    "rope-dynamic": {"rope_type": "dynamic", "factor": 2.0},
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_scaling_with_no_options_takes_every_field_from_the_config(name):
    model = llama(max_position_embeddings=128, rope_parameters={"rope_theta": 10000.0, **CONFIGS[name]})
    x = tokens(n=160)  # beyond the trained 32 and the extended 128 (where dynamic scaling starts)
    want = model(x).logits
    hf.patch(model, name)  # no options: all from rope_parameters, as HF reads them
    torch.testing.assert_close(model(x).logits, want, atol=1e-5, rtol=0)


def test_options_passed_win_over_the_config():
    model = llama(max_position_embeddings=128, rope_parameters={"rope_theta": 10000.0, **CONFIGS["rope-yarn"]})
    hf.patch(model, "rope-yarn", factor=2.0)
    assert hf.patched(model).encoding.factor == 2.0
    hf.patch(model, "rope-yarn")
    assert hf.patched(model).encoding.factor == 4.0 and hf.patched(model).encoding.original_max_len == 32
    model = llama(max_position_embeddings=128, rope_parameters={"rope_theta": 10000.0, **CONFIGS["rope-longrope"]})
    hf.patch(model, "rope-longrope")
    assert hf.patched(model).encoding.factor == 4.0  # 128 / 32, as transformers derives it


# ------------------------------------------------------------------------------------------ families
def test_falcon_with_its_own_alibi_is_refused_and_attention_encodings_say_why():
    cfg = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=64)
    with pytest.raises(ConfigError, match=r"config.alibi=True.*alibi=False"):
        hf.patch(build(FalconForCausalLM, FalconConfig(**cfg, alibi=True)), "rope")
    model = build(FalconForCausalLM, FalconConfig(**cfg, alibi=False))
    with pytest.raises(ConfigError, match=r"calls torch's SDPA itself"):
        hf.patch(model, "t5")
    x = tokens()
    want = model(x).logits
    hf.patch(model, "rope")
    torch.testing.assert_close(model(x).logits, want, atol=1e-5, rtol=0)


def test_the_unsupported_model_error_lists_every_family():
    with pytest.raises(ConfigError) as err:
        hf.patch(torch.nn.Linear(2, 2), "alibi")
    for family in hf.SUPPORTED:
        assert f"  {family.name}: " in str(err.value)
    assert len({f.name for f in hf.SUPPORTED}) == len(hf.SUPPORTED)



def test_the_encoding_follows_the_models_train_and_eval_mode():
    """An encoding patched into a model in eval mode is in eval mode (its no-grad decoding caches, such as
    Transformer-XL's projected table, key on it: a patched eval model re-projected its whole table every step, 9x the
    unpatched step on SmolLM2), and model.train() / model.eval() after the patch reach it at the next call."""
    model = llama().eval()
    hf.patch(model, "transformer-xl")
    encodings = [core.encoding for core in hf.patched(model).cores]
    assert encodings and not any(e.training for e in encodings)
    x = tokens(b=1, n=6, seed=7)
    model.train()
    model(x)
    assert all(e.training for e in encodings)
    model.eval()
    with torch.no_grad():
        model(x)
    assert not any(e.training for e in encodings)
