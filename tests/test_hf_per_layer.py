"""posenc.hf per layer and per layer type: each 2025 family's own scheme reproduced by ``patch(model, "rope")``
(Gemma 3 with its per-type scaling, SmolLM3, Llama 4 text, Cohere2, OLMo 3, ModernBERT), encodings by layer type,
on some layers, and as a schedule, each acting only where asked (checked against the model's own config changed to
that scheme where transformers can express it), bad input, and generate with caches.

Tiny random configs (four layers, q/k weights sharpened so that position shows in the logits), no downloads.
"""

from __future__ import annotations

import pytest
import torch

import posenc
from posenc.errors import ConfigError, UnknownNameError

transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("posenc.hf")

import transformers as t  # noqa: E402

from posenc.hf import matrix_checks  # noqa: E402
from posenc.hf.matrix_checks import GEMMA3_4B_ROPE, LLAMA4, OLMO3_ROPE  # noqa: E402

VOCAB = 97
DEC = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64,
)


pytestmark = pytest.mark.usefixtures("quiet_transformers")


def sharp(model, by: float = 6.0):
    """The model in eval mode with its query/key projections × ``by``: a fresh model's attention is near uniform,
    and a wrong rotation would barely move its logits."""
    with torch.no_grad():
        for m in model.modules():
            for name in ("q_proj", "k_proj", "Wqkv"):
                lin = getattr(m, name, None)
                if isinstance(lin, torch.nn.Linear):
                    lin.weight.mul_(by)
    return model.eval()


def build(cls, config):
    torch.manual_seed(0)
    return sharp(cls(config))


FAMILIES = {
    "gemma3": lambda: build(
        t.Gemma3ForCausalLM,
        t.Gemma3TextConfig(
            **DEC, head_dim=16, sliding_window=4, layer_types=["sliding_attention"] * 3 + ["full_attention"],
            rope_parameters=GEMMA3_4B_ROPE,
        ),
    ),
    "smollm3": lambda: build(t.SmolLM3ForCausalLM, t.SmolLM3Config(**DEC, pad_token_id=0)),
    "llama4": lambda: build(t.Llama4ForCausalLM, t.Llama4TextConfig(**LLAMA4, pad_token_id=0)),
    "cohere2": lambda: build(t.Cohere2ForCausalLM, t.Cohere2Config(**DEC, sliding_window=4, pad_token_id=0)),
    "olmo3": lambda: build(t.Olmo3ForCausalLM, t.Olmo3Config(**DEC, sliding_window=4, rope_parameters=OLMO3_ROPE)),
    "modernbert": lambda: build(
        t.ModernBertModel,
        t.ModernBertConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            max_position_embeddings=64, local_attention=4, global_attn_every_n_layers=3, pad_token_id=0,
        ),
    ),
}


def tokens(b: int = 2, n: int = 40, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, VOCAB, (b, n), generator=torch.Generator().manual_seed(seed))


def out(model, x=None, **kw) -> torch.Tensor:
    got = model(tokens() if x is None else x, **kw)
    return got.logits if hasattr(got, "logits") else got.last_hidden_state


def gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


def llama(n_layers: int = 4, theta: float = 10000.0):
    return build(t.LlamaForCausalLM, t.LlamaConfig(**{**DEC, "num_hidden_layers": n_layers}, rope_theta=theta))


def twin(cls, config, weights_of):
    """A model of ``cls`` / ``config`` with the weights of ``weights_of`` (the same architecture, another scheme)."""
    model = cls(config).eval()
    model.load_state_dict(weights_of.state_dict())
    return model


