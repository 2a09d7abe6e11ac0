"""The speed-ups of benchmarks/ change no number beyond floating-point rounding.

* ``_BiasedSDPA`` (flash forward + chunked backward for a learnable float mask) against the plain
  ``softmax(q kᵀ · s + bias) v`` written out, float64, every broadcast shape of the bias, masked entries,
  several chunk sizes: outputs and the gradients of q, k, v and the bias to 1e-12.
* Every encoding with a ``logits``/``bias`` hook: the fast attention (which now takes that path when the mask
  needs a gradient) against the reference path, float64, padding, lengths beyond the clip distances:
  outputs and the gradients of every parameter to 1e-9.
* RoPE's one-pass rotations (complex multiply for the interleaved layout, the fused rotate-half node)
  against the literal formula (the previous code path), float64, partial ``rotary_dim``, offset positions,
  gradients; and the fallback for a view that cannot be seen as complex.
* The forms used only while ``torch.compile`` traces (Transformer-XL/TENER/XLNet with positions of unknown
  spacing, dynamic NTK, xPos's centre, KERPLE's clamp) against eager, with ``backend="aot_eager"``.
"""

from __future__ import annotations

import pytest
import torch

import posenc  # noqa: F401
import posenc.attention.sdpa as attention_module
import posenc.rotary.rope as rope_module
from posenc import native
from posenc.attention import MultiHeadAttention, _BiasedSDPA
from posenc.base import AttentionContext
from posenc.registry import accepted_arguments, available, build, example_options, get, resolve

TOL64 = dict(rtol=1e-9, atol=1e-12)


def _naive(q, k, v, bias, scale):
    return torch.softmax(q @ k.transpose(-1, -2) * scale + bias, dim=-1) @ v


@pytest.mark.parametrize("bias_shape", [(1, 3, 5, 9), (2, 3, 5, 9), (2, 1, 5, 9), (1, 1, 5, 9)])
@pytest.mark.parametrize("chunk", [1, 9 * 8 * 2, 1 << 30])  # blocks of 1 query row, 2 rows, all rows
def test_biased_sdpa_matches_the_formula(bias_shape, chunk, monkeypatch) -> None:
    monkeypatch.setattr(attention_module, "_CHUNK_BYTES", chunk)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, n, 4, generator=g, dtype=torch.float64, requires_grad=True) for n in (5, 9, 9))
    bias = torch.randn(*bias_shape, generator=g, dtype=torch.float64, requires_grad=True)
    hidden = torch.rand(bias_shape, generator=g) < 0.3
    hidden[..., 0] = False  # every query keeps a key
    mask = bias.masked_fill(hidden, torch.finfo(torch.float64).min)
    grad_out = torch.randn(2, 3, 5, 4, generator=g, dtype=torch.float64)

    got = _BiasedSDPA.apply(q, k, v, mask, 0.37)
    g_got = torch.autograd.grad((got * grad_out).sum(), (q, k, v, bias), retain_graph=True)
    want = _naive(q, k, v, mask, 0.37)
    g_want = torch.autograd.grad((want * grad_out).sum(), (q, k, v, bias))
    torch.testing.assert_close(got, want, **TOL64)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, **TOL64)


def test_biased_sdpa_is_used_only_where_it_applies() -> None:
    q = torch.zeros(1, 1, 2, 2)
    learnable = torch.zeros(1, 1, 2, 2, requires_grad=True)
    assert attention_module._use_biased_sdpa(q, learnable, 0.0, False)
    assert not attention_module._use_biased_sdpa(q, learnable.detach(), 0.0, False)  # flash takes it anyway
    assert not attention_module._use_biased_sdpa(q, learnable, 0.1, False)  # dropout: SDPA's own path
    with torch.no_grad():
        assert not attention_module._use_biased_sdpa(q, learnable, 0.0, False)


def _mask_encodings() -> list[str]:
    out = []
    for n in available():
        hooks = resolve(n).hooks()
        if hooks & {"logits", "bias"} and "values" not in hooks:
            out.append(n)
    return out


# clip and bucket distances short enough for the 19 tokens below to go past them, for every encoding that takes
# them (by setting name: no list of encodings); settings no size supplies come from the encoding's example_options
SHORT = {"num_buckets": 8, "max_distance": 6, "position_buckets": 4, "max_len": 8, "clip": True}


def short_options(name: str, dims: dict) -> dict:
    accepted = accepted_arguments(resolve(name))
    return {**example_options(name, dims), **{k: v for k, v in SHORT.items() if k in accepted}}


