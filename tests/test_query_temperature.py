"""The query temperatures (posenc.temperature): qtemp-llama4, qtemp-mistral3 and ssmax.

The truths they are compared with:

* Llama 4's and Mistral 3's temperatures: transformers' own attention layers (``Llama4TextAttention`` on a NoPE
  layer, ``Ministral3Attention`` with its YaRN) given the same weights, in float64, prefill and KV-cache steps;
* SSMax: the paper's formula written out here (the logits materialised, multiplied by ``s log n`` with ``n`` the
  keys each query attends, softmax), at random shapes, causal and bidirectional, with left padding; the gradient of
  ``s`` by ``torch.autograd.gradcheck``;
* every temperature: greedy generation with and without a KV cache, the inner encoding's hooks unchanged, and clear
  errors for bad settings.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch

import posenc
from posenc.analysis import measure
from posenc.errors import ConfigError, UnknownNameError
from posenc.temperature.llama4 import Llama4Temperature
from posenc.temperature.mistral3 import Mistral3Temperature
from posenc.temperature.ssmax import SSMax

NAMES = ("qtemp-llama4", "qtemp-mistral3", "ssmax")
D, H = 64, 4
DH = D // H


def _copy_projections(attn: posenc.MultiHeadAttention, hf) -> None:
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(attn, name).weight.copy_(getattr(hf, name).weight)


def _additive(allowed: torch.Tensor) -> torch.Tensor:
    """A boolean mask [B, 1, Lq, Lk] as transformers' additive one (0 / -inf)."""
    zero = torch.zeros(allowed.shape, dtype=torch.float64)
    return zero.masked_fill(~allowed, float("-inf"))


def _causal(lq: int, lk: int) -> torch.Tensor:
    return torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)[None, None]


# ---------------------------------------------------------------------------------------------- Llama 4
def _llama4_layer(floor_scale: int, attn_scale: float):
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama4.modeling_llama4 import Llama4TextAttention

    cfg = transformers.Llama4TextConfig(
        hidden_size=D,
        intermediate_size=D,
        intermediate_size_mlp=D,
        num_hidden_layers=2,
        num_attention_heads=H,
        num_key_value_heads=H,
        head_dim=DH,
        vocab_size=50,
        floor_scale=floor_scale,
        attn_scale=attn_scale,
        no_rope_layers=[1, 0],  # layer 1 has no RoPE: the temperature's layer
        attention_bias=False,
    )
    cfg._attn_implementation = "sdpa"  # float64 throughout (the eager path is float64 too)
    torch.manual_seed(0)
    hf = Llama4TextAttention(cfg, 1).double().eval()
    assert not hf.use_rope and hf.attn_temperature_tuning
    return cfg, hf


@pytest.mark.parametrize("floor_scale,attn_scale", [(4, 0.5), (3, 0.1), (8192, 0.1)])
def test_llama4_matches_transformers_nope_layer_prefill_and_cache(floor_scale, attn_scale):
    from transformers import DynamicCache

    cfg, hf = _llama4_layer(floor_scale, attn_scale)
    enc = posenc.get("qtemp-llama4", floor_scale=float(floor_scale), attn_scale=attn_scale)
    attn = posenc.MultiHeadAttention(D, H, enc, bias=False).double().eval()
    _copy_projections(attn, hf)
    torch.manual_seed(1)
    x = torch.randn(2, 30, D, dtype=torch.float64)
    with torch.no_grad():
        want = hf(x, position_embeddings=None, attention_mask=_additive(_causal(30, 30)))[0]
        got = attn(x, causal=True)
    assert (got - want).abs().max() < 1e-12
    # prefill 7 tokens, then one at a time: transformers reads the positions from its cache, posenc from its own
    cache, kv = DynamicCache(config=cfg), posenc.KVCache()
    # the cache's argument: ``cache`` since transformers 5.24 (which warns on the old name), ``past_key_values`` before
    name = "cache" if "cache" in inspect.signature(type(hf).forward).parameters else "past_key_values"
    with torch.no_grad():
        outs_hf = [hf(x[:, :7], None, _additive(_causal(7, 7)), **{name: cache})[0]]
        outs = [attn(x[:, :7], causal=True, kv_cache=kv)]
        for t in range(7, 30):
            outs_hf.append(hf(x[:, t : t + 1], None, None, **{name: cache})[0])
            outs.append(attn(x[:, t : t + 1], causal=True, kv_cache=kv))
    assert (torch.cat(outs, 1) - torch.cat(outs_hf, 1)).abs().max() < 1e-12
    assert (torch.cat(outs, 1) - want).abs().max() < 1e-12


