"""Property-based fuzzing of every registered encoding and the public API (issue 15, "nothing lost, nothing silent").

Random encodings (``posenc.available()``, each built with its declared ``example_options``, sometimes with one
numeric setting replaced by NaN, infinity, a negative number, 0 or a large value), shapes, dtypes, positions
(default, shifted, arbitrary integers, fractional, NaN/inf/negative), masks (key padding, custom masks with
fully-masked rows), KV caches and Transformer-XL memory must give either a :class:`posenc.PosencError` or a finite
result equal to the reference path (``path="reference"``, the formulas as written). A causal model's cached
decoding must equal recomputing the whole sequence, wherever :meth:`posenc.LanguageModel.decoding_mode` says
"cache".

Budget: in CI each test runs ``POSENC_FUZZ_EXAMPLES`` examples (default 15; ``deadline=None``; a few seconds
each on 2 loaded cores). A longer run on demand::

    POSENC_FUZZ_EXAMPLES=2000 .venv/bin/python -m pytest -p no:cacheprovider tests/test_fuzz.py

``POSENC_FUZZ_SEED=<int>`` fixes hypothesis's seed (the default is derandomized: the same examples every run, so
CI is reproducible; set a seed to explore others).
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import HealthCheck, event, given, seed, settings
from hypothesis import strategies as st

import posenc
from posenc import PosencError
from posenc.registry import EXAMPLE_DIMS, example, example_options

D, H, V = 16, 2, 24
DIMS = {**EXAMPLE_DIMS, "d_model": D, "n_heads": H, "head_dim": D // H, "max_len": 32, "vocab_size": V}
NAMES = posenc.available()
EXAMPLES = int(os.environ.get("POSENC_FUZZ_EXAMPLES", "15"))
SEED = os.environ.get("POSENC_FUZZ_SEED")

FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=SEED is None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)


def _seeded(f):
    return seed(int(SEED))(f) if SEED is not None else f


ODD_VALUES = [math.nan, math.inf, -math.inf, -1, 0, 0.5, 2, 3, 1e6]


@st.composite
def encodings(draw):
    """(name, options): a registered encoding with its example options, perhaps one numeric setting changed."""
    name = draw(st.sampled_from(NAMES))
    options = dict(example_options(name, DIMS))
    params = example(name, DIMS).params
    numeric = sorted(k for k, v in params.items() if isinstance(v, (int, float)) and not isinstance(v, bool))
    numeric = [k for k in numeric if k not in ("d_model", "n_heads", "head_dim", "vocab_size")]
    if numeric and draw(st.booleans()):
        options[draw(st.sampled_from(numeric))] = draw(st.sampled_from(ODD_VALUES))
    return name, options


def _positions(draw, b, n, start):
    kind = draw(st.sampled_from(["default", "shifted", "arbitrary", "fractional", "bad"]))
    if kind == "default":
        return None
    if kind == "shifted":
        offsets = torch.tensor(draw(st.lists(st.integers(0, 6), min_size=b, max_size=b)))[:, None]
        return offsets + start + torch.arange(n)
    if kind == "arbitrary":
        return torch.tensor(draw(st.lists(st.integers(start, start + 40), min_size=n, max_size=n)))
    if kind == "fractional":
        return torch.tensor(draw(st.lists(st.floats(start, start + 20.0), min_size=n, max_size=n)))
    pos = torch.arange(n, dtype=torch.float32) + start
    pos[draw(st.integers(0, n - 1))] = draw(st.sampled_from([math.nan, math.inf, -1.0]))
    return pos


def _close(a, b, dtype):
    tol = dict(atol=2e-4, rtol=2e-3) if dtype == torch.float32 else dict(atol=1e-8, rtol=1e-6)
    torch.testing.assert_close(a, b, **tol)


def _build_pair(name, options, dtype, **kw):
    """The same attention (one encoding instance, the same weights) on the auto and the reference path."""
    enc = example(name, DIMS, **options)
    torch.manual_seed(0)
    auto = posenc.MultiHeadAttention(D, H, enc, **kw).to(dtype).eval()
    ref = posenc.MultiHeadAttention(D, H, enc, path="reference", **kw).to(dtype).eval()
    ref.load_state_dict(auto.state_dict())
    enc.to(dtype)
    return auto, ref


@_seeded
@FUZZ
@given(enc=encodings(), data=st.data())
def test_attention_gives_an_error_or_the_reference_result(enc, data):
    name, options = enc
    draw = data.draw
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    b, n = draw(st.integers(1, 3)), draw(st.integers(1, 7))
    causal = draw(st.booleans())
    extra = draw(st.sampled_from(["none", "memory", "cache"]))
    m = draw(st.integers(1, 4)) if extra != "none" else 0
    torch.manual_seed(draw(st.integers(0, 2**16)))
    x = torch.randn(b, n, D, dtype=dtype)
    kwargs = dict(causal=causal)
    if extra == "memory":
        kwargs["memory"] = torch.randn(b, m, D, dtype=dtype)
    positions = _positions(draw, b, n, m)
    if positions is not None:
        kwargs["positions"] = positions
        if extra == "memory":
            mem_pos = torch.arange(m).expand(positions.shape[:-1] + (m,)) if positions.dim() == 2 else torch.arange(m)
            kwargs["key_positions"] = torch.cat([mem_pos.to(positions.dtype), positions], -1)
    masking = draw(st.sampled_from(["none", "padding", "custom"]))
    lk = n + m
    if masking == "padding":
        keep = torch.tensor(draw(st.lists(st.booleans(), min_size=b * lk, max_size=b * lk))).view(b, lk)
        kwargs["attention_mask"] = keep
    elif masking == "custom":
        kwargs["mask"] = torch.tensor(draw(st.lists(st.booleans(), min_size=n * lk, max_size=n * lk))).view(n, lk)
    try:
        auto, ref = _build_pair(name, options, dtype)
        caches = [None, None]
        if extra == "cache":
            caches = [posenc.KVCache(), posenc.KVCache()]
            past = torch.randn(b, m, D, dtype=dtype)
            with torch.no_grad():
                auto(past, kv_cache=caches[0], causal=causal)
                ref(past, kv_cache=caches[1], causal=causal)
        with torch.no_grad():
            out = auto(x, kv_cache=caches[0], **kwargs)
            want = ref(x, kv_cache=caches[1], **kwargs)
    except PosencError as e:
        event(f"refused: {type(e).__name__}")
        return
    event("compared with the reference path")
    assert torch.isfinite(out).all(), f"{name} {options}: a non-finite output from finite input"
    _close(out, want, dtype)


@_seeded
@FUZZ
@given(enc=encodings(), data=st.data())
def test_models_give_an_error_or_a_finite_result_and_cached_decoding_is_exact(enc, data):
    name, options = enc
    draw = data.draw
    b, n = draw(st.integers(1, 3)), draw(st.integers(1, 8))
    ids = draw(st.lists(st.integers(-2, V + 1) if draw(st.booleans()) else st.integers(0, V - 1), min_size=b * n,
                        max_size=b * n))  # fmt: skip
    tokens = torch.tensor(ids).view(b, n)
    head = draw(st.sampled_from(["lm", "classifier", "tagger"]))
    attention_mask = None
    if draw(st.booleans()):
        attention_mask = torch.tensor(draw(st.lists(st.booleans(), min_size=b * n, max_size=b * n))).view(b, n)
    positions = _positions(draw, b, n, 0)
    common = dict(d_model=D, n_heads=H, n_layers=2, max_len=32, encoding=name, encoding_options=options or None)
    torch.manual_seed(0)
    try:
        if head == "lm":
            model = posenc.LanguageModel(V, **common).eval()
        elif head == "classifier":
            model = posenc.SequenceClassifier(V, 3, **common).eval()
        else:
            model = posenc.TokenTagger(V, 3, **common).eval()
        with torch.no_grad():
            out = model(tokens, attention_mask=attention_mask, positions=positions)
    except PosencError as e:
        event(f"refused: {type(e).__name__}")
        return
    event("finite")
    assert bool(((tokens >= 0) & (tokens < V)).all()), "an out-of-range token id was accepted"
    assert torch.isfinite(out).all(), f"{name} {options}: non-finite logits"
    if head != "lm" or n < 2 or attention_mask is not None or positions is not None:
        return
    if model.decoding_mode(n - 1, 1)[0] != "cache":
        return
    event("cached decoding compared")
    cache = posenc.KVCache()
    with torch.no_grad():
        model(tokens[:, :-1], kv_cache=cache)
        step = model(tokens[:, -1:], kv_cache=cache)[:, -1]
    _close(step, out[:, -1], torch.float32)


@pytest.mark.parametrize("name", NAMES)
def test_every_encoding_passes_one_plain_example(name):
    """The fuzzers draw encodings at random; this makes sure each one meets the property at least once per run."""
    auto, ref = _build_pair(name, example_options(name, DIMS), torch.float32)
    x = torch.randn(2, 5, D)
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[0, 3:] = False
    with torch.no_grad():
        out, want = auto(x, attention_mask=mask, causal=True), ref(x, attention_mask=mask, causal=True)
    assert torch.isfinite(out).all()
    _close(out, want, torch.float32)
