"""Randomized positions (Ruoss et al. 2023): the wrapper and the registered "randomized-<name>" encodings.

Truth:
* the sample: sorted, distinct, inside [0, max_len); every n-subset equally likely (2000 draws
  of a 2-subset of range(5): each of the 10 subsets within 200 +- 60, i.e. ~4.5 sd, seeded);
  positions that are not 0..N-1 keep their order and equalities;
* the inner encoding really receives the sampled positions in training and the ordinary ones at
  evaluation (a recording encoding inside a model);
* at evaluation a randomized-X model equals the plain X model with the same weights (exactly);
* every hook and class attribute is forwarded (a recording encoding overriding all hooks);
* the range shorter than the sequence is a PositionError naming both numbers.
"""

from __future__ import annotations

import pytest
import torch

import posenc
from posenc import ConfigError, MultiHeadAttention, PositionError
from posenc.base import HOOKS, AttentionContext, PositionalEncoding
from posenc.bias.randomized_registry import REGISTERED
from posenc.randomized import Randomized, randomized
from posenc.registry import example_options


class Recorder(PositionalEncoding):
    """Overrides every hook, records what it is given, and returns recognisable values."""

    key_projection = False
    requires_tokens = True
    shared_across_layers = False

    def __init__(self):
        super().__init__()
        self.calls: dict[str, object] = {}

    def positions(self, positions, training):
        self.calls["positions"] = (positions.clone(), training)
        return positions + 1000

    def embed(self, x, positions, tokens=None):
        self.calls["embed"] = positions
        return x + 1

    def rotate(self, q, k, ctx):
        self.calls["rotate"] = ctx.q_pos
        return q * 2, k * 3

    def logits(self, q, k, ctx):
        self.calls["logits"] = True
        return torch.full((1, 1, q.shape[2], k.shape[2]), 4.0)

    def bias(self, ctx):
        self.calls["bias"] = ctx.q_pos
        return torch.full((1, 1, ctx.q_pos.shape[1], ctx.k_pos.shape[1]), 5.0)

    def values(self, probs, ctx):
        self.calls["values"] = True
        return torch.full((probs.shape[0], probs.shape[1], probs.shape[2], ctx.head_dim), 6.0)

    def scale(self, head_dim):
        return 0.125

    def probabilities(self, logits, ctx):
        self.calls["probabilities"] = True
        return torch.full_like(logits, 7.0)


class BiasRecorder(PositionalEncoding):
    """Records the query positions the attention gives its bias hook."""

    def __init__(self):
        super().__init__()
        self.seen: list[torch.Tensor] = []

    def bias(self, ctx):
        self.seen.append(ctx.q_pos.clone())
        return None


# ----------------------------------------------------------------- the sample
def test_sample_is_sorted_distinct_and_in_range() -> None:
    enc = Randomized(BiasRecorder(), max_len=50)
    pos = torch.arange(20).expand(64, 20)
    out = enc.positions(pos, training=True)
    assert out.shape == pos.shape and out.dtype == pos.dtype
    assert torch.all(out[:, 1:] > out[:, :-1])
    assert out.min() >= 0 and out.max() < 50
    assert len({tuple(r.tolist()) for r in out}) > 1  # one sample per row


def test_sample_is_uniform_over_subsets() -> None:
    enc = Randomized(BiasRecorder(), max_len=5)
    gen = torch.Generator().manual_seed(123)
    out = enc.sample(torch.arange(2).expand(2000, 2), generator=gen)
    counts: dict[tuple[int, int], int] = {}
    for row in out.tolist():
        counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    assert len(counts) == 10  # C(5, 2) subsets, all sorted
    assert all(a < b for a, b in counts)
    assert all(140 <= c <= 260 for c in counts.values()), counts


def test_non_arange_positions_keep_order_and_equalities() -> None:
    enc = Randomized(BiasRecorder(), max_len=40)
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3], [5, 6, 7, 8, 9, 10, 11]])  # packed docs; a cache offset
    out = enc.positions(pos, training=True)
    assert torch.equal(out[0, :3], out[0, 3:6]) and out[0, 6] > out[0, 2]
    assert torch.all(out[1, 1:] > out[1, :-1]) and out[1, 0] >= 5  # position 5 maps to the 6th smallest


def test_evaluation_uses_ordinary_positions_unless_asked() -> None:
    pos = torch.arange(10)[None]
    assert torch.equal(Randomized(BiasRecorder(), 100).positions(pos, training=False), pos)
    rnd = Randomized(BiasRecorder(), 100, at_eval="random").positions(pos, training=False)
    assert torch.all(rnd[:, 1:] > rnd[:, :-1]) and not torch.equal(rnd, pos)