@pytest.mark.parametrize("name", _mask_encodings())
def test_fast_attention_with_learnable_mask_equals_reference(name: str, monkeypatch) -> None:
    calls = []
    real_apply = _BiasedSDPA.apply
    monkeypatch.setattr(_BiasedSDPA, "apply", lambda *a: calls.append(1) or real_apply(*a))
    dims = dict(d_model=16, n_heads=2, head_dim=8, max_len=32, n_layers=1, causal=False, vocab_size=50)
    torch.manual_seed(0)
    causal = name == "cope"
    enc = build(name, dims=dict(dims, causal=causal), options=short_options(name, dims))
    fast = MultiHeadAttention(16, 2, enc, path="fast").double()
    fast.fused = False  # the row-blocked kernel of posenc.fused has its own tests (tests/test_fused.py)
    ref = MultiHeadAttention(16, 2, enc, path="reference").double()
    ref.load_state_dict(fast.state_dict())
    x = torch.randn(2, 19, 16, dtype=torch.float64)  # 19 > every clip distance above
    pad = torch.ones(2, 19, dtype=torch.bool)
    pad[1, 15:] = False
    kw = dict(attention_mask=pad, causal=causal)
    outs, grads = [], []
    for layer in (fast, ref):
        layer.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_()
        out = layer(xx, **kw)
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        outs.append(out)
        grads.append([xx.grad] + [p.grad for p in layer.parameters()])
    needs_grad = "logits" in enc.hooks() or any(p.requires_grad for p in enc.parameters())
    assert bool(calls) == needs_grad  # the fast path took the flash + chunked-backward route exactly then
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-9, atol=1e-10)
    for a, b in zip(*grads):
        if b is None:
            assert a is None or not a.any()
            continue
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)


# ------------------------------------------------------------------------------------------- RoPE
ROPES = [
    ("rope", {}),
    ("rope-interleaved", {}),
    ("rope", {"rotary_dim": 4}),
    ("rope-interleaved", {"rotary_dim": 6}),
    ("xpos", {}),
    ("rope-yarn", {"factor": 4.0, "original_max_len": 8}),
    ("rope-linear", {"factor": 2.0}),
]


@pytest.mark.parametrize(("name", "kw"), ROPES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_one_pass_rotation_equals_literal_formula(name, kw, dtype, monkeypatch) -> None:
    enc = get(name, head_dim=8, **kw)
    g = torch.Generator().manual_seed(1)
    # q as the attention makes it: a [B, H, L, Dh] view of a [B, L, H·Dh] projection
    q = torch.randn(2, 13, 3 * 8, generator=g, dtype=dtype).view(2, 13, 3, 8).transpose(1, 2).requires_grad_()
    k = torch.randn(2, 3, 13, 8, generator=g, dtype=dtype, requires_grad=True)
    pos = torch.randint(0, 60, (2, 13), generator=g)
    w = torch.randn(2, 3, 13, 8, generator=g, dtype=dtype)

    def run():
        ctx = AttentionContext(q_pos=pos, k_pos=pos + 3, n_heads=3, head_dim=8)
        a, b = enc.rotate(q, k, ctx)
        return (a, b), torch.autograd.grad(((a * w).sum() + (b * w.flip(-1)).sum()), (q, k))

    native_run = run()  # the compiled one-pass kernel where it applies (posenc.native)
    monkeypatch.setattr(native, "enabled", False)
    torch_run = run()  # PyTorch's one-pass forms (complex multiply, four half-width ops)
    monkeypatch.setattr(rope_module, "_fast_rotation", lambda *a: False)
    literal = run()  # the formula as written
    tol = TOL64 if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    for fast in (native_run, torch_run):
        for x, y in zip((*fast[0], *fast[1]), (*literal[0], *literal[1])):
            torch.testing.assert_close(x, y, **tol)


def test_interleaved_rotation_of_an_odd_offset_view_falls_back() -> None:
    enc = get("rope-interleaved", head_dim=8)
    base = torch.randn(2, 3, 5, 9, dtype=torch.float64)
    x = base[..., 1:]  # storage offset 1: not viewable as complex
    assert not rope_module._complex_view_ok(x)
    pos = torch.arange(5)[None]
    got = enc(x, pos)
    cos, sin = enc.cos_sin(pos)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    c, s = cos[:, None], sin[:, None]
    want = torch.stack((x0 * c - x1 * s, x1 * c + x0 * s), dim=-1).flatten(-2)
    torch.testing.assert_close(got, want, **TOL64)


def test_rotate_half_double_backward() -> None:
    enc = get("rope", head_dim=4)
    x = torch.randn(1, 1, 3, 4, dtype=torch.float64, requires_grad=True)
    pos = torch.arange(3)[None]
    assert torch.autograd.gradgradcheck(lambda t: enc(t, pos), (x,))


# --------------------------------------------------------------------------- forms used while compiling
def _compiled_equals_eager(layer: torch.nn.Module, x: torch.Tensor, **kw) -> None:
    torch._dynamo.reset()
    want = layer(x, **kw)
    got = torch.compile(layer, fullgraph=True, backend="aot_eager")(x, **kw)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["transformer-xl", "tener", "xlnet"])
