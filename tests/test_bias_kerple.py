"""KERPLE ("kerple-log", "kerple-power") against the paper's kernel equations.

Truth: the paper's equations, power -r1 |m-n|^r2 and log -r1 log(1 + r2 |m-n|),
evaluated by hand with math.log / ** on small cases (exact to 1e-12 in float64) and
by a naive double loop over explicit positions with random per-head parameters
(float64, 1e-12). Fast (SDPA) == reference attention path at 1e-10 (float64).
"""

from __future__ import annotations

import math

import pytest
import torch

import posenc
from posenc import ConfigError, MultiHeadAttention
from posenc.base import AttentionContext
from posenc.bias.kerple import KerpleLog, KerplePower

D, H = 16, 4


def _set(enc, r1: list[float], r2: list[float]):
    """Set r1, r2 as the kernel will use them (through the chosen constraint)."""
    enc.init_r1, enc.init_r2 = None, None
    with torch.no_grad():
        if enc.constraint == "clamp":
            enc.raw_r1.copy_(torch.tensor(r1))
            enc.raw_r2.copy_(torch.tensor(r2))
        else:
            r1t, r2t = torch.tensor(r1, dtype=torch.float64), torch.tensor(r2, dtype=torch.float64)
            enc.raw_r1.copy_(r1t + torch.log(-torch.expm1(-r1t)))
            if enc.r2_max is None:
                enc.raw_r2.copy_(r2t + torch.log(-torch.expm1(-r2t)))
            else:
                p = r2t / enc.r2_max
                enc.raw_r2.copy_(torch.log(p) - torch.log1p(-p))
    return enc


@pytest.mark.parametrize("constraint", ["clamp", "softplus"])
def test_power_hand_computed(constraint: str) -> None:
    enc = _set(KerplePower(2, constraint=constraint).double(), [0.5, 2.0], [2.0, 0.5])
    m = enc.matrix(4)
    # head 0: -0.5 d^2, head 1: -2 sqrt(d), for d = |i - j|
    assert m[0, 3, 0].item() == pytest.approx(-4.5, abs=1e-12)
    assert m[0, 2, 1].item() == pytest.approx(-0.5, abs=1e-12)
    assert m[0, 1, 3].item() == pytest.approx(-2.0, abs=1e-12)
    assert m[1, 3, 0].item() == pytest.approx(-2 * math.sqrt(3), abs=1e-12)
    assert m[1, 0, 2].item() == pytest.approx(-2 * math.sqrt(2), abs=1e-12)
    assert torch.all(m.diagonal(dim1=-2, dim2=-1) == 0)


@pytest.mark.parametrize("constraint", ["clamp", "softplus"])
def test_log_hand_computed(constraint: str) -> None:
    enc = _set(KerpleLog(2, constraint=constraint).double(), [2.0, 0.25], [1.0, 3.0])
    m = enc.matrix(4)
    # head 0: -2 log(1 + d), head 1: -0.25 log(1 + 3 d)
    assert m[0, 1, 0].item() == pytest.approx(-2 * math.log(2), abs=1e-12)
    assert m[0, 0, 3].item() == pytest.approx(-2 * math.log(4), abs=1e-12)
    assert m[1, 3, 1].item() == pytest.approx(-0.25 * math.log(7), abs=1e-12)
    assert m[1, 2, 2].item() == 0.0


def naive(kind: str, r1, r2, q_pos, k_pos) -> torch.Tensor:
    b, lq, lk = max(q_pos.shape[0], k_pos.shape[0]), q_pos.shape[1], k_pos.shape[1]
    out = torch.zeros(b, len(r1), lq, lk, dtype=torch.float64)
    for n in range(b):
        qp, kp = q_pos[min(n, q_pos.shape[0] - 1)], k_pos[min(n, k_pos.shape[0] - 1)]
        for h in range(len(r1)):
            for i in range(lq):
                for j in range(lk):
                    d = abs(float(qp[i]) - float(kp[j]))
                    if kind == "power":
                        out[n, h, i, j] = -r1[h] * d ** r2[h]
                    else:
                        out[n, h, i, j] = -r1[h] * math.log(1 + r2[h] * d)
    return out


@pytest.mark.parametrize("kind", ["power", "log"])
def test_bias_equals_naive_loop_random_parameters(kind: str) -> None:
    cls = KerplePower if kind == "power" else KerpleLog
    enc = cls(H).double()
    r1 = enc.raw_r1.tolist()
    r2 = enc.raw_r2.tolist()
    q_pos = torch.tensor([[5, 6, 7], [40, 41, 42]])
    k_pos = torch.tensor([[0, 2, 5, 6, 7], [1, 30, 40, 41, 42]])
    ctx = AttentionContext(q_pos=q_pos, k_pos=k_pos, n_heads=H, head_dim=4)
    assert torch.allclose(enc.bias(ctx), naive(kind, r1, r2, q_pos, k_pos), atol=1e-12)


def test_power_r2_one_is_alibi_like() -> None:
    from posenc.bias.alibi import alibi_slopes

    enc = _set(KerplePower(4, eps=1e-3).double(), alibi_slopes(4), [1.0] * 4)  # 1/256 < the default eps
    alibi = posenc.get("alibi-bidirectional", n_heads=4).matrix(6)
    assert torch.allclose(enc.matrix(6), alibi, atol=1e-12)


