"""A key hidden from a query reaches no part of its output, even where it holds NaN or inf (issue 48, item 2).

Softmax gives a hidden key probability 0, but ``0 · NaN`` is NaN: every kernel multiplies a block of probabilities
that holds hidden keys by their values. Each test poisons one or two tokens (in ``k``, in ``v`` or in the layer's
input, placed at random by hypothesis, with NaN, inf or -inf) and compares every query that may not see a poisoned
token with the same call where those tokens hold finite values: equal (to float rounding) and finite. Which query
sees which key is worked out here from the mask's definition (causal, a window, chunks, padding, documents), not
read from the library's mask.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import posenc
from posenc.errors import ConfigError

D, H, L, B = 16, 2, 10, 2
POISONS = (float("nan"), float("inf"), float("-inf"))
WINDOW, CHUNK = 3, 4

# one encoding per kernel family of the plan (auto path): sdpa, sdpa with a bias, offset-bias, blocked, block-bias,
# own-blocked (FoX's cumulative gates; CoPE's gated positions), materialised with the encoding's own weights
# (stick-breaking), a values term (Shaw's a^V)
ENCODINGS = ("nope", "rope", "alibi", "t5", "shaw", "fire", "fox", "cope", "stick-breaking", "kerple-log", "xpos")
MODES = ("causal", "window", "chunk", "pad-causal", "pad", "documents")
PATHS = ("auto", "reference", "flex")


def _encoding(name: str) -> posenc.PositionalEncoding:
    for kw in ({"n_heads": H, "head_dim": D // H}, {"n_heads": H}, {"head_dim": D // H}, {}):
        try:
            return posenc.get(name, **kw)
        except (ConfigError, TypeError):
            continue
    raise AssertionError(f"cannot build {name}")


def _visible(mode: str, pad: torch.Tensor, docs: torch.Tensor) -> torch.Tensor:
    """``[B, L, L]``: whether query i of row b may see key j, from the definitions."""
    i = torch.arange(L)[:, None]
    j = torch.arange(L)[None, :]
    causal = j <= i
    if mode == "causal":
        vis = causal
    elif mode == "window":
        vis = (i - j >= 0) & (i - j < WINDOW)
    elif mode == "chunk":
        vis = causal & (i // CHUNK == j // CHUNK)
    elif mode == "pad-causal":
        vis = causal & ~pad[:, None, :]
    elif mode == "pad":
        vis = ~pad[:, None, :] & torch.ones(L, L, dtype=torch.bool)
    else:
        vis = docs[:, :, None] == docs[:, None, :]
    return vis.expand(B, L, L)


def _module(name: str, mode: str, path: str) -> posenc.MultiHeadAttention:
    torch.manual_seed(0)
    span = ("window", WINDOW) if mode == "window" else ("chunk", CHUNK) if mode == "chunk" else None
    return posenc.MultiHeadAttention(D, H, encoding=_encoding(name), span=span, path=path).eval()


def _poison_hook(rows: list[tuple[int, int]], value: float):
    def hook(_mod, _inp, out):
        out = out.clone()
        for b, t in rows:
            out[b, t] = value
        return out

    return hook


def _run(m: posenc.MultiHeadAttention, x: torch.Tensor, where: str, rows, value: float, kwargs, fn=None):
    handle = None
    if where == "x":
        x = x.clone()
        for b, t in rows:
            x[b, t] = value
    else:
        handle = getattr(m, f"{where}_proj").register_forward_hook(_poison_hook(rows, value))
    try:
        with torch.no_grad():
            return (m if fn is None else fn)(x, **kwargs)
    finally:
        if handle is not None:
            handle.remove()


def _check(
    name: str,
    mode: str,
    path: str,
    where: str,
    poisoned: list[tuple[int, int]],
    value: float,
    seed: int,
    backend: str | None = None,
):
    m = _module(name, mode, path)
    fn = torch.compile(m, backend=backend) if backend else None
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, L, D, generator=g)
    pad = torch.zeros(B, L, dtype=torch.bool)
    docs = torch.zeros(B, L, dtype=torch.long)
    if mode.startswith("pad"):
        for b, t in poisoned:
            pad[b, t] = True
    if mode == "documents":
        cut = torch.randint(1, L, (B,), generator=g)
        docs = (torch.arange(L)[None, :] >= cut[:, None]).long()
    kwargs: dict = {"causal": mode in ("causal", "window", "chunk", "pad-causal")}
    if mode.startswith("pad"):
        kwargs["attention_mask"] = ~pad
    if mode == "documents":
        kwargs["document_ids"] = docs
    try:
        clean = _run(m, x, where, poisoned, 0.75, kwargs, fn)
    except ConfigError as e:  # flex refuses the encodings it has no score_mod for, naming why
        assert path == "flex", e
        return
    got = _run(m, x, where, poisoned, value, kwargs, fn)
    vis = _visible(mode, pad, docs)
    hit = torch.zeros(B, L, dtype=torch.bool)
    for b, t in poisoned:
        hit[b] |= vis[b, :, t]
        hit[b, t] = True  # the poisoned token itself may output anything
    keep = ~hit & ~pad
    assert keep.any()
    a, c = got[keep], clean[keep]
    assert torch.isfinite(a).all(), (name, mode, path, m.last_plan, keep.nonzero().tolist())
    torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6, msg=lambda s: f"{name} {mode} {path} {m.last_plan}: {s}")
    # the rows that do see a poisoned key are not quietly finite
    seen = hit & ~pad
    for b, t in poisoned:
        seen[b, t] = False
    if where != "x" and seen.any() and value != value:  # NaN
        assert not torch.isfinite(got[seen]).all(), (name, mode, path)


@st.composite
def _poisoned(draw):
    n = draw(st.integers(1, 2))
    return sorted({(draw(st.integers(0, B - 1)), draw(st.integers(1, L - 2))) for _ in range(n)})


@pytest.mark.parametrize("name", ENCODINGS)
@settings(max_examples=6, deadline=None)
@given(
    mode=st.sampled_from(MODES),
    path=st.sampled_from(PATHS),
    where=st.sampled_from(("x", "k", "v")),
    poisoned=_poisoned(),
    value=st.sampled_from(POISONS),
    seed=st.integers(0, 2**16),
)
def test_a_hidden_poisoned_token_reaches_no_other_output(name, mode, path, where, poisoned, value, seed) -> None:
    _check(name, mode, path, where, poisoned, value, seed)


@pytest.mark.parametrize(
    ("name", "path"),
    [(n, p) for n in ("nope", "alibi", "fox", "stick-breaking") for p in ("auto", "reference")] + [("fox", "flex")],
)
@pytest.mark.parametrize("mode", MODES)
def test_every_mode_and_path_once(name: str, mode: str, path: str) -> None:
    """The cases issue 48 names, each once (causal, window, chunk, padding, documents; flex for FoX here, for every
    encoding in the random test above)."""
    _check(name, mode, path, "x", [(0, 5)], float("nan"), 3)


@pytest.mark.parametrize("name", ("nope", "alibi", "fox", "t5"))
@pytest.mark.parametrize("mode", ("causal", "window", "pad-causal", "documents"))
def test_compiled_attention_keeps_a_hidden_nan_out(name: str, mode: str) -> None:
    """Under ``torch.compile`` the quarantine has no branch on data (traced by dynamo, run as its graph): the same
    guarantee, a causal call's poisoned queries found from the first NaN key."""
    torch._dynamo.reset()
    _check(name, mode, "auto", "x", [(0, 4), (1, 6)], float("nan"), 5, backend="eager")