def test_llama4_factor_is_transformers_formula_at_far_positions():
    # the factor alone, at positions up to 2**20 (blocks of 8192), against transformers' expression in float32
    enc = posenc.get("qtemp-llama4")
    p = torch.tensor([[0, 1, 8190, 8191, 8192, 16383, 16384, 100_000, 1 << 20]])
    want = torch.log1p(torch.floor((p.float() + 1.0) / 8192)) * 0.1 + 1.0
    assert torch.equal(enc.factors(p), want)
    assert enc.factors(p)[0, :3].eq(1).all() and enc.factors(p)[0, 3] == pytest.approx(1 + 0.1 * math.log(2))


# ---------------------------------------------------------------------------------------------- Mistral 3
def _ministral3(beta: float, original: int, factor: float):
    transformers = pytest.importorskip("transformers")
    from transformers.models.ministral3.modeling_ministral3 import Ministral3Attention, Ministral3RotaryEmbedding

    rope = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": factor,
        "original_max_position_embeddings": original,
        "max_position_embeddings": int(original * factor),
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "llama_4_scaling_beta": beta,
    }
    cfg = transformers.Ministral3Config(
        hidden_size=D,
        intermediate_size=D,
        num_hidden_layers=2,
        num_attention_heads=H,
        num_key_value_heads=H,
        head_dim=DH,
        vocab_size=50,
        max_position_embeddings=int(original * factor),
        rope_parameters=rope,
    )
    cfg._attn_implementation = "sdpa"  # the eager path takes its softmax in float32
    torch.manual_seed(0)
    hf = Ministral3Attention(cfg, 0).double().eval()
    rotary = Ministral3RotaryEmbedding(cfg)
    return cfg, hf, rotary


def _mistral3_posenc(beta: float, original: int, factor: float, inner: str = "rope-yarn"):
    options = dict(factor=factor, base=10000.0, beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)
    enc = posenc.get(
        "qtemp-mistral3",
        head_dim=DH,
        inner=inner,
        inner_options=options if inner == "rope-yarn" else None,
        beta=beta,
        original_max_len=original,
    )
    assert enc.inner.params.get("original_max_len", original) == original  # shared with YaRN, as transformers does
    return enc


@pytest.mark.parametrize("beta,original,factor", [(0.1, 16, 4.0), (0.7, 5, 8.0)])
def test_mistral3_matches_transformers_with_yarn(beta, original, factor):
    cfg, hf, rotary = _ministral3(beta, original, factor)
    attn = posenc.MultiHeadAttention(D, H, _mistral3_posenc(beta, original, factor), bias=False).double().eval()
    _copy_projections(attn, hf)
    torch.manual_seed(2)
    b, n = 2, 40
    x = torch.randn(b, n, D, dtype=torch.float64)
    # left padding (rows shifted by 0 and 3 tokens) with transformers' positions, and a start past one context
    pad = torch.tensor([0, 3])
    real = torch.arange(n)[None, :] >= pad[:, None]
    pos = (torch.arange(n)[None, :] - pad[:, None]).clamp(min=0) + 2 * original + 1
    allowed = _causal(n, n) & real[:, None, None, :]
    with torch.no_grad():
        cos, sin = rotary(x, pos)
        want = hf(x, (cos, sin), _additive(allowed), position_ids=pos)[0]
        got = attn(x, causal=True, positions=pos, attention_mask=real)
    sees = allowed.any(-1)[:, 0]  # rows that see a key (a padding query that sees none is NaN in transformers)
    assert sees.sum() == b * n - 3
    assert (got - want)[sees].abs().max() < 1e-12


def test_mistral3_factor_is_transformers_helper():
    pytest.importorskip("transformers")
    from transformers.models.ministral3.modeling_ministral3 import get_llama_4_attn_scale

    enc = posenc.get("qtemp-mistral3", beta=0.25, original_max_len=7)
    p = torch.tensor([[0, 6, 7, 13, 14, 100, 1000, 123456]])
    want = get_llama_4_attn_scale(p, 0.25, 7)  # [B, 1, L, 1]
    assert torch.equal(enc.factor(torch.empty(0), _Ctx(p)), want)


class _Ctx:
    """The part of an AttentionContext the position factors read."""

    def __init__(self, q_pos):
        self.q_pos = q_pos


