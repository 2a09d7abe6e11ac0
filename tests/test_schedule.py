"""Schedules (posenc.schedule): the string syntax and its round trip, the constructors and their errors, the models
that take them (each layer its own encoding, options and span), the span masks against their formulas, the plan a
local RoPE / NoPE layer keeps, and one compiled graph."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import posenc
from posenc import ConfigError, UnknownNameError
from posenc.attention import MultiHeadAttention
from posenc.schedule import LayerSpec, Schedule, Span

# ------------------------------------------------------------------------------------------------ the syntax

NAMES = ["rope", "nope", "alibi", "t5", "rope-linear", "sinusoidal"]
OPTIONS = {
    "rope": {"base": st.sampled_from([10000.0, 500000.0, 1e6])},
    "rope-linear": {"base": st.sampled_from([1e4, 1e6]), "factor": st.integers(1, 16)},
    "t5": {"num_buckets": st.integers(2, 64), "scaling": st.sampled_from(["default", "none"])},
    "alibi": {"bidirectional": st.sampled_from([True, False, None])},
}


@st.composite
def layer_specs(draw: st.DrawFn, norms: tuple[str | None, ...] = (None,)) -> LayerSpec:
    """A random layer; ``norms``: the QK-norms it may take (tests/test_qk_norm.py draws all of them)."""
    name = draw(st.sampled_from(NAMES))
    options = {}
    for key, values in OPTIONS.get(name, {}).items():
        if draw(st.booleans()) or name == "rope-linear" and key == "factor":
            options[key] = draw(values)
    span = draw(
        st.one_of(
            st.just(None),
            st.tuples(st.just("window"), st.integers(1, 4096)),
            st.tuples(st.just("chunk"), st.integers(1, 4096)),
        )
    )
    return LayerSpec(name, options, Span.of(span), draw(st.sampled_from(norms)))


@st.composite
def schedules(draw: st.DrawFn, norms: tuple[str | None, ...] = (None,)) -> Schedule:
    layers = draw(st.lists(layer_specs(norms), min_size=1, max_size=6))
    counts = draw(st.lists(st.integers(1, 4), min_size=len(layers), max_size=len(layers)))
    expanded = tuple(spec for spec, n in zip(layers, counts) for _ in range(n))
    return Schedule(expanded, truncate=draw(st.booleans()))


@settings(max_examples=150, deadline=None)
@given(schedules())
def test_string_round_trip(s: Schedule) -> None:
    text = str(s)
    parsed = Schedule.parse(text)
    assert parsed == s and hash(parsed) == hash(s)
    assert str(parsed) == text  # the canonical string reads back to itself
    assert " " not in text
    assert Schedule.from_dict(json.loads(json.dumps(s.as_dict()))) == s


def test_canonical_strings_read_back_to_themselves() -> None:
    for text in [
        "rope*3+nope",
        "rope@w64*3+nope",
        "rope@c128",
        "rope(base=10000.0)@w512*5+rope-linear(base=1000000.0,factor=8)...",
        "t5(scaling='none')+alibi@w3",
    ]:
        assert str(Schedule.parse(text)) == text


def test_spelling_variants_give_the_canonical_string() -> None:
    # spaces, aliases, option order, @g, unmerged neighbours: one schedule, printed one way
    assert str(posenc.schedule(" rotary @ w64 + rope@w64*2 + nope@g ")) == "rope@w64*3+nope"
    assert str(posenc.schedule("rope-linear(factor=8, base=1e6)")) == "rope-linear(base=1000000.0,factor=8)"


def test_constructors_agree() -> None:
    want = Schedule.parse("rope*3+nope")
    assert posenc.schedule("rope", "rope", "rope", "nope") == want
    assert posenc.schedule("rope*3+nope") == want
    assert posenc.schedule(["rope", "rope", "rope", "nope"]) == want
    assert posenc.schedule(layers=["rope", "rope", "rope", ("nope", {})]) == want
    assert posenc.schedule("rope*2", "rope+nope") == want
    assert len(want) == 4 and want.for_layers(8) == want.layers * 2
    spec = posenc.schedule(("rope", {"base": 1e4}, ("window", 8)))[0]
    assert spec.name == "rope" and dict(spec.options) == {"base": 1e4} and spec.span == Span("window", 8)


def test_by_type_gemma3_pattern() -> None:
    types = ["sliding"] * 5 + ["full"]
    s = posenc.schedule(
        by_type={"sliding": ("rope", {"base": 1e4}), "full": ("rope-linear", {"factor": 8, "base": 1e6})},
        layer_types=types * 2,
        spans={"sliding": ("window", 512)},
    )
    assert len(s) == 12
    assert all(s[i].span == Span("window", 512) and s[i].name == "rope" for i in range(12) if types[i % 6] == "sliding")
    assert s[5].name == "rope-linear" and s[5].span.is_global and dict(s[5].options) == {"base": 1e6, "factor": 8}
    assert str(s) == ("rope(base=10000.0)@w512*5+rope-linear(base=1000000.0,factor=8)+" * 2)[:-1]


def test_layer_count_must_fit_the_pattern_unless_truncated() -> None:
    s = posenc.schedule("rope*3+nope")
    with pytest.raises(ConfigError, match=r"pattern of 4 layers.*n_layers=6.*'\.\.\.'"):
        s.for_layers(6)
    names = [spec.name for spec in posenc.schedule("rope*3+nope...").for_layers(6)]
    assert names == ["rope", "rope", "rope", "nope", "rope", "rope"]
    assert posenc.schedule("rope*3+nope", truncate=True) == posenc.schedule("rope*3+nope...")
    with pytest.raises(ConfigError, match="n_layers=6"):
        posenc.LanguageModel(20, encoding="rope*3+nope", n_layers=6, d_model=16, n_heads=2)


@pytest.mark.parametrize(
    ("text", "error", "pattern"),
    [
        ("rope+rope+ropee", UnknownNameError, r"^layer 2: unknown encoding 'ropee' \(close matches: rope"),
        ("rope*3+ropee", UnknownNameError, r"^layer 3: unknown encoding 'ropee'"),
        (
            "rope+rope(thetaa=2)",
            ConfigError,
            r"^layer 1: encoding 'rope' does not take 'thetaa'; it takes: head_dim, base",
        ),
        ("rope(theta=1e4)", ConfigError, r"^layer 0: .*'theta' \(RoPE's θ is called base here\)"),
        ("rope+", ConfigError, r"^layer 1: an empty term"),
        ("rope*0", ConfigError, r"^layer 0: .*integer >= 1, got '0'"),
        ("rope@w0", ConfigError, r"^layer 0: a window span needs a size that is an integer >= 1, got 0"),
        ("nope+rope@x5", ConfigError, r"^layer 1: a span is"),
        ("rope(base=nan)", ConfigError, r"^layer 0: option base=nan of rope: the value must be a Python literal"),
        ("rope(base=)", ConfigError, r"^layer 0: option base= of rope"),
        ("rope(base=1", ConfigError, r"^layer 0: rope's options are not closed"),
        ("rope#", ConfigError, r"^layer 0: unexpected '#'"),
        ("", ConfigError, "an empty schedule"),
    ],
)
def test_errors_name_the_layer_and_the_value(text: str, error: type, pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        posenc.schedule(text)


def test_option_values_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"^layer 1: option 'base' must be a finite number, got nan"):
        posenc.schedule("nope", ("rope", {"base": float("nan")}))
    with pytest.raises(ConfigError, match=r"^layer 0: option 'base' must be a number, .* got dict"):
        posenc.schedule(("rope", {"base": {}}))


def test_by_type_errors() -> None:
    with pytest.raises(ConfigError, match=r"layer 2: layer type 'full' has no encoding in by_type"):
        posenc.schedule(by_type={"sliding": "rope"}, layer_types=["sliding", "sliding", "full"])
    with pytest.raises(ConfigError, match=r"spans names layer types \['ful'\]"):
        posenc.schedule(by_type={"sliding": "rope"}, layer_types=["sliding"], spans={"ful": ("window", 4)})
    with pytest.raises(ConfigError, match="takes one of"):
        posenc.schedule("rope", layers=["rope"])


# ------------------------------------------------------------------------------------------------ the models


def test_each_layer_builds_its_own_encoding_options_and_span() -> None:
    model = posenc.LanguageModel(
        30, encoding="rope(base=10000.0)@w4*2+rope(base=1000000.0)+nope", n_layers=4, d_model=16, n_heads=2
    )
    attns = [b.attn for b in model.trunk.blocks]
    assert [a.encoding.params.get("base") if a.encoding is not None else None for a in attns] == [1e4, 1e4, 1e6, None]
    assert attns[0].encoding is attns[1].encoding  # one RoPE (shared_across_layers) for the layers with its options
    assert attns[2].encoding is not attns[0].encoding
    assert [a.span for a in attns] == [Span("window", 4), Span("window", 4), None, None]
    assert model.trunk.encoding_name == "rope(base=10000.0)@w4*2+rope(base=1000000.0)+nope"
    assert model.trunk.schedule == posenc.schedule("rope(base=10000.0)@w4*2+rope(base=1000000.0)+nope")


def test_per_layer_encodings_get_their_own_parameters() -> None:
    # shaw is not shared across layers: the two layers that have it get their own tables
    model = posenc.Transformer(30, encoding="shaw@w4+rope", n_layers=4, d_model=16, n_heads=2)
    encs = [b.attn.encoding for b in model.blocks]
    assert encs[0] is not encs[2] and type(encs[0]) is type(encs[2])
    assert encs[1] is encs[3]


def test_plain_names_build_as_before() -> None:
    torch.manual_seed(0)
    a = posenc.LanguageModel(30, encoding="shaw", n_layers=2, d_model=16, n_heads=2)
    torch.manual_seed(0)
    b = posenc.LanguageModel(30, encoding=posenc.schedule("shaw"), n_layers=2, d_model=16, n_heads=2)
    assert a.trunk.schedule is None and b.trunk.schedule == posenc.schedule("shaw*2")
    for (n, p), (m, q) in zip(a.named_parameters(), b.named_parameters()):
        assert n == m and torch.equal(p, q)


def test_model_level_hooks_only_when_every_layer_agrees() -> None:
    with pytest.raises(
        ConfigError, match=r"layer 3: 'sinusoidal' acts once for the whole model .*'embed'.* layer 0 is 'rope'"
    ):
        posenc.LanguageModel(30, encoding="rope*3+sinusoidal", n_layers=4, d_model=16, n_heads=2)
    with pytest.raises(ConfigError, match=r"layer 0: 'randomized-rope' .*'positions'"):
        posenc.LanguageModel(30, encoding="randomized-rope+rope", n_layers=2, d_model=16, n_heads=2)
    # the same absolute encoding on every layer, spans differing: one embedding, as a plain model
    torch.manual_seed(0)
    m = posenc.LanguageModel(30, encoding="sinusoidal@w3+sinusoidal", n_layers=2, d_model=16, n_heads=2)
    torch.manual_seed(0)
    plain = posenc.LanguageModel(30, encoding="sinusoidal", n_layers=2, d_model=16, n_heads=2)
    plain.load_state_dict(m.state_dict())
    x = torch.randint(0, 30, (2, 3))  # 3 tokens: the window of 3 hides nothing, so the two models agree
    torch.testing.assert_close(m(x), plain(x))


def test_encoding_options_are_refused_with_a_schedule() -> None:
    with pytest.raises(ConfigError, match="each layer carries its own options"):
        posenc.LanguageModel(30, encoding="rope*2", encoding_options={"base": 5.0}, n_layers=2, d_model=16, n_heads=2)


def test_a_build_error_names_the_layer() -> None:
    with pytest.raises(ConfigError, match=r"^layer 1: .*rope-linear.*factor"):
        posenc.LanguageModel(30, encoding="rope+rope-linear", n_layers=2, d_model=16, n_heads=2)


# ------------------------------------------------------------------------------------------------ the span masks


def _allowed(kind: str, size: int, lq: int, lk: int, start: int, causal: bool) -> torch.Tensor:
    """The span's formula, pair by pair (query index and key index in the sequence)."""
    out = torch.zeros(lq, lk, dtype=torch.bool)
    for a in range(lq):
        i = start + lk - lq + a
        for b in range(lk):
            j = start + b
            if causal and j > i:
                continue
            out[a, b] = abs(i - j) < size if kind == "window" else i // size == j // size
    return out