def test_range_shorter_than_sequence_is_an_error() -> None:
    enc = Randomized(BiasRecorder(), max_len=8)
    with pytest.raises(PositionError, match=r"needs 10 distinct positions.*\[0, 8\)"):
        enc.positions(torch.arange(10)[None], training=True)
    enc.positions(torch.arange(10)[None], training=False)  # evaluation: ordinary positions, no error
    model = posenc.LanguageModel(10, encoding="randomized-rope", d_model=16, n_heads=2, n_layers=1, max_len=8)
    with pytest.raises(PositionError, match="random_max_len"):
        model.loss(torch.randint(0, 10, (2, 12)))


# ------------------------------------------------------------- in a model
def test_model_feeds_sampled_positions_in_training_and_ordinary_at_eval() -> None:
    inner = BiasRecorder()
    model = posenc.Decoder(10, encoding=Randomized(inner, max_len=1000), d_model=16, n_heads=2, n_layers=2)
    tokens = torch.randint(0, 10, (3, 12))
    model.train()
    model(tokens)
    seen = inner.seen[-1]
    assert torch.equal(inner.seen[-2], seen)  # every layer sees the same positions
    assert torch.all(seen[:, 1:] > seen[:, :-1]) and seen.max() < 1000
    assert not torch.equal(seen, torch.arange(12).expand_as(seen))
    model.eval()
    model(tokens)
    assert torch.equal(inner.seen[-1], torch.arange(12)[None])


def _inner_names() -> list[str]:
    posenc.available()  # the registry adds the randomized-<name> variants once every encoding is loaded
    return sorted(cls.inner_class.info.name for cls in REGISTERED.values())


@pytest.mark.parametrize("name", _inner_names())
def test_eval_equals_the_plain_encoding_with_the_same_weights(name: str) -> None:
    kw = dict(d_model=16, n_heads=2, n_layers=2, max_len=32)
    dims = dict(kw, head_dim=8, vocab_size=10)
    torch.manual_seed(0)
    options = example_options(name, dims) or None  # the settings the encoding declares, if it needs any
    plain = posenc.LanguageModel(10, encoding=name, encoding_options=options, **kw).eval()
    wrapped_options = example_options(f"randomized-{name}", dims) or None  # the same, as inner_options
    wrapped = posenc.LanguageModel(10, encoding=f"randomized-{name}", encoding_options=wrapped_options, **kw).eval()
    rename = (("trunk.encoding.", "trunk.encoding.inner."), (".attn.encoding.", ".attn.encoding.inner."))
    state = {}
    for key, value in plain.state_dict().items():
        for old, new in rename:
            key = key.replace(old, new)
        state[key] = value
    wrapped.load_state_dict(state)
    tokens = torch.randint(0, 10, (2, 20))
    with torch.no_grad():
        assert torch.equal(plain(tokens), wrapped(tokens))


def test_registered_names_and_dimensions() -> None:
    for name in ("randomized-rope", "randomized-sinusoidal", "randomized-alibi", "randomized-learned"):
        assert name in posenc.available() and name in REGISTERED
        card = posenc.card(name)
        assert card.family == posenc.card(name.removeprefix("randomized-")).family
    t = posenc.Transformer(10, encoding="randomized-learned", d_model=16, n_heads=2, max_len=32)
    assert t.encoding.max_len == 32 and t.encoding.inner.weight.shape == (32, 16)  # default range: max_len
    t = posenc.Transformer(
        10, encoding="randomized-learned", encoding_options={"random_max_len": 256}, d_model=16, n_heads=2, max_len=32
    )
    assert t.encoding.max_len == 256 and t.encoding.inner.weight.shape == (256, 16)
    r = posenc.get("randomized-rope", head_dim=8, inner_options={"base": 500.0}, random_max_len=64)
    assert r.inner.base == 500.0 and r.max_len == 64
    assert sorted(r.hooks()) == ["positions", "rotate"]


def test_per_layer_inner_encodings_are_fresh_copies() -> None:
    model = posenc.Decoder(10, encoding="randomized-kerple-log", d_model=16, n_heads=2, n_layers=2)
    a, b = (blk.attn.encoding for blk in model.blocks)
    assert a is not b and a.inner is not b.inner and a.inner.raw_r1 is not b.inner.raw_r1
    assert type(a) is type(b)
    wrapped = randomized(posenc.get("kerple-power", n_heads=2), max_len=64)
    copy = wrapped.fresh_copy()
    assert isinstance(copy, Randomized) and copy.inner is not wrapped.inner and copy.max_len == 64