def test_mistral3_original_max_len_defaults_to_the_model_length():
    assert posenc.get("qtemp-mistral3", max_len=48).original_max_len == 48
    enc = posenc.get("qtemp-mistral3", head_dim=8, max_len=48, inner="rope-yarn", inner_options={"factor": 2.0})
    assert enc.inner.original_max_len == 48
    # the inner encoding's own setting wins over the shared one
    enc = posenc.get(
        "qtemp-mistral3",
        head_dim=8,
        max_len=48,
        inner="rope-yarn",
        inner_options={"factor": 2.0, "original_max_len": 9},
    )
    assert enc.original_max_len == 48 and enc.inner.original_max_len == 9


# ---------------------------------------------------------------------------------------------- SSMax
def ssmax_reference(attn, x, s, b, *, causal, attention_mask=None):
    """The paper's formula, written out: softmax over the allowed keys of (s_h log n_i + b_h) · q_i·k_j / sqrt(d)."""
    bsz, n, _ = x.shape
    q, k, v = (
        getattr(attn, p)(x).view(bsz, n, attn.n_heads, -1).transpose(1, 2) for p in ("q_proj", "k_proj", "v_proj")
    )
    logits = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # [B, H, L, L]
    allowed = torch.ones(bsz, 1, n, n, dtype=torch.bool)
    if causal:
        allowed = allowed & torch.ones(n, n, dtype=torch.bool).tril()
    if attention_mask is not None:
        allowed = allowed & attention_mask[:, None, None, :]
    counts = allowed.sum(-1, keepdim=True).to(x.dtype)  # [B, 1, L, 1]: the size of each query's softmax
    multiplier = s[None, :, None, None] * torch.log(counts.clamp(min=1)) + b[None, :, None, None]
    logits = (multiplier * logits).masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # a query that sees no key: zeros
    out = (probs @ v).transpose(1, 2).reshape(bsz, n, -1)
    return attn.o_proj(out)


def _ssmax_attention(n_heads, head_dim, seed, learn_bias=False, **options):
    torch.manual_seed(seed)
    enc = posenc.get("ssmax", n_heads=n_heads, max_len=64, learn_bias=learn_bias, **options)
    attn = posenc.MultiHeadAttention(n_heads * head_dim, n_heads, enc).double().eval()
    with torch.no_grad():  # heads apart, and b away from 0
        enc.s.copy_(0.1 + torch.rand(n_heads, dtype=torch.float64))
        if enc.b is not None:
            enc.b.copy_(torch.randn(n_heads, dtype=torch.float64))
    return attn, enc


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("causal", [True, False])
def test_ssmax_matches_the_paper_formula_at_random_shapes(seed, causal):
    g = torch.Generator().manual_seed(seed)
    n_heads = int(torch.randint(1, 5, (1,), generator=g))
    head_dim = int(torch.randint(1, 5, (1,), generator=g)) * 2
    bsz, n = int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(1, 40, (1,), generator=g))
    attn, enc = _ssmax_attention(n_heads, head_dim, seed, learn_bias=seed % 2 == 1, causal=causal)
    x = torch.randn(bsz, n, n_heads * head_dim, generator=g, dtype=torch.float64)
    b = enc.b if enc.b is not None else torch.zeros(n_heads, dtype=torch.float64)
    with torch.no_grad():
        got = attn(x, causal=causal)
        want = ssmax_reference(attn, x, enc.s, b, causal=causal)
        assert (got - want).abs().max() < 1e-12
        # left padding: each row's first tokens are padding (the keys a query attends are the unpadded ones)
        pad = torch.randint(0, n, (bsz,), generator=g)
        real = torch.arange(n)[None, :] >= pad[:, None]
        got = attn(x, causal=causal, attention_mask=real)
        want = ssmax_reference(attn, x, enc.s, b, causal=causal, attention_mask=real)
        assert (got - want).abs().max() < 1e-12
    assert attn.last_plan.kernel == "sdpa" or n * n >= attn.encoding.fused_min_pairs