@pytest.mark.parametrize("kind", ["window", "chunk"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("size", [1, 3, 5])
def test_span_attention_equals_its_formula(kind: str, causal: bool, size: int) -> None:
    torch.manual_seed(0)
    layer = MultiHeadAttention(16, 2, posenc.get("rope", head_dim=8), span=(kind, size)).eval()
    plain = MultiHeadAttention(16, 2, posenc.get("rope", head_dim=8), path="reference").eval()
    plain.load_state_dict(layer.state_dict())
    x = torch.randn(2, 11, 16)
    got = layer(x, causal=causal)
    want = plain(x, mask=_allowed(kind, size, 11, 11, 0, causal))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@given(
    st.sampled_from(["window", "chunk"]),
    st.integers(1, 9),
    st.integers(1, 12),
    st.integers(0, 12),
    st.integers(0, 30),
    st.booleans(),
)
@settings(max_examples=80, deadline=None)
def test_span_mask_formula(kind: str, size: int, lq: int, extra: int, start: int, causal: bool) -> None:
    lk = lq + extra
    got = posenc.attention.masks.span_mask(
        kind, size, lq=lq, lk=lk, key_start=start, device=torch.device("cpu"), causal=causal
    )
    assert got.shape == (1, 1, lq, lk)
    assert torch.equal(got[0, 0], _allowed(kind, size, lq, lk, start, causal))
    if not posenc.attention.masks.span_needed(kind, size, lq=lq, lk=lk, key_start=start):
        # the attention leaves the mask out: it must hide nothing beyond causality
        assert torch.equal(got[0, 0], _allowed("window", lk + 1, lq, lk, start, causal))


@pytest.mark.parametrize("encoding", ["rope", "nope"])
def test_a_local_rope_or_nope_layer_keeps_sdpa(encoding: str) -> None:
    model = posenc.LanguageModel(30, encoding=f"{encoding}@w8+{encoding}@c8", n_layers=2, d_model=16, n_heads=2)
    x = torch.randint(0, 30, (2, 40))
    loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
    loss.backward()
    for block in model.trunk.blocks:
        plan = block.attn.last_plan
        assert plan is not None and plan.kernel == "sdpa", str(plan)


def test_cross_attention_with_a_span_is_refused() -> None:
    layer = MultiHeadAttention(16, 2, None, span=("window", 4))
    with pytest.raises(ConfigError, match="window span .*cross-attention"):
        layer(torch.randn(1, 3, 16), key_value=torch.randn(1, 5, 16))
    with pytest.raises(ConfigError, match="a span is"):
        MultiHeadAttention(16, 2, None, span=("ring", 4))


def test_compiled_schedule_model_is_one_graph() -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = posenc.LanguageModel(30, encoding="rope@w4*3+nope", n_layers=4, d_model=16, n_heads=2).eval()
    x = torch.randint(0, 30, (2, 12))
    want = model(x)
    got = torch.compile(model, fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------ bench, inspect


def test_run_config_keeps_the_canonical_schedule_in_its_key() -> None:
    from posenc.bench.types import RunConfig

    a = RunConfig(task="order", encoding="rope@w8+nope")
    b = RunConfig(task="order", encoding=" rotary@w8 + nope@g")
    assert a.encoding == b.encoding == "rope@w8+nope" and a.key() == b.key()
    assert a.key() != RunConfig(task="order", encoding="rope@w4+nope").key()
    assert RunConfig(task="order", encoding="rope").encoding == "rope"  # a plain name (and its key) as before
    with pytest.raises(ConfigError, match=r"pattern of 4 layers.*n_layers=2"):
        RunConfig(task="order", encoding="rope*3+nope")
    with pytest.raises(ConfigError, match="go with one encoding name"):
        RunConfig(task="order", encoding="rope+nope", encoding_options={"base": 5.0})
    with pytest.raises(UnknownNameError, match="layer 1: unknown encoding 'nop'"):
        RunConfig(task="order", encoding="rope+nop")


def test_bench_builds_a_schedule_model() -> None:
    from posenc.bench.steps import model_options
    from posenc.bench.suites import check_reach
    from posenc.bench.types import RunConfig

    cfg = RunConfig(task="order", encoding="rope@w8+nope", model="decoder")
    check_reach(cfg)
    model = posenc.LanguageModel(20, **model_options(cfg))
    assert model.trunk.encoding_name == "rope@w8+nope"
    with pytest.raises(ConfigError, match="cannot reach test length"):
        check_reach(RunConfig(task="order", encoding="learned(max_len=20)+learned(max_len=20)@w4"))


def test_inspect_takes_a_schedule(capsys: pytest.CaptureFixture[str]) -> None:
    from posenc.cli import main

    assert main(["inspect", "rope(base=100.0)@w8*3+nope", "--no-plots", "--dim", "16", "--length", "16"]) == 0
    out = capsys.readouterr().out
    assert "== layers 0, 1, 2 of 'rope(base=100.0)@w8*3+nope': rope (span: w8) ==" in out
    assert "== layer 3 of 'rope(base=100.0)@w8*3+nope': nope (span: global) ==" in out
    assert main(["inspect", "rope+ropee", "--no-plots"]) == 2
    assert "layer 1: unknown encoding 'ropee'" in capsys.readouterr().err


def test_bench_schedule_quick_runs_and_says_what_it_measured() -> None:
    import pathlib
    import subprocess
    import sys

    script = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "bench_schedule.py"
    env = {"OMP_NUM_THREADS": "1", "PATH": ""}
    got = subprocess.run(
        [sys.executable, str(script), "--quick", "--json"], capture_output=True, text=True, timeout=300, env=env
    )
    assert got.returncode == 0, got.stderr
    result = json.loads(got.stdout.splitlines()[0])
    assert result["schedules"] == {"hybrid": "rope@w16*3+nope", "all-rope": "rope"}
    assert all(len(v) == 2 for step in result["times"].values() for v in step.values())
    assert result["plans"]["hybrid"] == ["sdpa"] * 4
    assert result["cached_keys"]["hybrid"][:3] == [15, 15, 15]
    assert result["cached_keys"]["hybrid"][3] == result["cached_keys"]["all-rope"][0] > 15
    assert "| train |" in got.stdout and "| decode |" in got.stdout
    usage = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert usage.returncode == 0 and "--quick" in usage.stdout
    bad = subprocess.run([sys.executable, str(script), "--n-layers", "6"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "multiple of 4" in bad.stderr


def test_schedule_models_copy_pickle_and_keep_options_fixed() -> None:
    import copy
    import io
    import pickle

    model = posenc.LanguageModel(30, encoding="rope(base=100.0)@w4*3+nope", n_layers=4, d_model=16, n_heads=2)
    assert copy.deepcopy(model).trunk.schedule == model.trunk.schedule
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    assert torch.load(buf, weights_only=False).trunk.schedule == model.trunk.schedule
    s = model.trunk.schedule
    assert pickle.loads(pickle.dumps(s)) == s and hash(pickle.loads(pickle.dumps(s))) == hash(s)
    with pytest.raises(TypeError, match="cannot change"):
        s[0].options["base"] = 3.0  # type: ignore[index]