def test_trains_and_gradients_reach_the_inner_parameters() -> None:
    torch.manual_seed(0)
    model = posenc.LanguageModel(12, encoding="randomized-learned", d_model=16, n_heads=4, n_layers=1, max_len=64)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for step in range(30):
        start = torch.randint(0, 12, (8, 1))
        loss = model.loss((start + torch.arange(12)) % 12)
        opt.zero_grad()
        loss.backward()
        if step == 0:
            grad = model.trunk.encoding.inner.weight.grad
            assert grad is not None and torch.isfinite(grad).all()
            # each of the 8 sequences draws its own 11 rows (12 tokens, last one dropped): more than 11 rows,
            # and never a row outside the drawn ones
            rows = int((grad.abs().sum(-1) > 0).sum())
            assert 11 < rows <= min(8 * 11, 64)
        opt.step()
        losses.append(loss.item())
    # last five / first five over seeds 0-5 (the manual_seed shifted), native kernels on and off: 0.17-0.23; no learning
    # stays near 1
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5


def test_fast_equals_reference_through_the_wrapper() -> None:
    enc = randomized("alibi", max_len=100, n_heads=4)
    torch.manual_seed(0)
    fast = MultiHeadAttention(16, 4, enc, path="fast").double()
    ref = MultiHeadAttention(16, 4, enc, path="reference").double()
    ref.load_state_dict(fast.state_dict())
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    pos = enc.positions(torch.arange(6).expand(2, 6), training=True)
    assert torch.allclose(fast(x, positions=pos, causal=True), ref(x, positions=pos, causal=True), atol=1e-10)


# ---------------------------------------------------------------- forwarding
def test_every_hook_and_attribute_is_forwarded() -> None:
    inner = Recorder()
    enc = Randomized(inner, max_len=50)
    assert enc.hooks() == frozenset(HOOKS)
    assert Randomized(BiasRecorder(), 50).hooks() == {"positions", "bias"}
    assert Randomized.hooks() == frozenset(HOOKS)  # on the class: the methods it defines
    assert posenc.resolve("randomized-sinusoidal").hooks() == {"positions", "embed"}  # from its inner class
    assert (enc.key_projection, enc.requires_tokens, enc.shared_across_layers) == (False, True, False)
    pos = torch.arange(4)[None]
    out = enc.positions(pos, training=True)
    got, training = inner.calls["positions"]
    assert training and torch.all(got[:, 1:] > got[:, :-1]) and torch.equal(out, got + 1000)  # sampled, then inner
    x = torch.zeros(1, 4, 8)
    assert torch.equal(enc.embed(x, pos), x + 1) and inner.calls["embed"] is pos
    ctx = AttentionContext(q_pos=pos, k_pos=pos, n_heads=2, head_dim=4)
    q = torch.ones(1, 2, 4, 4)
    q2, k2 = enc.rotate(q, q, ctx)
    assert torch.equal(q2, q * 2) and torch.equal(k2, q * 3)
    assert enc.logits(q, q, ctx).unique().item() == 4.0
    assert enc.bias(ctx).unique().item() == 5.0
    assert enc.values(torch.ones(1, 2, 4, 4), ctx).unique().item() == 6.0
    assert enc.scale(64) == 0.125
    assert enc.probabilities(torch.zeros(1, 2, 4, 4), ctx).unique().item() == 7.0
    assert set(inner.calls) == set(HOOKS) - {"scale"}
    rope = randomized("rope", max_len=10, head_dim=4)
    x = torch.randn(1, 3, 4)
    assert torch.equal(rope(x), posenc.get("rope", head_dim=4)(x))  # calling the wrapper calls the inner


def test_bad_arguments() -> None:
    with pytest.raises(ConfigError, match="max_len"):
        Randomized(BiasRecorder(), max_len=0)
    with pytest.raises(ConfigError, match="PositionalEncoding"):
        Randomized(torch.nn.Linear(2, 2), max_len=10)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="at_eval"):
        Randomized(BiasRecorder(), max_len=10, at_eval="sometimes")
    with pytest.raises(ConfigError, match="once"):
        Randomized(Randomized(BiasRecorder(), 10), 10)
    with pytest.raises(ConfigError, match="random_max_len"):
        posenc.get("randomized-alibi", n_heads=2, random_max_len=0)
    with pytest.raises(ConfigError, match="inner options"):
        randomized(BiasRecorder(), max_len=10, n_heads=2)
    with pytest.raises(PositionError, match="integers"):
        Randomized(BiasRecorder(), 10).positions(torch.tensor([[0.0, 1.0]]), training=True)