def test_ssmax_counts_the_keys_each_query_attends():
    # the multiplier of each query is s · log(n_i): n_i = i + 1 causal, L bidirectional, the unpadded keys with padding
    enc = posenc.get("ssmax", n_heads=1, max_len=64, s_init=1.0)
    attn = posenc.MultiHeadAttention(8, 1, enc)
    seen = {}

    def spy(q, k, ctx):
        seen["factor"] = enc.factor(q, ctx)[0, 0, :, 0]
        return q, k

    enc._inner_rotates, enc.inner.rotate = True, spy
    x = torch.randn(2, 6, 8)
    attn(x, causal=True)
    assert torch.allclose(seen["factor"], torch.arange(1, 7).float().log())
    attn(x)
    assert torch.allclose(seen["factor"], torch.full((6,), math.log(6)))
    attn(x, attention_mask=torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]).bool())
    assert torch.allclose(seen["factor"], torch.full((6,), math.log(4)))  # row 0: four keys
    attn(x, causal=True, attention_mask=torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6]).bool())
    assert torch.allclose(seen["factor"], torch.tensor([1, 1, 1, 2, 3, 4]).float().log())  # n = 0 counts as 1


def test_ssmax_counts_keys_by_position_where_the_mask_is_not_known_yet():
    # posenc.hf and the probes of posenc inspect rotate before the mask exists (ctx.n_keys is None): n is then the
    # keys at positions up to the query's (causal) or every key
    from posenc.base import AttentionContext
    from posenc.temperature.ssmax import key_counts

    def ctx(q, k):
        return AttentionContext(q_pos=torch.tensor(q), k_pos=torch.tensor(k), n_heads=1, head_dim=2)

    assert key_counts(ctx([[3, 4, 5]], [[0, 1, 2, 3, 4, 5]]), True).tolist() == [[[4, 5, 6]]]
    assert key_counts(ctx([[7]], [[2, 3, 4, 5, 6, 7]]), True).tolist() == [[[6]]]  # a cache from position 2
    assert key_counts(ctx([[2, 4], [3, 9]], [[0, 2, 4], [1, 3, 9]]), True).tolist() == [[[2, 3]], [[2, 3]]]
    assert key_counts(ctx([[3, 4, 5]], [[0, 1, 2, 3, 4, 5]]), False).tolist() == [[[6, 6, 6]]]
    known = ctx([[5]], [[5]])
    known.n_keys = 6  # a KV-cache step: its k_pos holds the new key only, n_keys all of them
    assert key_counts(known, True).tolist() == [[[6]]]


def test_ssmax_gradient_of_s_and_b_by_gradcheck():
    attn, enc = _ssmax_attention(2, 2, 0, learn_bias=True)
    x = torch.randn(2, 5, 4, dtype=torch.float64)
    real = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]]).bool()

    def out(s, b):
        params = {"encoding.s": s, "encoding.b": b}
        return torch.func.functional_call(attn, params, (x,), dict(causal=True, attention_mask=real))

    s = enc.s.detach().clone().requires_grad_(True)
    b = enc.b.detach().clone().requires_grad_(True)
    assert torch.autograd.gradcheck(out, (s, b))
    # and the gradient equals the written-out formula's
    y = torch.randn(2, 5, 4, dtype=torch.float64)
    gs, gb = torch.autograd.grad((out(s, b) * y).sum(), (s, b))
    rs, rb = torch.autograd.grad((ssmax_reference(attn, x, s, b, causal=True, attention_mask=real) * y).sum(), (s, b))
    assert torch.allclose(gs, rs, atol=1e-12) and torch.allclose(gb, rb, atol=1e-12)


def test_ssmax_initial_s():
    # causal: 1 / mean(log n for n = 1..L) (0.1685 at the 1024 tokens of the paper's pretraining); bidirectional:
    # 1 / log L; s_init by hand
    s = posenc.get("ssmax", n_heads=3, max_len=1024).s
    assert s.shape == (3,) and s[0].item() == pytest.approx(1024 / sum(math.log(n) for n in range(1, 1025)))
    assert s[0].item() == pytest.approx(0.1685, abs=1e-4)
    assert posenc.get("ssmax", n_heads=1, max_len=100, causal=False).s.item() == pytest.approx(1 / math.log(100))
    enc = posenc.get("ssmax", n_heads=2, s_init=0.43, learn_bias=True)
    assert enc.s.tolist() == pytest.approx([0.43, 0.43]) and enc.b.tolist() == [0.0, 0.0]
    with torch.no_grad():
        enc.s.fill_(3.0)
    enc.reset_parameters()
    assert enc.s.tolist() == pytest.approx([0.43, 0.43])


