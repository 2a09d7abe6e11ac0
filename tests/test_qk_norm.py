"""QK-norm per layer (``rope#qk``, ``rope#qk-l2``; posenc.schedule and posenc.attention.multihead.QKNorm): the
syntax and its round trips, the unchanged canonical forms of schedules without a norm, a layer's attention against
q and k normalised by hand (RoPE, ALiBi, NoPE), every kernel against the reference path, KV caches, gradients,
torch.compile, the bench's RunConfig and posenc.hf's refusal."""

from __future__ import annotations

import json
import math

import pytest
import torch
from cache_steps import cached_steps
from hypothesis import given, settings
from test_schedule import schedules  # the random schedules of tests/test_schedule.py, here with QK-norms

import posenc
from posenc import ConfigError
from posenc.attention import KVCache, MultiHeadAttention
from posenc.attention.multihead import QKNorm
from posenc.registry import build
from posenc.schedule import LayerSpec, Schedule, Span

EPS = 1e-6

# ------------------------------------------------------------------------------------------------ the syntax

NORMS = (None, "rms", "l2")


@settings(max_examples=150, deadline=None)
@given(schedules(NORMS))
def test_string_and_dict_round_trips(s: Schedule) -> None:
    text = str(s)
    parsed = Schedule.parse(text)
    assert parsed == s and hash(parsed) == hash(s) and str(parsed) == text
    assert Schedule.from_dict(json.loads(json.dumps(s.as_dict()))) == s
    assert posenc.schedule(*s.layers, truncate=s.truncate) == s
    # the suffix is written exactly where a layer has a norm, and last in its term
    for spec in s.layers:
        one = str(spec)
        assert one.endswith("#qk") == (spec.qk_norm == "rms") and one.endswith("#qk-l2") == (spec.qk_norm == "l2")
        assert ("#" in one) == (spec.qk_norm is not None) and ("qk_norm" in spec.as_dict()) == (
            spec.qk_norm is not None
        )


def test_the_syntax_of_the_brief() -> None:
    s = Schedule.parse("rope@w16#qk*3+nope#qk")
    assert [(x.name, str(x.span), x.qk_norm) for x in s] == [("rope", "w16", "rms")] * 3 + [("nope", "", "rms")]
    assert str(s) == "rope@w16#qk*3+nope#qk"
    s = Schedule.parse("rope#qk-l2*3+nope")
    assert [x.qk_norm for x in s] == ["l2", "l2", "l2", None] and str(s) == "rope#qk-l2*3+nope"
    assert str(Schedule.parse("rope#qk")) == "rope#qk" and Schedule.parse("rope#qk")[0].qk_norm == "rms"
    # spaces, aliases, options and a truncated pattern: one canonical string
    assert str(posenc.schedule(" rotary ( base = 500000.0 ) @ w8 # qk * 2 + nope # qk-l2 ...")) == (
        "rope(base=500000.0)@w8#qk*2+nope#qk-l2..."
    )
    assert posenc.schedule("rope#qk+rope#qk+rope+nope#qk").name == "rope#qk*2+rope+nope#qk"  # merged by equality


def test_schedules_without_a_norm_keep_their_strings_and_dicts() -> None:
    # the benchmark's run keys hash these: byte for byte what they were before norms existed
    s = Schedule.parse("rope@w16*3+nope")
    assert str(s) == "rope@w16*3+nope" and repr(s) == "posenc.schedule('rope@w16*3+nope')"
    assert json.dumps(s.as_dict()) == (
        '{"name": "rope@w16*3+nope", "layers": ['
        + '{"encoding": "rope", "options": {}, "span": ["window", 16]}, ' * 3
        + '{"encoding": "nope", "options": {}, "span": "global"}], "truncate": false}'
    )
    assert json.dumps(Schedule.parse("rope").as_dict()) == (
        '{"name": "rope", "layers": [{"encoding": "rope", "options": {}, "span": "global"}], "truncate": false}'
    )
    for text in ["rope*3+nope", "rope@c128", "rope(base=10000.0)@w512*5+rope-linear(base=1000000.0,factor=8)..."]:
        assert str(Schedule.parse(text)) == text
    # a layer without a norm hashes as before (its fields then are those of before)
    spec = LayerSpec("rope", {"base": 1e4}, ("window", 8))
    assert hash(spec) == hash(("rope", (("base", 1e4),), Span("window", 8))) and spec.qk_norm is None


