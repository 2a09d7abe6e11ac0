"""Absolute encodings against the formulas of the background articles (docs/background.md), shortcomings measured."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import posenc
from posenc.errors import ConfigError, PositionError


def pe(name, d=512, **kw):
    return posenc.get(name, d_model=d, **kw)


def test_seed000_pe1_vector():
    # Wu (2022): PE(1) = [sin(1/10000^(0/512)), cos(1/10000^(0/512)), sin(1/10000^(2/512)), cos(...), ...]
    got = pe("sinusoidal").codes(torch.tensor([1]))[0].double()
    want = []
    for i in range(256):
        w = 1 / 10000 ** (2 * i / 512)
        want += [math.sin(w), math.cos(w)]
    assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), atol=1e-6)


@settings(max_examples=30, deadline=None)
@given(t=st.integers(0, 5000), k=st.integers(-300, 300))
def test_sinusoidal_offset_is_a_rotation(t, k):
    # Xixiaoyao, "Three positional encoding methods", eq. (9):
    # [PE(t+k,2i), PE(t+k,2i+1)] = [[u, v], [-v, u]] [PE(t,2i), PE(t,2i+1)], u=cos(w_i k), v=sin(w_i k)
    if t + k < 0:
        k = -t
    d = 64
    enc = pe("sinusoidal", d)
    p_t = enc.table(torch.tensor([[t]])).double()[0, 0].view(-1, 2)
    p_tk = enc.table(torch.tensor([[t + k]])).double()[0, 0].view(-1, 2)
    w = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    u, v = torch.cos(w * k), torch.sin(w * k)
    rot = torch.stack([u * p_t[:, 0] + v * p_t[:, 1], -v * p_t[:, 0] + u * p_t[:, 1]], dim=-1)
    assert torch.allclose(rot, p_tk, atol=1e-5)


@settings(max_examples=30, deadline=None)
@given(t=st.integers(300, 3000), k=st.integers(0, 300))
def test_sinusoidal_dot_product_depends_on_abs_offset(t, k):
    # Wu (2022); Xixiaoyao, "Three positional encoding methods": PE_t . PE_{t+k} = sum_j cos(c_j k) = PE_t . PE_{t-k}
    d = 128
    enc = pe("sinusoidal", d)
    codes = enc.table(torch.tensor([[t - k, t, t + k]])).double()[0]
    c = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    expected = torch.cos(c * k).sum()
    assert torch.allclose(codes[1] @ codes[2], expected, atol=1e-4)
    assert torch.allclose(codes[1] @ codes[0], expected, atol=1e-4)


def test_concat_layout_is_seed001_and_a_permutation_of_interleaved():
    d, n = 16, 40
    pos = torch.arange(n)
    inter, concat = pe("sinusoidal", d).codes(pos), pe("sinusoidal-concat", d).codes(pos)
    # anon., "Positional encoding of the Transformer": inv_freq = 1/10000^(arange(0,d,2)/d); cat(sin, cos)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).double() / d))
    ang = pos.double()[:, None] * inv
    assert torch.allclose(concat.double(), torch.cat([ang.sin(), ang.cos()], -1), atol=1e-6)
    perm = torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])
    assert torch.equal(inter[:, perm], concat)


def test_base_is_configurable():
    a = pe("sinusoidal", 8, base=100.0).codes(torch.tensor([3]))[0]
    assert torch.allclose(a[2], torch.tensor(math.sin(3 / 100 ** (2 / 8))), atol=1e-6)


def test_naive_codes_follow_seed001():
    d = 8
    pos = torch.arange(6)
    assert torch.equal(pe("integer", d).codes(pos)[:, 0], (pos + 1).float())  # first token is 1
    assert torch.allclose(pe("normalized", d).codes(torch.arange(3))[:, 0], torch.tensor([0.0, 0.5, 1.0]))
    b = pe("binary", 3).codes(torch.arange(8))
    assert b.tolist() == [[(t >> i) & 1 for i in range(3)] for t in range(8)]
    i = torch.arange(d).double()
    t = 5.0
    assert torch.allclose(pe("sin-pow2", d).codes(torch.tensor([5]))[0].double(), torch.sin(t / 2**i), atol=1e-6)
    want = torch.sin(t / 10000 ** (i / (d - 1)))
    assert torch.allclose(pe("sin-only", d).codes(torch.tensor([5]))[0].double(), want, atol=1e-6)


def test_integer_positions_are_unbounded():
    enc = pe("integer", 16)
    norms = [float(enc.codes(torch.tensor([n])).norm()) for n in (10, 100, 1000)]
    assert norms[0] < norms[1] < norms[2]
    assert norms[2] / norms[1] > 9  # grows linearly with the position


def test_normalized_offset_depends_on_length():
    enc = pe("normalized", 4)
    d3 = enc.codes(torch.arange(3))
    d4 = enc.codes(torch.arange(4))
    step3 = float((d3[1] - d3[0])[0])
    step4 = float((d4[1] - d4[0])[0])
    assert step3 == pytest.approx(0.5)
    assert step4 == pytest.approx(1 / 3)
    assert abs(step3 - step4) > 0.1  # the same offset (1) means a different distance


def test_binary_is_unique_but_discontinuous():
    enc = pe("binary", 8)
    codes = enc.codes(torch.arange(256))
    assert torch.unique(codes, dim=0).shape[0] == 256
    steps = (codes[1:] - codes[:-1]).norm(dim=-1)
    assert float(steps.min()) == pytest.approx(1.0)
    assert float(steps.max()) == pytest.approx(math.sqrt(8))  # 127 -> 128 flips every bit
    with pytest.raises(PositionError, match="0..255"):
        enc.codes(torch.tensor([256]))


def test_learned_matches_hf_bert_embeddings():
    transformers = pytest.importorskip("transformers")
    from transformers.models.bert.modeling_bert import BertEmbeddings

    cfg = transformers.BertConfig(vocab_size=50, hidden_size=24, max_position_embeddings=20, hidden_dropout_prob=0.0)
    hf = BertEmbeddings(cfg).eval()
    ours = posenc.get("learned", d_model=24, max_len=20)
    with torch.no_grad():
        ours.weight.copy_(hf.position_embeddings.weight)
    ids = torch.randint(0, 50, (3, 11))
    with torch.no_grad():
        want = hf(input_ids=ids)
        x = hf.word_embeddings(ids) + hf.token_type_embeddings(torch.zeros_like(ids))
        got = hf.LayerNorm(ours.embed(x, torch.arange(11)[None]))
    assert torch.allclose(got, want, atol=1e-6)


def test_learned_accepts_bld_and_bhld_like_seed001():
    enc = pe("learned", 16, max_len=10)
    x = torch.randn(2, 5, 16)
    y3 = enc(x)
    assert torch.allclose(y3, x + enc.weight[:5])
    x4 = x.view(2, 5, 4, 4).transpose(1, 2)  # (b, h, l, d) whose heads concatenate to 16
    y4 = enc(x4)
    assert torch.allclose(y4.transpose(1, 2).reshape(2, 5, 16), y3)


def test_learned_position_beyond_table_is_a_clear_error():
    enc = pe("learned", 8, max_len=10)
    with pytest.raises(PositionError, match=r"up to 12 .*0\.\.9 \(max_len=10\)"):
        enc(torch.randn(1, 13, 8))
    model = posenc.Encoder(20, encoding="learned", d_model=16, n_heads=2, max_len=10)
    with pytest.raises(PositionError, match="max_len=10"):
        model(torch.randint(0, 20, (1, 11)))


def test_bad_inputs():
    with pytest.raises(PositionError, match="integers"):
        pe("learned", 8).codes(torch.tensor([1.5]))
    with pytest.raises(PositionError, match=">= 0"):
        pe("sinusoidal", 8).codes(torch.tensor([-1]))
    with pytest.raises(ConfigError, match="even"):
        pe("sinusoidal", 7)
    with pytest.raises(ConfigError, match="d_model=8"):
        pe("sinusoidal", 8).embed(torch.randn(1, 3, 6), torch.arange(3)[None])
    with pytest.raises(ConfigError, match="length must be >= 0"):
        pe("sinusoidal", 8).matrix(-3)
    with pytest.raises(PositionError, match="3 tokens but the sequence has 4"):
        pe("sinusoidal", 8).embed(torch.randn(1, 4, 8), torch.arange(3)[None])


def test_matrix_is_the_code_table():
    enc = pe("sinusoidal", 8)
    assert torch.equal(enc.matrix(5), enc.codes(torch.arange(5)))
    assert enc.matrix(0).shape == (0, 8)


class TestComplexOrder:
    def test_formula_and_offset_transform(self):
        enc = posenc.get("complex-order", d_model=6, vocab_size=10, output="real")
        tokens = torch.tensor([[3, 3, 7]])
        r = torch.rand(1, 3, 6) + 0.5
        pos = torch.tensor([[0, 4, 9]])
        z = enc.complex(r, tokens, pos)
        w, th = enc.omega.detach(), enc.theta.detach()
        for n in range(3):
            j, p = int(tokens[0, n]), int(pos[0, n])
            want = r[0, n] * torch.exp(1j * (w[j] * p + th[j]))
            assert torch.allclose(z[0, n], want.to(z.dtype), atol=1e-5)
        # g(pos + k) = e^{i w k} g(pos): a transform that depends on k (and the word), not on pos
        k = 5
        z1 = enc.complex(r[:, :1], tokens[:, :1], torch.tensor([[2]]))
        z2 = enc.complex(r[:, :1], tokens[:, :1], torch.tensor([[2 + k]]))
        assert torch.allclose(z2, z1 * torch.exp(1j * w[3] * k), atol=1e-5)
        # bounded: |g| = r
        assert torch.allclose(z.abs(), r, atol=1e-5)
        assert torch.allclose(enc.embed(r, pos, tokens), z.real, atol=1e-6)

    def test_vanilla_has_no_position(self):
        enc = posenc.get("complex-vanilla", d_model=4, vocab_size=5)
        x, tok = torch.randn(1, 3, 4), torch.tensor([[1, 2, 3]])
        assert torch.allclose(
            enc.embed(x, torch.tensor([[0, 1, 2]]), tok), enc.embed(x, torch.tensor([[7, 9, 30]]), tok)
        )

    def test_needs_tokens_and_trains_in_a_model(self):
        enc = posenc.get("complex-order", d_model=4, vocab_size=5)
        with pytest.raises(ConfigError, match="token ids"):
            enc.embed(torch.randn(1, 2, 4), torch.arange(2)[None])
        model = posenc.SequenceClassifier(12, 2, encoding="complex-order", d_model=16, n_heads=2, n_layers=1)
        out = model(torch.randint(0, 12, (2, 5)))
        out.sum().backward()
        assert model.trunk.encoding.omega.grad is not None and model.trunk.encoding.theta.grad is not None