def test_ssmax_has_s_per_layer_and_head():
    model = posenc.LanguageModel(20, encoding="ssmax", d_model=16, n_heads=2, n_layers=3, max_len=32)
    ss = [blk.attn.encoding.s for blk in model.trunk.blocks]
    assert len({id(s) for s in ss}) == 3 and all(s.shape == (2,) for s in ss)
    # an inner encoding the layers share stays shared (T5's one table); one per layer stays per layer (Shaw)
    model = posenc.LanguageModel(
        20, encoding="ssmax", encoding_options={"inner": "t5"}, d_model=16, n_heads=2, n_layers=2, max_len=32
    )
    inners = [blk.attn.encoding.inner for blk in model.trunk.blocks]
    assert inners[0] is inners[1] and model.trunk.blocks[0].attn.encoding is not model.trunk.blocks[1].attn.encoding


def test_ssmax_kv_cache_with_left_padding_equals_the_whole_forward():
    attn, enc = _ssmax_attention(2, 4, 3, learn_bias=True)
    x = torch.randn(2, 12, 8, dtype=torch.float64)
    real = torch.ones(2, 12, dtype=torch.bool)
    real[0, :4] = False
    with torch.no_grad():
        whole = attn(x, causal=True, attention_mask=real)
        kv = posenc.KVCache()
        steps = [attn(x[:, :5], causal=True, attention_mask=real[:, :5], kv_cache=kv)]
        for t in range(5, 12):
            steps.append(attn(x[:, t : t + 1], causal=True, attention_mask=real[:, : t + 1], kv_cache=kv))
    assert (torch.cat(steps, 1) - whole).abs().max() < 1e-12


# ---------------------------------------------------------------------------------------------- every temperature
CASES = [
    ("qtemp-llama4", dict(floor_scale=3.0, attn_scale=0.5)),
    ("qtemp-llama4", dict(floor_scale=2.0, inner="rope")),
    ("qtemp-mistral3", dict(original_max_len=4, beta=0.4)),
    ("qtemp-mistral3", dict(original_max_len=4, inner="rope-yarn", inner_options={"factor": 2.0})),
    ("ssmax", {}),
    ("ssmax", dict(learn_bias=True, inner="alibi")),
]
IDS = [f"{n}-{i}" for i, (n, _) in enumerate(CASES)]


@pytest.mark.parametrize("name,options", CASES, ids=IDS)
def test_generation_is_the_same_with_and_without_the_cache(name, options):
    torch.manual_seed(0)
    model = (
        posenc.LanguageModel(40, encoding=name, encoding_options=options, d_model=32, n_heads=2, n_layers=2, max_len=64)
        .double()
        .eval()
    )
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():  # off their initial values (s, b, the inner's tables)
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    prompt = torch.randint(0, 40, (2, 5), generator=g)
    assert model.decoding_mode(5, 20)[0] == "cache"
    cached = model.generate(prompt, 20)
    assert torch.equal(cached, model.generate(prompt, 20, use_cache=False))
    # and greedy by hand: the argmax of the whole sequence's last logits
    seq = prompt
    with torch.no_grad():
        for _ in range(20):
            seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(cached, seq)


@pytest.mark.parametrize("inner", ["rope", "alibi", "shaw", "t5", "transformer-xl", "fire", "cope"])
def test_without_a_temperature_the_inner_encoding_is_unchanged(inner):
    # attn_scale = 0 (factor 1): the wrapper is its inner encoding, hook by hook and kernel by kernel
    dims = dict(d_model=32, n_heads=4, head_dim=8, max_len=64, causal=True)
    plain = posenc.registry.build(inner, dims=dims)
    wrapped = posenc.registry.build("qtemp-llama4", dims=dims, options=dict(inner=inner, attn_scale=0.0))
    wrapped.inner.load_state_dict(plain.state_dict())
    assert wrapped.hooks() == plain.hooks() | {"rotate"}
    torch.manual_seed(0)
    a = posenc.MultiHeadAttention(32, 4, plain).eval()
    b = posenc.MultiHeadAttention(32, 4, wrapped).eval()
    b.load_state_dict(a.state_dict(), strict=False)
    x = torch.randn(2, 20, 32)
    with torch.no_grad():
        assert torch.allclose(a(x, causal=True), b(x, causal=True), atol=1e-6)
    assert a.last_plan.kernel == b.last_plan.kernel