def test_compiled_skew_with_explicit_gappy_positions(name: str) -> None:
    torch.manual_seed(0)
    enc = build(name, dims=dict(d_model=16, n_heads=2, head_dim=8, max_len=64, n_layers=1, causal=False))
    layer = MultiHeadAttention(16, 2, enc, path="fast").eval()
    pos = torch.tensor([[0, 2, 3, 7, 8, 20], [5, 6, 9, 10, 11, 40]])  # not contiguous: the "pairs" form
    _compiled_equals_eager(layer, torch.randn(2, 6, 16), positions=pos)


def test_compiled_dynamic_ntk_beyond_and_within_the_trained_length() -> None:
    enc = get("rope-dynamic", head_dim=8, factor=4.0, original_max_len=6)
    layer = MultiHeadAttention(16, 2, enc, path="fast").eval()
    x = torch.randn(1, 5, 16)
    _compiled_equals_eager(layer, x)  # within: the plain frequencies
    _compiled_equals_eager(layer, x, positions=torch.arange(20, 25))  # beyond: a rescaled base


def test_compiled_xpos_centre_with_offset_positions() -> None:
    layer = MultiHeadAttention(16, 2, get("xpos", head_dim=8), path="fast").eval()
    _compiled_equals_eager(layer, torch.randn(1, 5, 16), positions=torch.tensor([3, 9, 10, 30, 31]))


@pytest.mark.parametrize("name", ["kerple-log", "kerple-power"])
def test_compiled_kerple_clamps_like_eager(name: str) -> None:
    enc = get(name, n_heads=2)
    with torch.no_grad():
        enc.raw_r1.fill_(-1.0)  # out of range: both paths clamp before use
    layer = MultiHeadAttention(16, 2, enc, path="fast").eval()
    x = torch.randn(1, 6, 16)
    torch._dynamo.reset()
    got = torch.compile(layer, fullgraph=True, backend="aot_eager")(x)
    assert float(enc.raw_r1.min()) == pytest.approx(enc.eps)  # the compiled graph wrote the clamp back
    torch.testing.assert_close(got, layer(x), rtol=1e-5, atol=1e-6)


# -------------------------------------------------------------------------------- Toeplitz biases
@pytest.mark.parametrize(("lq", "lk"), [(1, 1), (1, 6), (6, 1), (4, 4), (3, 7), (7, 3)])
def test_toeplitz_layout_and_diagonal_sum_gradient(lq: int, lk: int) -> None:
    from posenc.relative._skew import toeplitz

    g = torch.Generator().manual_seed(lq * 10 + lk)
    vals = torch.randn(3, lq + lk - 1, generator=g, dtype=torch.float64, requires_grad=True)
    got = toeplitz(vals, lq, lk)
    want = torch.empty(1, 3, lq, lk, dtype=torch.float64)
    for i in range(lq):
        for j in range(lk):
            want[0, :, i, j] = vals.detach()[:, j - i + lq - 1]
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert got.is_contiguous()
    w = torch.randn(1, 3, lq, lk, generator=g, dtype=torch.float64)
    (grad,) = torch.autograd.grad((got * w).sum(), vals)
    expected = torch.zeros(3, lq + lk - 1, dtype=torch.float64)
    for i in range(lq):
        for j in range(lk):
            expected[:, j - i + lq - 1] += w[0, :, i, j]
    torch.testing.assert_close(grad, expected, **TOL64)


@pytest.mark.parametrize("name", ["t5", "relative-bias", "kerple-log", "kerple-power", "alibi", "alibi-bidirectional"])
def test_toeplitz_bias_equals_the_per_pair_bias(name: str) -> None:
    """The offset-only form (positions the attention made) equals the per-pair form (explicit positions)."""
    torch.manual_seed(0)
    enc = build(name, dims=dict(d_model=16, n_heads=2, head_dim=8, max_len=64, n_layers=1, causal=False))
    layer = MultiHeadAttention(16, 2, enc, path="fast").double()
    x = torch.randn(2, 23, 16, dtype=torch.float64)
    grads = []
    outs = []
    for positions in (None, torch.arange(23)):  # None: arange made inside (Toeplitz); explicit: per pair
        layer.zero_grad(set_to_none=True)
        out = layer(x, positions=positions)
        (out * torch.cos(torch.arange(out.numel(), dtype=out.dtype)).view_as(out)).sum().backward()
        outs.append(out)
        grads.append([p.grad for p in enc.parameters()])
    torch.testing.assert_close(outs[0], outs[1], **TOL64)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