def test_compiled_attention_keeps_a_hidden_nan_out_through_inductor() -> None:
    torch._dynamo.reset()
    _check("alibi", "pad-causal", "auto", "x", [(1, 3)], float("nan"), 2, backend="inductor")
    _check("nope", "causal", "auto", "v", [(0, 2)], float("inf"), 4, backend="inductor")


def test_the_fast_path_is_untouched() -> None:
    """Causal SDPA without a non-finite entry runs as before: the same numbers as torch's own SDPA, bit for bit."""
    m = _module("nope", "causal", "auto")
    x = torch.randn(B, L, D)
    with torch.no_grad():
        out = m(x, causal=True)
        q, k, v = (p(x).view(B, L, H, D // H).transpose(1, 2) for p in (m.q_proj, m.k_proj, m.v_proj))
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        want = m.o_proj(want.transpose(1, 2).reshape(B, L, D))
    assert m.last_plan is not None and m.last_plan.kernel == "sdpa"
    assert torch.equal(out, want)


# ---------------------------------------------------------------- a language model, with and without a cache
V = 20


def _lm(schedule: str) -> posenc.LanguageModel:
    torch.manual_seed(0)
    return posenc.LanguageModel(V, encoding=schedule, n_layers=4, d_model=16, n_heads=2).eval()


def _poison_row(model: posenc.LanguageModel, token: int, value: float) -> None:
    with torch.no_grad():
        model.trunk.tok.weight[token] = value


@settings(max_examples=5, deadline=None)
@given(t=st.integers(1, 10), value=st.sampled_from(POISONS), seed=st.integers(0, 2**16))
def test_a_language_model_keeps_the_positions_before_a_nan_token(t: int, value: float, seed: int) -> None:
    """``LanguageModel("rope*3+nope")``: a NaN embedding row of the token at position ``t`` leaves positions < t
    finite and unchanged, in one forward and in a decode through the KV cache."""
    model = _lm("rope*3+nope")
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, V, (2, 12), generator=g)
    tokens[0, t] = 0  # token 0 is only at (0, t)
    with torch.no_grad():
        clean = model(tokens)
        _poison_row(model, 0, value)
        got = model(tokens)
        cache = posenc.KVCache()
        steps = [model(tokens[:, :1], kv_cache=cache)]
        steps += [model(tokens[:, s : s + 1], kv_cache=cache) for s in range(1, 12)]
    stepped = torch.cat(steps, 1)
    # the head is tied to the embedding: every position's logit of token 0 is NaN; the other logits are compared
    clean, got, stepped = clean[..., 1:], got[..., 1:], stepped[..., 1:]
    assert torch.isfinite(got[0, :t]).all() and torch.isfinite(got[1]).all()
    torch.testing.assert_close(got[0, :t], clean[0, :t], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1], clean[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(stepped[0, :t], clean[0, :t], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(stepped[1], clean[1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("schedule", ["rope*3+nope", "alibi*2+fox*2", "stick-breaking+rope+t5+nope"])
def test_a_padded_nan_token_spoils_no_other_row(schedule: str) -> None:
    """Left padding whose pad token has a NaN embedding: the real tokens' logits are those with a finite pad row."""
    model = _lm(schedule)
    tokens = torch.randint(1, V, (2, 9))
    tokens[0, :3] = 0
    mask = tokens != 0
    with torch.no_grad():
        clean = model(tokens, attention_mask=mask)
        _poison_row(model, 0, float("nan"))
        got = model(tokens, attention_mask=mask)
    clean, got = clean[..., 1:], got[..., 1:]  # the head is tied to the embedding: token 0's logits are NaN
    assert torch.isfinite(got[mask]).all(), schedule
    torch.testing.assert_close(got[mask], clean[mask], rtol=1e-5, atol=1e-6)


def test_a_rolling_cache_forgets_a_nan_token() -> None:
    """Windows of 3 on every layer: a NaN token reaches at most 4 · 2 later positions; decoding on past them through
    the rolling caches gives finite logits equal to those of a finite token there."""
    model = _lm("rope@w3*2+alibi@w3+fox@w3")
    tokens = torch.randint(1, V, (1, 20))
    tokens[0, 2] = 0
    reach = 2 + 4 * (3 - 1)
    with torch.no_grad():
        clean = model(tokens)
        _poison_row(model, 0, float("nan"))
        cache = posenc.KVCache()
        got = torch.cat(
            [model(tokens[:, :4], kv_cache=cache)]
            + [model(tokens[:, s : s + 1], kv_cache=cache) for s in range(4, 20)],
            1,
        )
        whole = model(tokens)
    clean, got, whole = clean[..., 1:], got[..., 1:], whole[..., 1:]  # token 0's logits: NaN (a tied head)
    for out in (got, whole):
        assert torch.isfinite(out[0, :2]).all() and torch.isfinite(out[0, reach + 1 :]).all()
        assert not torch.isfinite(out[0, 2]).all()
        torch.testing.assert_close(out[0, reach + 1 :], clean[0, reach + 1 :], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(out[0, :2], clean[0, :2], rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- posenc.hf: a patched transformers model
# RoPE alone acts outside the attention: the patch leaves the model's own attention function (torch's SDPA through
# transformers), which posenc does not run; that path is named in the report as not guaranteed
OWN_ATTENTION = pytest.mark.xfail(strict=True, reason="transformers' own SDPA runs: 0 * NaN of a hidden key")


@pytest.mark.parametrize("name", ["alibi", pytest.param("rope", marks=OWN_ATTENTION), "fox", "stick-breaking"])
def test_a_patched_transformers_model_keeps_nan_padding_out(name: str) -> None:
    """A tiny random Llama patched with ``name``: left padding whose pad token (0) has a NaN embedding leaves the real
    tokens' logits as they are with a finite pad row, and a NaN token at position 6 leaves positions < 6 so."""
    transformers = pytest.importorskip("transformers")
    hf = pytest.importorskip("posenc.hf")
    cfg = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg, num_key_value_heads=2)).eval()
    hf.patch(model, name)
    ids = torch.randint(1, V, (2, 10), generator=torch.Generator().manual_seed(1))
    ids[0, :3] = 0
    mask = (ids != 0).long()
    causal = ids.clone()
    causal[1, 6] = 0
    emb = model.get_input_embeddings().weight
    with torch.no_grad():
        clean = model(ids, attention_mask=mask).logits[..., 1:]
        clean_causal = model(causal[1:]).logits[..., 1:]
        emb[0] = float("nan")
        got = model(ids, attention_mask=mask).logits[..., 1:]
        got_causal = model(causal[1:]).logits[..., 1:]
    real = mask.bool()
    assert torch.isfinite(got[real]).all(), name
    torch.testing.assert_close(got[real], clean[real], rtol=1e-5, atol=1e-6)
    assert torch.isfinite(got_causal[0, :6]).all() and not torch.isfinite(got_causal[0, 6]).all()
    torch.testing.assert_close(got_causal[0, :6], clean_causal[0, :6], rtol=1e-5, atol=1e-6)