# ------------------------------------------------------------------------------------------ each family's own scheme
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.float64, 1e-12)], ids=["fp32", "fp64"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_rope_alone_reproduces_each_familys_own_scheme(family, dtype, tol):
    model = FAMILIES[family]().to(dtype)
    x = tokens()
    want = out(model, x)
    hf.patch(model, "rope")
    assert gap(out(model, x), want) <= tol
    hf.unpatch(model)
    assert gap(out(model, x), want) == 0.0


@pytest.mark.parametrize("family", ["gemma3", "llama4", "cohere2", "olmo3", "modernbert"])
def test_the_check_is_not_blind_one_encoding_for_every_layer_is_not_the_own_scheme(family):
    """What a uniform patch gives differs visibly from the model's own per-layer scheme (the test above can fail)."""
    model = FAMILIES[family]()
    x = tokens()
    want = out(model, x)
    hf.patch(model, "rope", base=3000.0)  # plain RoPE at one θ (none of theirs) on every layer that has RoPE
    assert gap(out(model, x), want) > 1e-3


def test_gemma3_as_released_reads_each_layer_types_scaling():
    model = FAMILIES["gemma3"]()
    hf.patch(model, "rope")
    state = hf.patched(model)
    local, glob = state.by_type["sliding_attention"], state.by_type["full_attention"]
    assert (type(local).__name__, local.base) == ("RoPE", 1e4)
    assert (local.info.name, glob.info.name, glob.base, glob.factor) == ("rope", "rope-linear", 1e6, 8.0)
    assert state.rotary_mode == "cos-sin" and not state.cores  # HF's own attention, its own rotation


def test_gemma3_the_two_uniform_readings_are_each_off():
    """The issue's two readings: "rope" dropping the global scaling, "rope-linear" ×8 scaling the local layers too."""
    model = FAMILIES["gemma3"]()
    x = tokens()
    want = out(model, x)
    hf.patch(model, "rope", base=1e6)
    assert gap(out(model, x), want) > 1e-2
    hf.patch(model, "rope-linear", factor=8, theta=1e6)
    assert gap(out(model, x), want) > 1e-2


def test_llama4_keeps_its_nope_layers_and_their_temperature():
    model = FAMILIES["llama4"]()
    hf.patch(model, "rope")
    state = hf.patched(model)
    assert [e is None for e in state.layer_encodings] == [False, False, False, True]
    assert state.layer_encodings[0].interleaved  # Llama 4 rotates the pairs (2i, 2i+1), as complex numbers
    assert model.model.layers[3].self_attn.attn_temperature_tuning  # its own temperature stays on
    assert not state.cores


# ------------------------------------------------------------------------------------------ by layer type
def test_by_layer_type_gives_gemma3s_own_scheme_with_theta_named_as_transformers_names_it():
    model = FAMILIES["gemma3"]()
    x = tokens()
    want = out(model, x)
    hf.patch(model, {"sliding_attention": "rope", "full_attention": ("rope-linear", {"factor": 8, "theta": 1e6})})
    assert gap(out(model, x), want) <= 1e-6
    assert hf.patched(model).name == "rope*3+rope-linear(base=1000000.0,factor=8)"


def test_by_layer_type_acts_only_on_that_type_as_the_config_changed_to_it():
    """{"sliding_attention": rope θ 5e4}: the sliding layers move, the global ones keep their own scaling -- the
    logits of a Gemma 3 configured so."""
    model = FAMILIES["gemma3"]()
    theirs = twin(
        t.Gemma3ForCausalLM,
        t.Gemma3TextConfig(
            **DEC, head_dim=16, sliding_window=4, layer_types=["sliding_attention"] * 3 + ["full_attention"],
            rope_parameters={**GEMMA3_4B_ROPE, "sliding_attention": {"rope_type": "default", "rope_theta": 5e4}},
        ),
        model,
    )
    x = tokens()
    assert gap(out(model, x), out(theirs, x)) > 1e-3
    hf.patch(model, {"sliding_attention": ("rope", {"base": 5e4})})
    state = hf.patched(model)
    assert [e is None for e in state.layer_encodings] == [False, False, False, True]  # the global layer: its own
    assert gap(out(model, x), out(theirs, x)) <= 1e-6


def test_olmo3_yarn_on_its_full_layers_by_type():
    model = FAMILIES["olmo3"]()
    x = tokens()
    want = out(model, x)
    hf.patch(model, {"full_attention": ("rope-yarn", {"factor": 4.0, "original_max_len": 16, "theta": 5e5})})
    assert gap(out(model, x), want) <= 1e-6
    hf.patch(model, {"full_attention": ("rope", {"theta": 5e5})})  # YaRN dropped on the full layers only
    theirs = twin(
        t.Olmo3ForCausalLM,
        t.Olmo3Config(
            **DEC, sliding_window=4,
            rope_parameters={**OLMO3_ROPE, "full_attention": {"rope_type": "default", "rope_theta": 5e5}},
        ),
        model,
    )
    assert gap(out(model, x), want) > 1e-3
    assert gap(out(model, x), out(theirs, x)) <= 1e-6


# ------------------------------------------------------------------------------------------ some layers
def test_nope_on_some_layers_of_a_llama_is_smollm3_with_those_layers_without_rope():
    model = llama(theta=2e6)
    theirs = twin(
        t.SmolLM3ForCausalLM,
        t.SmolLM3Config(**DEC, rope_theta=2e6, no_rope_layers=[1, 0, 1, 0], pad_token_id=0, tie_word_embeddings=False),
        model,
    )
    x = tokens()
    assert gap(out(model, x), out(theirs, x)) > 1e-3
    hf.patch(model, "nope", layers=[1, 3])
    state = hf.patched(model)
    assert [e.info.name if e else None for e in state.layer_encodings] == [None, "nope", None, "nope"]
    assert state.phase_layers == [1, 3] and not state.cores  # identity phases on those layers alone
    assert gap(out(model, x), out(theirs, x)) <= 1e-6
    assert state.name == "nope" and state.options == {"layers": [1, 3]}


def test_rope_on_smollm3s_nope_layer_is_a_llama():
    model = FAMILIES["smollm3"]()
    theirs = twin(t.LlamaForCausalLM, t.LlamaConfig(**DEC, rope_theta=2e6, tie_word_embeddings=True), model)
    x = tokens()
    assert gap(out(model, x), out(theirs, x)) > 1e-3
    hf.patch(model, "rope", layers=[3])  # the model does not rotate layer 3: posenc's attention does
    state = hf.patched(model)
    assert [c.layer for c in state.cores if c.encoding.info.name == "rope"] == [3]
    assert gap(out(model, x), out(theirs, x)) <= 1e-5


def test_a_schedule_is_smollm3s_scheme_on_a_llama():
    model = llama(theta=2e6)
    theirs = twin(
        t.SmolLM3ForCausalLM, t.SmolLM3Config(**DEC, rope_theta=2e6, pad_token_id=0, tie_word_embeddings=False), model
    )
    x = tokens()
    for given in ("rope*3+nope", posenc.schedule("rope", "rope", "rope", "nope"), ["rope", "rope", "rope", "nope"]):
        hf.patch(model, given)
        assert gap(out(model, x), out(theirs, x)) <= 1e-6, given
        assert hf.patched(model).name == "rope*3+nope"


def test_layers_left_alone_keep_the_patch_they_have():
    """patch(model, X, layers=...) on a patched model: the other layers keep their encoding -- the same module, its
    trained parameters included -- and the result is the per-layer patch made in one go."""
    model = llama()
    hf.patch(model, "t5")
    state = hf.patched(model)
    with torch.no_grad():
        for p in state.parameters():
            p.add_(torch.randn_like(p))  # "trained"
    t5 = [c.encoding for c in state.cores]
    hf.patch(model, "alibi", layers=[0])
    state = hf.patched(model)
    assert [c.encoding.info.name for c in state.cores] == ["alibi", "t5", "t5", "t5"]
    assert all(a is b for a, b in zip(state.layer_encodings[1:], t5[1:], strict=True))
    assert (state.name, state.options) == ("alibi+t5*3", {})
    x = tokens()
    got = out(model, x)
    fresh = llama()
    hf.patch(fresh, ["alibi", "t5", "t5", "t5"])
    hf.patched(fresh).load_state_dict(state.state_dict())
    assert gap(got, out(fresh, x)) <= 1e-6
    hf.patch(model, "alibi")  # one encoding and no layers=: replaces the whole patch
    assert [c.encoding.info.name for c in hf.patched(model).cores] == ["alibi"] * 4


def test_on_a_model_not_patched_the_other_layers_keep_the_models_own():
    model = FAMILIES["cohere2"]()
    x = tokens()
    want = out(model, x)
    hf.patch(model, "alibi", layers=[3])  # the global NoPE layer gets ALiBi; the sliding layers keep their RoPE
    state = hf.patched(model)
    assert [c.encoding.info.name for c in state.cores] == ["nope", "nope", "nope", "alibi"]
    assert state.layer_encodings[:3] == [None] * 3 and state.layer_phases[:3] == ["own"] * 3
    assert gap(out(model, x), want) > 1e-4
    hf.patch(model, "nope", layers=[3])  # NoPE again where the model had NoPE: its own logits
    assert gap(out(model, x), want) <= 1e-5


def test_llama4_an_encoding_on_a_nope_layer_replaces_the_temperature_and_qtemp_puts_it_back():
    model = FAMILIES["llama4"]()
    attn = model.model.layers[3].self_attn
    x = tokens()
    want = out(model, x)
    hf.patch(model, "nope", layers=[3])  # NoPE without the temperature: the model's own temperature is off
    assert not attn.attn_temperature_tuning
    no_temp = out(model, x)
    assert gap(no_temp, want) > 1e-4
    hf.patch(model, "qtemp-llama4", layers=[3])  # posenc's temperature, with the model's floor_scale, attn_scale
    assert hf.patched(model).layer_encodings[3].floor_scale == 4.0
    assert not attn.attn_temperature_tuning  # applied once: posenc's, not also the model's
    assert gap(out(model, x), want) <= 1e-6
    hf.unpatch(model)
    assert attn.attn_temperature_tuning
    assert gap(out(model, x), want) == 0.0


def test_llama4_one_encoding_on_every_layer_has_no_temperature():
    model = FAMILIES["llama4"]()
    hf.patch(model, "alibi")
    assert [a.self_attn.attn_temperature_tuning for a in model.model.layers] == [True, True, True, False]
    hf.patch(model, "rope-interleaved")  # a rotary encoding: RoPE layers only, the NoPE one as it is
    assert [a.self_attn.attn_temperature_tuning for a in model.model.layers] == [True] * 4


# ------------------------------------------------------------------------------------------ bad input
def test_an_unknown_layer_type_names_the_models_types():
    model = FAMILIES["gemma3"]()
    with pytest.raises(ConfigError, match=r"'sliding'.*did you mean 'sliding_attention'.*'full_attention'"):
        hf.patch(model, {"sliding": "rope"})
    with pytest.raises(ConfigError, match="no layer types"):
        hf.patch(llama(), {"full_attention": "rope"})
    assert hf.patched(model) is None


def test_a_layer_out_of_range_names_the_layer_count():
    with pytest.raises(ConfigError, match=r"layer 4 is out of range: this LlamaForCausalLM has 4 layers \(indices 0"):
        hf.patch(llama(), "nope", layers=[1, 4])
    with pytest.raises(ConfigError, match="layer 1 is given twice"):
        hf.patch(llama(), "nope", layers=[1, 1])
    with pytest.raises(ConfigError, match="3 entries for this LlamaForCausalLM's 4 layers"):
        hf.patch(llama(), ["rope", "rope", "nope"])


@pytest.mark.parametrize(
    "how",
    [
        lambda m: hf.patch(m, "ropee"),
        lambda m: hf.patch(m, "ropee", layers=[0]),
        lambda m: hf.patch(m, ["rope", "ropee", "rope", "rope"]),
        lambda m: hf.patch(m, "rope*3+ropee"),
        lambda m: hf.patch(m, {"sliding_attention": ("ropee", {})}),
    ],
    ids=["name", "layers", "list", "schedule", "by-type"],
)
def test_an_unknown_encoding_gives_close_matches(how):
    with pytest.raises(UnknownNameError, match="rope"):
        how(FAMILIES["gemma3"]())


def test_other_bad_requests_are_refused_with_the_reason():
    model = FAMILIES["cohere2"]()
    with pytest.raises(ConfigError, match=r"layer 0: a span of .w8. is asked.*layer 0: w4"):
        hf.patch(model, "rope@w8*3+nope")
    with pytest.raises(ConfigError, match=r"layer 0: a span of 'c4' is asked"):
        hf.patch(model, {"sliding_attention": "rope@c4"})
    hf.patch(model, "rope@w4*3+nope")  # the layers' own spans may be written
    with pytest.raises(ConfigError, match="θ is given twice"):
        hf.patch(model, "rope", theta=1e4, base=1e4)
    with pytest.raises(ConfigError, match="options .*go with one encoding name"):
        hf.patch(model, "rope*3+nope", base=1e4)
    with pytest.raises(ConfigError, match="acts once for the whole model"):
        hf.patch(llama(), ["sinusoidal", "rope", "rope", "rope"])
    with pytest.raises(ConfigError, match="learned table"):
        gpt2 = t.GPT2LMHeadModel(t.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64))
        hf.patch(gpt2, "alibi", layers=[0])