def test_a_temperature_keeps_the_fast_path_and_scales_only_the_query():
    enc = posenc.get("qtemp-llama4", floor_scale=2.0)
    assert enc.hooks() == {"rotate"}
    q, k = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    pos = torch.arange(10, 15)[None]
    rq, rk = enc.rotate(q, k, posenc.base.AttentionContext(q_pos=pos, k_pos=pos, n_heads=2, head_dim=4))
    assert rk is k
    assert torch.allclose(rq, q * enc.factors(pos)[:, None, :, None])
    attn = posenc.MultiHeadAttention(8, 2, enc)
    attn(torch.randn(2, 9, 8), causal=True)
    assert attn.last_plan.kernel == "sdpa"


@pytest.mark.parametrize("name", NAMES)
def test_inspect_measures_them_and_their_claims_hold(name, tmp_path):
    report = measure(name, dim=32, length=32, heads=2)
    assert report.kind == "attention" and report.failures == [], {k: report[k].value for k in report.failures}
    assert any(m.verdict == "pass" for m in report.measurements.values())
    pytest.importorskip("matplotlib")
    from posenc.analysis.plots import plot

    made = plot(name, tmp_path, dim=32, length=32, heads=2, formats=("png",))
    for picture in ("code", "scores", "decay"):  # a rotation of a probe vector, and the scores it induces
        assert isinstance(made[picture], list) and made[picture][0].exists(), (picture, made[picture])


def test_listed_with_their_family():
    cards = {c.name: c for c in (posenc.card(n) for n in NAMES)}
    assert {c.family for c in cards.values()} == {"temperature"}
    assert posenc.registry.resolve("attn_temperature_tuning") is Llama4Temperature
    assert posenc.registry.resolve("scalable-softmax") is SSMax
    assert posenc.registry.resolve("llama-4-scaling-beta") is Mistral3Temperature
    assert posenc.available()[-3:] == list(NAMES)


# ---------------------------------------------------------------------------------------------- bad settings
@pytest.mark.parametrize(
    "name,options,words",
    [
        ("qtemp-llama4", dict(floor_scale=-8.0), ["floor_scale", "> 0", "-8.0"]),
        ("qtemp-llama4", dict(floor_scale=0), ["floor_scale", "> 0"]),
        ("qtemp-llama4", dict(attn_scale=-0.1), ["attn_scale", ">= 0"]),
        ("qtemp-llama4", dict(attn_scale=float("inf")), ["attn_scale", "finite"]),
        ("qtemp-mistral3", dict(beta=float("nan"), max_len=8), ["beta", "finite"]),
        ("qtemp-mistral3", dict(beta=float("-inf"), max_len=8), ["beta", "finite"]),
        ("qtemp-mistral3", dict(beta=-1.0, max_len=8), ["beta", ">= 0"]),
        ("qtemp-mistral3", dict(), ["original_max_len", "16384"]),
        ("qtemp-mistral3", dict(original_max_len=0), ["original_max_len", ">= 1"]),
        ("ssmax", dict(max_len=8), ["n_heads"]),
        ("ssmax", dict(n_heads=2), ["max_len", "s_init"]),
        ("ssmax", dict(n_heads=2, max_len=1), ["max_len", ">= 2", "s_init"]),
        ("ssmax", dict(n_heads=2, s_init=float("nan")), ["s_init", "finite"]),
        ("ssmax", dict(n_heads=2, max_len=8, learn_bias=1), ["learn_bias", "True or False"]),
        ("qtemp-llama4", dict(inner=3), ["inner", "a string", "got 3", "'nope'"]),
        ("qtemp-llama4", dict(inner_options=["base", 2]), ["inner_options", "dict"]),
        ("qtemp-llama4", dict(inner="rope", head_dim=7), ["qtemp-llama4", "inner encoding 'rope'", "head_dim"]),
        ("ssmax", dict(n_heads=2, max_len=8, inner="rope"), ["ssmax", "inner encoding 'rope'", "head_dim"]),
    ],
)
def test_bad_settings_are_clear_errors(name, options, words):
    with pytest.raises(ConfigError) as err:
        posenc.get(name, **options)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_an_unknown_inner_name_gives_its_close_matches():
    with pytest.raises(UnknownNameError) as err:
        posenc.get("qtemp-mistral3", max_len=8, inner="rope-yarm")
    msg = str(err.value)
    assert "qtemp-mistral3" in msg and "inner='rope-yarm'" in msg and "rope-yarn" in err.value.close_matches
    with pytest.raises(UnknownNameError, match="did you mean|Did you mean"):
        posenc.LanguageModel(20, encoding="ssmax", encoding_options={"inner": "nopee"}, d_model=16, n_heads=2)