def test_a_norm_is_part_of_equality_but_not_of_the_encoding() -> None:
    plain, rms, l2 = LayerSpec("rope"), LayerSpec("rope", qk_norm="rms"), LayerSpec("rope", qk_norm="l2")
    assert len({plain, rms, l2}) == 3 and plain != rms != l2
    assert plain.same_encoding(rms) and rms.same_encoding(l2)  # one encoding instance serves them all
    assert LayerSpec("rope", qk_norm="qk") == rms and LayerSpec("rope", qk_norm="#qk-l2") == l2  # suffix spellings
    assert Schedule.parse("rope#qk*2+rope").name == "rope#qk*2+rope"
    assert rms.as_dict() == {"encoding": "rope", "options": {}, "span": "global", "qk_norm": "rms"}


def test_the_constructors_take_a_norm() -> None:
    want = Schedule.parse("rope@w8#qk*2+nope#qk-l2")
    assert (
        posenc.schedule(("rope", {}, ("window", 8), "rms"), ("rope", None, "w8", "qk"), ("nope", {}, None, "l2"))
        == want
    )
    assert posenc.schedule(LayerSpec("rope", {}, "w8", "rms"), "rope@w8#qk", "nope#qk-l2") == want
    assert posenc.schedule(layers=["rope@w8#qk", "rope@w8#qk", "nope#qk-l2"]) == want
    by_type = posenc.schedule(
        by_type={"sliding": ("rope", {}, None, "rms"), "full": LayerSpec("nope", qk_norm="l2")},
        layer_types=["sliding", "sliding", "full"],
        spans={"sliding": ("window", 8)},
    )
    assert by_type == want  # a span given by type keeps the layer's norm
    assert Schedule.from_dict({"name": "rope@w8#qk*2+nope#qk-l2"}) == want


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        (
            "rope+nope#qkk",
            r"layer 1: unexpected '#qkk' after 'nope'.*QK-norm is '#qk' \(RMSNorm.*'#qk-l2' \(weightless",
        ),
        ("rope*2+rope#rms", r"layer 2: unexpected '#rms' after 'rope'.*'#qk'.*'#qk-l2'"),
        ("rope#", r"layer 0: unexpected '#' after 'rope' in 'rope#': a layer's QK-norm is"),
        ("rope#qk@w8", r"layer 0: rope: the QK-norm comes after the span: NAME\(KEY=VALUE,...\)@w<W>#qk"),
        ("rope#qk#qk", r"layer 0: unexpected '#qk#qk' after 'rope'"),
    ],
)
def test_a_bad_suffix_names_the_layer_and_the_accepted_norms(text: str, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        Schedule.parse(text)


def test_a_bad_norm_elsewhere_names_the_accepted_values() -> None:
    accepted = r"None, 'rms' \('#qk'.*'l2' \('#qk-l2'"
    with pytest.raises(ConfigError, match=rf"qk_norm must be {accepted}.*got 'layer'"):
        LayerSpec("rope", qk_norm="layer")
    with pytest.raises(ConfigError, match=rf"layer 1: qk_norm must be {accepted}.*got True"):
        posenc.schedule("rope", ("nope", {}, None, True))
    with pytest.raises(ConfigError, match=rf"layer 0: qk_norm must be {accepted}.*got 'RMS'"):
        Schedule.from_dict({"layers": [{"encoding": "rope", "qk_norm": "RMS"}]})
    with pytest.raises(ConfigError, match=rf"qk_norm must be {accepted}.*got 'layernorm'"):
        posenc.LanguageModel(20, encoding="rope", qk_norm="layernorm", d_model=16, n_heads=2)
    with pytest.raises(ConfigError, match=rf"qk_norm must be {accepted}"):
        MultiHeadAttention(16, 2, None, qk_norm="l1")
    with pytest.raises(ConfigError, match=r"qk_norm='rms' puts a QK-norm on every layer.*layer 3 one of its own"):
        posenc.LanguageModel(20, encoding="rope*3+nope#qk", qk_norm="rms", n_layers=4, d_model=16, n_heads=2)


# ------------------------------------------------------------------------------------------------ the norm


def test_the_norms_against_their_formulas() -> None:
    g = torch.Generator().manual_seed(0)
    x = 3 * torch.randn(2, 4, 5, 8, generator=g, dtype=torch.float64)
    rms, l2 = QKNorm("rms", 8), QKNorm("l2", 8)
    assert [n for n, _ in rms.named_parameters()] == ["weight"] and list(l2.parameters()) == []
    assert torch.equal(rms.weight, torch.ones(8))  # initialised to 1
    with torch.no_grad():
        rms.weight.copy_(torch.linspace(0.5, 2.0, 8))
    # one vector at a time, by the definition (x / sqrt(mean of squares + eps), times the weight)
    want = torch.empty_like(x)
    for idx in torch.cartesian_prod(*(torch.arange(s) for s in x.shape[:-1])):
        v = x[tuple(idx)]
        want[tuple(idx)] = v / math.sqrt(sum(float(t) ** 2 for t in v) / 8 + EPS)
    torch.testing.assert_close(l2(x), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(rms(x.float()), (want * rms.weight.double()).float(), rtol=1e-6, atol=1e-6)
    assert l2(x).dtype == torch.float64 and rms(x.float()).dtype == torch.float32  # float64 is not cut to float32
    half = l2(x.to(torch.bfloat16))
    assert half.dtype == torch.bfloat16 and torch.allclose(half.double(), want, rtol=1e-2, atol=1e-2)


def _rope_by_hand(t: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotate-half RoPE (GPT-NeoX / Llama layout) of ``t`` ``[B, H, L, d]`` by the formula."""
    d = t.shape[-1]
    theta = base ** (-torch.arange(0, d // 2, dtype=torch.float64) * 2 / d)
    ang = positions.double()[:, None] * theta[None, :]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    rotated_half = torch.cat([-t[..., d // 2 :], t[..., : d // 2]], -1)
    return t * cos + rotated_half * sin


def _layer(name: str | None, qk_norm: str | None, path: str = "reference", d: int = 32, h: int = 4, seed: int = 0):
    """A float64 attention with its q/k projections scaled up (so that a missing norm shows) and its norm weights
    drawn at random (so that a missing weight shows)."""
    torch.manual_seed(seed)
    enc = None if name is None else build(name, dims=dict(d_model=d, n_heads=h, head_dim=d // h, causal=True))
    layer = MultiHeadAttention(d, h, enc, qk_norm=qk_norm, path=path).double().eval()
    with torch.no_grad():
        layer.q_proj.weight.mul_(5)
        layer.k_proj.weight.mul_(5)
        for norm in (layer.q_norm, layer.k_norm):
            if norm is not None and norm.weight is not None:
                norm.weight.copy_(torch.rand(d // h, dtype=torch.float64) * 1.5 + 0.25)
    return layer


@pytest.mark.parametrize("kind", ["rms", "l2"])
@pytest.mark.parametrize("name", ["rope", "alibi", "nope"])
def test_a_layers_attention_is_that_of_q_and_k_normalised_by_hand(name: str, kind: str) -> None:
    layer = _layer(name, kind)
    b, n, h, d = 2, 11, 4, 8
    x = torch.randn(b, n, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out, weights = layer(x, causal=True, return_weights=True)

    def heads(t: torch.Tensor) -> torch.Tensor:
        return t.view(b, n, h, d).transpose(1, 2)

    def norm(t: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
        t = t / torch.sqrt((t * t).mean(-1, keepdim=True) + EPS)
        return t if w is None else t * w

    q = norm(heads(x @ layer.q_proj.weight.T + layer.q_proj.bias), layer.q_norm.weight)
    k = norm(heads(x @ layer.k_proj.weight.T + layer.k_proj.bias), layer.k_norm.weight)
    v = heads(x @ layer.v_proj.weight.T + layer.v_proj.bias)
    pos = torch.arange(n)
    if name == "rope":  # the encoding after the norm
        q, k = _rope_by_hand(q, pos), _rope_by_hand(k, pos)
    logits = q @ k.transpose(-1, -2) / math.sqrt(d)
    if name == "alibi":  # -m_h (i - j), slopes 2^(-8h/H) for H = 4
        slopes = torch.tensor([2.0 ** (-8 * (i + 1) / h) for i in range(h)], dtype=torch.float64)
        logits = logits - slopes[:, None, None] * (pos[:, None] - pos[None, :]).double()
    logits = logits.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
    want = logits.softmax(-1)
    tol = 1e-6 if name == "rope" else 1e-10  # RoPE's phases are float32 whatever the dtype
    torch.testing.assert_close(weights, want, rtol=tol, atol=tol)
    want_out = layer.o_proj((want @ v).transpose(1, 2).reshape(b, n, 32))
    torch.testing.assert_close(out, want_out, rtol=tol, atol=tol)
    # not blind: without the norm the same layer attends otherwise
    layer.q_norm = layer.k_norm = None
    assert (layer(x, causal=True, return_weights=True)[1] - want).abs().max() > 1e-2


def test_a_weightless_norm_commutes_with_the_rotation_and_a_weighted_one_does_not() -> None:
    g = torch.Generator().manual_seed(3)
    t = 4 * torch.randn(2, 4, 9, 8, generator=g, dtype=torch.float64)
    pos = torch.arange(100, 109)
    l2 = QKNorm("l2", 8)
    torch.testing.assert_close(l2(_rope_by_hand(t, pos)), _rope_by_hand(l2(t), pos), rtol=1e-12, atol=1e-12)
    rms = QKNorm("rms", 8).double()
    with torch.no_grad():
        rms.weight.copy_(torch.linspace(0.5, 2.0, 8))
    assert (rms(_rope_by_hand(t, pos)) - _rope_by_hand(rms(t), pos)).abs().max() > 1e-2


# ------------------------------------------------------------------------------------------------ every kernel

#: (encoding, path, length) -> the kernel each call takes on a CPU
KERNEL_CASES = [
    ("rope", "auto", 40, "sdpa"),
    ("nope", "auto", 40, "sdpa"),
    ("alibi", "auto", 300, "offset-bias"),
    ("transformer-xl", "auto", 300, "blocked"),
    ("fire", "auto", 300, "block-bias"),
    ("cope", "auto", 300, "own-blocked"),
    ("shaw", "auto", 40, "materialised"),
    ("rope", "flex", 40, "flex"),
    ("alibi", "flex", 40, "flex"),
]


@pytest.mark.parametrize(("name", "path", "n", "kernel"), KERNEL_CASES, ids=[f"{c[0]}-{c[3]}" for c in KERNEL_CASES])
def test_every_kernel_gives_the_reference_paths_numbers_and_gradients(
    name: str, path: str, n: int, kernel: str
) -> None:
    from posenc.attention import flex as flex_kernel

    if path == "flex" and not flex_kernel.available():
        pytest.skip("this torch has no flex_attention")
    ref = _layer(name, "rms").float()
    fast = _layer(name, "rms", path=path).float()
    fast.load_state_dict(ref.state_dict())
    x = torch.randn(2, n, 32, generator=torch.Generator().manual_seed(2))
    if path == "flex":  # flex's backward runs on GPUs only: compare the forward
        with torch.no_grad():
            torch.testing.assert_close(fast(x, causal=True), ref(x, causal=True), rtol=1e-4, atol=1e-5)
        assert fast.last_plan.kernel == kernel
        return
    want = ref(x, causal=True)
    got = fast(x, causal=True)
    assert fast.last_plan.kernel == kernel, str(fast.last_plan)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    (want.square().sum()).backward()
    (got.square().sum()).backward()
    for norm in ("q_norm", "k_norm"):
        g_ref, g_fast = getattr(ref, norm).weight.grad, getattr(fast, norm).weight.grad
        assert g_ref is not None and g_ref.abs().max() > 0
        torch.testing.assert_close(g_fast, g_ref, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("name", ["rope", "alibi", "transformer-xl", "shaw"])
def test_a_layers_cache_keeps_normalised_encoded_keys(name: str) -> None:
    layer = _layer(name, "rms", path="auto").float()
    x = torch.randn(2, 20, 32, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = layer(x, causal=True)
        got, _ = cached_steps(layer, x, 13)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------------------ models


def _model(encoding: str, n_layers: int = 4, **kw) -> posenc.LanguageModel:
    torch.manual_seed(0)
    lm = posenc.LanguageModel(50, encoding=encoding, n_layers=n_layers, d_model=32, n_heads=4, **kw).eval()
    with torch.no_grad():  # norm weights away from 1, so that a weight left out would show
        for name, p in lm.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(torch.rand(p.shape) + 0.5)
    return lm


@pytest.mark.parametrize("encoding", ["rope@w8#qk*3+nope#qk", "rope#qk-l2*3+nope", "sinusoidal#qk*3+sinusoidal"])
def test_cached_decoding_equals_the_uncached_forward(encoding: str) -> None:
    lm = _model(encoding)
    norms = [b.attn.qk_norm for b in lm.trunk.blocks]
    assert norms == [s.qk_norm for s in Schedule.parse(encoding).for_layers(4)]
    tokens = torch.randint(0, 50, (2, 30), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = lm(tokens)
        cache = KVCache()
        got = [lm(tokens[:, :17], kv_cache=cache)] + [lm(tokens[:, i : i + 1], kv_cache=cache) for i in range(17, 30)]
    torch.testing.assert_close(torch.cat(got, 1), want, rtol=1e-4, atol=1e-5)
    assert lm.decoding_mode(17, 13)[0] == "cache"
    assert torch.equal(lm.generate(tokens[:, :17], 13), lm.generate(tokens[:, :17], 13, use_cache=False))
    # not blind: the norms change the logits
    plain = _model(encoding.replace("#qk-l2", "").replace("#qk", ""))
    plain.load_state_dict({k: v for k, v in lm.state_dict().items() if "_norm.weight" not in k or "final" in k})
    with torch.no_grad():
        assert (plain(tokens) - want).abs().max() > 1e-3


def test_an_additive_encoding_keeps_its_embedding_and_the_norm_acts_in_attention() -> None:
    lm = _model("sinusoidal#qk")
    assert all(b.attn.encoding is None and b.attn.qk_norm == "rms" for b in lm.trunk.blocks)
    assert "embed" in lm.trunk.encoding.hooks()


def test_the_learnable_weights_get_gradients_and_the_weightless_norm_has_none() -> None:
    lm = _model("rope@w8#qk*3+nope#qk-l2").train()
    tokens = torch.randint(0, 50, (2, 24), generator=torch.Generator().manual_seed(6))
    lm.loss(tokens).backward()
    for i, block in enumerate(lm.trunk.blocks):
        if i < 3:
            for norm in (block.attn.q_norm, block.attn.k_norm):
                assert norm.weight.grad is not None and norm.weight.grad.abs().max() > 0
        else:
            assert list(block.attn.q_norm.parameters()) == list(block.attn.k_norm.parameters()) == []


#: the state_dict keys of posenc.LanguageModel(50, encoding="rope", n_layers=2, ...) before QK-norms existed
PLAIN_KEYS = sorted(
    ["head.weight", "trunk.final_norm.bias", "trunk.final_norm.weight", "trunk.tok.weight"]
    + [
        f"trunk.blocks.{i}.{m}.{p}"
        for i in range(2)
        for m in ("attn.k_proj", "attn.o_proj", "attn.q_proj", "attn.v_proj", "ff.fc1", "ff.fc2", "ln1", "ln2")
        for p in ("bias", "weight")
    ]
)


def test_models_without_a_norm_have_no_new_parameters() -> None:
    for encoding in ["rope", "rope*2", "rope@w8+nope"]:
        lm = posenc.LanguageModel(50, encoding=encoding, n_layers=2, d_model=32, n_heads=4)
        assert sorted(lm.state_dict()) == PLAIN_KEYS
        assert all(b.attn.q_norm is None and b.attn.k_norm is None for b in lm.trunk.blocks)
    l2 = posenc.LanguageModel(50, encoding="rope#qk-l2", n_layers=2, d_model=32, n_heads=4)
    assert sorted(l2.state_dict()) == PLAIN_KEYS  # the weightless norm adds no parameter either
    rms = posenc.LanguageModel(50, encoding="rope#qk+rope", n_layers=2, d_model=32, n_heads=4)
    assert sorted(set(rms.state_dict()) - set(PLAIN_KEYS)) == [
        "trunk.blocks.0.attn.k_norm.weight",
        "trunk.blocks.0.attn.q_norm.weight",
    ]
    assert rms.state_dict()["trunk.blocks.0.attn.q_norm.weight"].shape == (8,)  # head_dim


@pytest.mark.parametrize("kind", ["rms", "l2"])
def test_the_models_qk_norm_argument_is_the_schedule_with_a_norm_on_every_layer(kind: str) -> None:
    suffix = {"rms": "#qk", "l2": "#qk-l2"}[kind]
    by_argument = _model("rope", n_layers=2, qk_norm=kind)
    by_schedule = _model(f"rope{suffix}", n_layers=2)
    assert by_argument.trunk.encoding_name == f"rope{suffix}"  # a schedule model names its layers
    assert by_schedule.trunk.encoding_name == f"rope{suffix}*2"
    by_schedule.load_state_dict(by_argument.state_dict())
    tokens = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        torch.testing.assert_close(by_argument(tokens), by_schedule(tokens), rtol=0, atol=0)
    mixed = _model("rope@w8*3+nope", qk_norm=kind)  # a schedule without norms takes it on every layer
    assert mixed.trunk.encoding_name == f"rope@w8{suffix}*3+nope{suffix}"


def test_a_compiled_model_with_norms_is_one_graph() -> None:
    torch._dynamo.reset()
    lm = _model("rope@w4#qk*3+nope#qk-l2")
    x = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        want = lm(x)
        got = torch.compile(lm, fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------ bench and hf


def test_the_bench_takes_a_schedule_with_norms_under_a_key_of_its_own() -> None:
    from posenc.bench.steps import model_options
    from posenc.bench.types import RunConfig

    lengths = dict(train_lengths=(32, 64), test_lengths=(64, 128))
    with_norm = RunConfig(encoding="rope#qk*3+nope#qk", n_layers=4, task="passkey", **lengths)
    without = RunConfig(encoding="rope*3+nope", n_layers=4, task="passkey", **lengths)
    assert with_norm.encoding == "rope#qk*3+nope#qk" and without.encoding == "rope*3+nope"
    assert with_norm.key() != without.key()
    assert (
        RunConfig(encoding=" rope # qk * 3 + nope#qk", n_layers=4, task="passkey", **lengths).key() == with_norm.key()
    )
    assert RunConfig(encoding="rope", task="order").encoding == "rope"  # a plain name as before
    lm = posenc.LanguageModel(64, **model_options(with_norm))
    assert [b.attn.qk_norm for b in lm.trunk.blocks] == ["rms"] * 4
    with pytest.raises(ConfigError, match="unexpected '#qq' after 'rope'"):
        RunConfig(encoding="rope#qq", n_layers=4, task="passkey", **lengths)


@pytest.mark.usefixtures("quiet_transformers")
def test_hf_patch_refuses_a_norm_by_name() -> None:
    t = pytest.importorskip("transformers")
    hf = pytest.importorskip("posenc.hf")
    config = t.LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = t.LlamaForCausalLM(config).eval()
    tokens = torch.randint(1, 97, (1, 16), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        before = model(tokens).logits
    for request, where, suffix in [
        ("rope#qk", "layer 0", "#qk"),
        ("rope*3+nope#qk-l2", "layer 3", "#qk-l2"),
        (["rope", "rope#qk", "rope", "nope"], "layer 1", "#qk"),
        (posenc.schedule(("rope", {}, None, "rms")), "layer 0", "#qk"),
    ]:
        with pytest.raises(ConfigError, match=rf"{where}: .*asks for a QK-norm \('{suffix}'\).*posenc's own models"):
            hf.patch(model, request)
    with torch.no_grad():  # refused before anything was patched
        assert torch.equal(model(tokens).logits, before)