# ------------------------------------------------------------------------------------------ save and load
def test_a_per_layer_patch_saves_and_loads(tmp_path):
    model = FAMILIES["gemma3"]()
    hf.patch(model, {"sliding_attention": "t5", "full_attention": ("rope-linear", {"factor": 8, "theta": 1e6})})
    hf.patch(model, "fire", layers=[1])
    x = tokens()
    want = out(model, x)
    model.save_pretrained(tmp_path)
    back = t.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    state = hf.patched(back)
    assert state is not None and state.name == hf.patched(model).name
    assert state.name == "t5+fire+t5+rope-linear(base=1000000.0,factor=8)"
    assert gap(out(back, x), want) <= 1e-6


# ------------------------------------------------------------------------------------------ generate and caches
PER_LAYER_PATCHES = {
    "llama4": {"chunked_attention": "xpos", "full_attention": "alibi"},
    "gemma3": {"sliding_attention": "t5", "full_attention": ("rope-yarn", {"factor": 2.0, "theta": 1e6})},
    "cohere2": {"sliding_attention": "rope", "full_attention": "fire"},
}


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("family", list(PER_LAYER_PATCHES))
def test_generate_with_a_cache_gives_the_uncached_tokens_and_logits(family, cache):
    generate = matrix_checks.CACHES[cache]
    for patch in ("rope", PER_LAYER_PATCHES[family]):
        model = FAMILIES[family]()
        hf.patch(model, patch)
        for lengths in matrix_checks.CACHE_PROMPTS:
            seq, logits = matrix_checks._steps(model, lengths, **generate)
            want_seq, want_logits = matrix_checks._steps(model, lengths, use_cache=False)
            assert gap(logits, want_logits) < 1e-4, (patch, lengths)
            assert torch.equal(seq, want_seq), (patch, lengths)
