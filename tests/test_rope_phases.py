"""RoPE phases at any position: no table beyond what is used, exact offsets far out, float32 under dtype casts.

References: the angle ``m·θ_i`` with ``θ_i`` the float32 inverse frequency, reduced modulo 2π with
mpmath at 60 digits (the formula, independently of the float64 splitting the encoding uses).
"""

from __future__ import annotations

import copy
import time

import mpmath
import pytest
import torch

import posenc
from posenc import MultiHeadAttention
from posenc.base import AttentionContext

D = 16  # head width of the score tests
FLOAT32_EXACT = 2**24  # from here on float32 cannot represent every integer
FAR = [2**24, 2**30, 2**40]
# encodings whose q·k depends on the offset only (frequencies that do not depend on the length)
STATIC = {
    "rope": {},
    "rope-interleaved": {},
    "rope-linear": dict(factor=4.0),
    "rope-ntk": dict(factor=4.0),
    "rope-yarn": dict(factor=4.0, original_max_len=16),
    "rope-llama3": dict(factor=8.0, original_max_len=16),
    "xpos": {},
    "xpos-half": dict(interleaved=False),
}


def build(name: str, head_dim: int = D, **extra):
    if name == "xpos-half":
        name = "xpos"
    return posenc.get(name, head_dim=head_dim, **STATIC.get(name, {}), **extra)