def test_clamp_keeps_parameters_in_range_as_reference_code() -> None:
    enc = KerplePower(2, constraint="clamp")
    with torch.no_grad():
        enc.raw_r1.copy_(torch.tensor([-1.0, 0.3]))
        enc.raw_r2.copy_(torch.tensor([3.0, -0.5]))
    r1, r2 = enc.parameters_in_range()
    assert r1.tolist() == pytest.approx([0.01, 0.3]) and r2.tolist() == pytest.approx([2.0, 0.01])
    assert enc.raw_r2.tolist() == pytest.approx([2.0, 0.01])  # written back, as the reference code does
    soft = KerplePower(2, constraint="softplus")
    with torch.no_grad():
        soft.raw_r1.fill_(-30.0)
        soft.raw_r2.copy_(torch.tensor([50.0, -50.0]))
    r1, r2 = soft.parameters_in_range()
    assert torch.all(r1 > 0) and torch.all(r2 > 0) and torch.all(r2 <= 2)


@pytest.mark.parametrize("cls", [KerpleLog, KerplePower])
@pytest.mark.parametrize("constraint", ["clamp", "softplus"])
def test_gradients_reach_both_parameters(cls, constraint: str) -> None:
    mha = MultiHeadAttention(D, H, cls(H, constraint=constraint))
    x = torch.randn(2, 6, D)
    mha(x, causal=True).square().sum().backward()
    enc = mha.encoding
    for p in (enc.raw_r1, enc.raw_r2):
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0


def test_used_twice_in_one_graph_backward_works() -> None:
    mha = MultiHeadAttention(D, H, KerplePower(H))
    x = torch.randn(1, 5, D)
    (mha(x, causal=True).sum() + mha(x, causal=True).sum()).backward()
    assert torch.isfinite(mha.encoding.raw_r2.grad).all()


@pytest.mark.parametrize("cls", [KerpleLog, KerplePower])
def test_fast_equals_reference(cls) -> None:
    torch.manual_seed(3)
    enc = cls(H).double()
    fast = MultiHeadAttention(D, H, enc, path="fast").double()
    ref = MultiHeadAttention(D, H, enc, path="reference").double()
    ref.load_state_dict(fast.state_dict())
    x = torch.randn(2, 7, D, dtype=torch.float64)
    pad = torch.tensor([[1] * 7, [0, 0, 1, 1, 1, 1, 1]])
    pos = torch.tensor([[50, 51, 52, 53, 54, 55, 56], [0, 1, 2, 3, 4, 5, 6]])
    for kw in (dict(causal=True), dict(attention_mask=pad), dict(causal=True, positions=pos, attention_mask=pad)):
        assert torch.allclose(fast(x, **kw), ref(x, **kw), atol=1e-10), kw


@pytest.mark.parametrize("cls", [KerpleLog, KerplePower])
def test_translation_invariance(cls) -> None:
    mha = MultiHeadAttention(D, H, cls(H)).double()
    x = torch.randn(1, 8, D, dtype=torch.float64)
    a = mha(x, positions=torch.arange(8), causal=True)
    b = mha(x, positions=torch.arange(8) + 777, causal=True)
    assert torch.allclose(a, b, atol=1e-10)


@pytest.mark.parametrize("name", ["kerple-log", "kerple-power"])
def test_model_per_layer_parameters_trains_and_extrapolates(name: str) -> None:
    torch.manual_seed(0)
    model = posenc.LanguageModel(12, encoding=name, d_model=16, n_heads=4, n_layers=2, d_ff=16, max_len=16)
    encs = [b.attn.encoding for b in model.trunk.blocks]
    assert encs[0] is not encs[1]  # one KERPLE per layer, as the reference code
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        start = torch.randint(0, 12, (8, 1))
        loss = model.loss((start + torch.arange(12)) % 12)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    # last five / first five over seeds 0-5 (the manual_seed shifted), native kernels on and off: 0.10-0.17; no learning
    # stays near 1
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5
    model.eval()
    with torch.no_grad():
        logits = model(torch.randint(0, 12, (1, 200)))
    assert torch.isfinite(logits).all()


def test_card() -> None:
    for name in ("kerple-log", "kerple-power"):
        card = posenc.card(name)
        assert (card.family, card.position, card.learnable) == ("bias", "relative", True)


@pytest.mark.parametrize("r2", [2.5, 0.0, -1.0])
def test_power_r2_out_of_range(r2: float) -> None:
    with pytest.raises(ConfigError, match="r2"):
        KerplePower(4, r2=r2)


def test_bad_settings() -> None:
    with pytest.raises(ConfigError, match="n_heads"):
        KerpleLog(0)
    with pytest.raises(ConfigError, match="n_heads"):
        posenc.get("kerple-power", n_heads=-3)
    with pytest.raises(ConfigError, match="r1"):
        KerpleLog(2, r1=0.0)
    with pytest.raises(ConfigError, match="constraint"):
        KerpleLog(2, constraint="exp")
    with pytest.raises(ConfigError, match="eps"):
        KerpleLog(2, eps=0.0)
    KerpleLog(2, r2=5.0)  # the log kernel has no upper bound on r2
    enc = KerpleLog(4)
    ctx = AttentionContext(q_pos=torch.arange(3)[None], k_pos=torch.arange(3)[None], n_heads=2, head_dim=4)
    with pytest.raises(ConfigError, match="n_heads=4"):
        enc.bias(ctx)