def formula_cos_sin(m: int | float, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of m·θ_i in 60-digit arithmetic (θ_i exactly the float32 values)."""
    mpmath.mp.dps = 60
    angles = [mpmath.mpf(m) * mpmath.mpf(float(t)) for t in inv_freq.double()]
    cos = torch.tensor([float(mpmath.cos(a)) for a in angles], dtype=torch.float64)
    sin = torch.tensor([float(mpmath.sin(a)) for a in angles], dtype=torch.float64)
    return cos, sin


def score(enc, q: torch.Tensor, k: torch.Tensor, qp, kp) -> torch.Tensor:
    ctx = AttentionContext(q_pos=torch.tensor([qp]), k_pos=torch.tensor([kp]), n_heads=1, head_dim=q.shape[-1])
    rq, rk = enc.rotate(q, k, ctx)
    return (rq @ rk.transpose(-1, -2))[0, 0]


# ------------------------------------------------------------------- 1. only the positions in use
@pytest.mark.parametrize("m", [2**24, 2**24 + 1, 2**40, 2**62 + 12345])
def test_one_far_token_is_fast_builds_no_table_and_gives_the_formula(m):
    x = torch.randn(1, 1, 1, 64, dtype=torch.float64)
    posenc.get("rope", head_dim=64)(x)  # warm up (the native kernel may be built on first use)
    enc = posenc.get("rope", head_dim=64)
    start = time.perf_counter()
    y = enc(x, torch.tensor([[m]]))
    cos, sin = enc.cos_sin(torch.tensor([[m]]))
    assert time.perf_counter() - start < 2.0  # was: a table of 2**25 rows (12.8 GB, minutes) for 2**24
    assert enc._cos.numel() == 0 and enc._sin.numel() == 0  # no table for one far token
    want_cos, want_sin = formula_cos_sin(m, enc.inv_freq)
    # float32 cos/sin of an angle reduced in float64 and rounded once to float32 (<= 1.2e-7 rad)
    torch.testing.assert_close(cos[0, 0].double(), want_cos, rtol=0, atol=3e-7)
    torch.testing.assert_close(sin[0, 0].double(), want_sin, rtol=0, atol=3e-7)
    x1, x2 = x[..., :32], x[..., 32:]
    want = torch.cat([x1 * want_cos - x2 * want_sin, x2 * want_cos + x1 * want_sin], -1)
    torch.testing.assert_close(y, want, rtol=0, atol=1e-6)


def test_table_is_bounded_and_beyond_it_the_phases_are_the_same_numbers():
    enc = posenc.get("rope", head_dim=64)
    limit = enc.table_limit
    assert limit <= 1 << 16
    pos = torch.tensor([[0, 1, 5, limit - 1]])
    c_table, s_table = enc.cos_sin(pos)
    assert enc._cos.shape[0] <= limit
    # a call that reaches beyond the limit computes its positions directly, with the same numbers
    wide = torch.tensor([[0, 1, 5, limit - 1, limit, 3 * limit + 7]])
    c_direct, s_direct = enc.cos_sin(wide)
    assert enc._cos.shape[0] <= limit
    assert torch.equal(c_direct[:, :4], c_table) and torch.equal(s_direct[:, :4], s_table)
    a = wide[..., None].float() * enc.inv_freq  # HF's float32 phases
    assert torch.equal(c_direct, a.cos()) and torch.equal(s_direct, a.sin())


# --------------------------------------------------------------- 2. exact below 2**24, exact offsets beyond
def test_below_two_to_the_24_the_phases_are_hf_float32_bit_for_bit():
    pytest.importorskip("transformers")
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    d = 64
    cfg = LlamaConfig(hidden_size=2 * d, num_attention_heads=2, head_dim=d, max_position_embeddings=2**24)
    hf = LlamaRotaryEmbedding(cfg)
    g = torch.Generator().manual_seed(0)
    pos = torch.cat([torch.arange(40), torch.randint(0, FLOAT32_EXACT, (200,), generator=g)])
    pos = torch.cat([pos, torch.tensor([65535, 65536, FLOAT32_EXACT - 2, FLOAT32_EXACT - 1])])[None]
    want_cos, want_sin = hf(torch.zeros(1, dtype=torch.float32), pos)  # [1, L, d]: cat of the two halves
    enc = posenc.get("rope", head_dim=d)
    for chunk in (pos[:, :40], pos):  # from the table, and computed directly
        cos, sin = enc.cos_sin(chunk)
        n = chunk.shape[1]
        assert torch.equal(cos, want_cos[:, :n, : d // 2]) and torch.equal(sin, want_sin[:, :n, : d // 2])
    # float32 (and float64 values float32 represents) fractional positions: the same float32 product
    frac = torch.tensor([[0.5, 3.25, 1000.125, 2.0**23 + 0.5]])
    want = frac[..., None] * enc.inv_freq
    for p in (frac, frac.double()):
        cos, sin = enc.cos_sin(p)
        assert torch.equal(cos, want.cos()) and torch.equal(sin, want.sin())


@pytest.mark.parametrize("name", list(STATIC))
@pytest.mark.parametrize("far", FAR)
def test_scores_far_away_equal_the_scores_at_the_same_offsets_near_zero(name, far):
    enc = build(name)
    g = torch.Generator().manual_seed(far % 1000 + len(name))
    q = torch.randn(1, 1, 1, D, dtype=torch.float64, generator=g)
    k = torch.randn(1, 1, 1, D, dtype=torch.float64, generator=g)
    tol = 2e-6 * float(q.norm() * k.norm())  # float32 cos/sin: ~1.2e-7 rad per phase
    for offset in (0, 1, 2, 7, 100, 1234):
        near = score(enc, q, k, [offset], [0])
        got = score(enc, q, k, [far + offset], [far])
        torch.testing.assert_close(got, near, rtol=0, atol=tol, msg=lambda m, o=offset: f"offset {o}: {m}")
    # and a window of keys and queries, through the attention
    torch.manual_seed(0)
    att = MultiHeadAttention(2 * D, 2, enc, path="fast").double()
    x = torch.randn(1, 9, 2 * D, dtype=torch.float64)
    a = att(x, positions=torch.arange(9), causal=True)
    b = att(x, positions=torch.arange(9) + far, causal=True)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_length_dependent_variants_far_away_keep_offsets_within_one_regime():
    # longrope: every length beyond L uses the long factors, so scores at the same offsets agree
    enc = posenc.get(
        "rope-longrope",
        head_dim=8,
        short_factor=[1.0] * 4,
        long_factor=[1.0, 2.0, 3.0, 4.0],
        factor=4.0,
        original_max_len=16,
    )
    q, k = torch.randn(1, 1, 1, 8, dtype=torch.float64), torch.randn(1, 1, 1, 8, dtype=torch.float64)
    tol = 2e-6 * float(q.norm() * k.norm())
    for offset in (0, 3, 50):
        ref = score(enc, q, k, [100 + offset], [100])  # 100 > 16: the long factors
        for far in FAR:
            torch.testing.assert_close(score(enc, q, k, [far + offset], [far]), ref, rtol=0, atol=tol)
    # dynamic NTK: the base grows with the length; far out the phases are finite and no table is built
    dyn = posenc.get("rope-dynamic", head_dim=8, factor=4.0, original_max_len=16)
    cos, sin = dyn.cos_sin(torch.tensor([[2**40, 2**40 + 1]]))
    assert torch.isfinite(cos).all() and torch.isfinite(sin).all() and dyn._cos.numel() == 0


def test_float_positions_far_away_keep_their_fraction():
    enc = posenc.get("rope", head_dim=D)
    q, k = torch.randn(1, 1, 1, D, dtype=torch.float64), torch.randn(1, 1, 1, D, dtype=torch.float64)
    tol = 2e-6 * float(q.norm() * k.norm())

    def fscore(qp: float, kp: float) -> torch.Tensor:
        ctx = AttentionContext(
            q_pos=torch.tensor([[qp]], dtype=torch.float64),
            k_pos=torch.tensor([[kp]], dtype=torch.float64),
            n_heads=1,
            head_dim=D,
        )
        rq, rk = enc.rotate(q, k, ctx)
        return (rq * rk).sum()

    for far in FAR:
        for off in (0.25, 1.5, 17.75):
            torch.testing.assert_close(fscore(far + off, far), fscore(off, 0.0), rtol=0, atol=tol)
        cos, sin = enc.cos_sin(torch.tensor([[far + 0.5]], dtype=torch.float64))
        want_cos, want_sin = formula_cos_sin(mpmath.mpf(far) + mpmath.mpf(0.5), enc.inv_freq)
        torch.testing.assert_close(cos[0, 0].double(), want_cos, rtol=0, atol=3e-7)
        torch.testing.assert_close(sin[0, 0].double(), want_sin, rtol=0, atol=3e-7)


def test_rope_angles_reduce_into_minus_pi_pi_beyond_the_boundary_only():
    enc = posenc.get("rope", head_dim=8)
    theta = enc.inv_freq
    m = torch.tensor([[0], [FLOAT32_EXACT - 1], [FLOAT32_EXACT], [2**50 + 3], [2**63 - 1]])
    a = enc.angles(m[:, 0])
    assert a.dtype == torch.float32
    assert torch.equal(a[:2], m[:2].float() * theta)  # HF's float32 product below 2**24
    assert (a[2:].abs() <= torch.pi + 1e-6).all()


def test_2d_rope_far_rows_keep_offsets():
    enc = posenc.get("rope-2d", head_dim=D, grid_width=4)
    q, k = torch.randn(1, 1, 1, D, dtype=torch.float64), torch.randn(1, 1, 1, D, dtype=torch.float64)
    tol = 2e-6 * float(q.norm() * k.norm())
    far = 4 * 2**30  # row 2**30, column 0
    for dq in (0, 1, 5, 4 * 3 + 2):
        torch.testing.assert_close(score(enc, q, k, [far + dq], [far]), score(enc, q, k, [dq], [0]), rtol=0, atol=tol)
    assert enc._cos.shape[0] <= 16  # only the near positions' table


def test_compiled_far_positions_equal_eager():
    torch._dynamo.reset()
    torch.manual_seed(0)
    att = MultiHeadAttention(2 * D, 2, posenc.get("rope", head_dim=D), path="fast").eval()
    x = torch.randn(2, 5, 2 * D)
    for pos in (torch.arange(5), torch.arange(5) + 2**40):
        want = att(x, positions=pos)
        got = torch.compile(att, fullgraph=True, backend="aot_eager")(x, positions=pos)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------- 3. module dtype casts keep float32 phases
MODELS = {
    "rope": {},
    "rope-yarn": dict(factor=4.0, original_max_len=16),
    "rope-longrope": dict(short_factor=[1.0] * 8, long_factor=[2.0] * 8, factor=4.0, original_max_len=16),
    "xpos": {},
}


def phase_buffers(enc) -> dict[str, torch.Tensor]:
    names = ["inv_freq", "_cos", "_sin", "long_inv_freq", "zeta"]
    return {n: getattr(enc, n).clone() for n in names if hasattr(enc, n)}


@pytest.mark.parametrize("name", list(MODELS))
def test_double_and_bfloat16_models_keep_float32_phases(name):
    torch.manual_seed(0)
    model = posenc.LanguageModel(100, encoding=name, encoding_options=MODELS[name], d_model=32, n_heads=2)
    tokens = torch.randint(0, 100, (2, 20))
    want_logits = model(tokens)
    enc = model.trunk.encoding
    pos = torch.arange(20)[None]
    want = enc.cos_sin(pos)
    before = phase_buffers(enc)
    for cast in (lambda m: m.double(), lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.float()):
        other = cast(copy.deepcopy(model))
        e = other.trunk.encoding
        for n, t in phase_buffers(e).items():
            assert t.dtype == before[n].dtype and torch.equal(t, before[n]), n  # zeta stays float64
        got = e.cos_sin(pos)
        assert got[0].dtype == torch.float32
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    double = copy.deepcopy(model).double()
    torch.testing.assert_close(double(tokens).float(), want_logits, rtol=1e-4, atol=1e-4)
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    assert bf16(tokens).dtype == torch.bfloat16
    # the phase buffers are not part of the state: loading across dtypes works as before
    state = model.state_dict()
    assert not any(k.endswith(("inv_freq", "_cos", "_sin", "zeta")) for k in state)
    double.load_state_dict(state)
    bf16.load_state_dict(double.state_dict())


def test_to_device_still_moves_the_phase_buffers():
    enc = posenc.get("xpos", head_dim=8)
    enc.cos_sin(torch.arange(4)[None])  # a table to move too
    moved = copy.deepcopy(enc).to("meta", torch.float64)
    for n, t in phase_buffers(moved).items():
        assert t.device.type == "meta", n
    assert moved.inv_freq.dtype == torch.float32 and moved._cos.dtype == torch.float32
    assert moved.zeta.dtype == torch.float64
    assert copy.deepcopy(enc).to("meta").inv_freq.device.type == "meta"


def test_2d_rope_follows_float64_casts_but_not_half_precision_ones():
    enc = posenc.get("rope-2d", head_dim=8, grid_width=4)
    theta = enc.inv_freq.clone()
    assert copy.deepcopy(enc).to(torch.bfloat16).inv_freq.dtype == torch.float32
    assert torch.equal(copy.deepcopy(enc).half().inv_freq, theta)
    double = copy.deepcopy(enc).double()
    assert double.inv_freq.dtype == torch.float64  # as before: float64 phases for a float64 model
    assert torch.equal(double.float().inv_freq, theta)
