"""The vision rotary encodings: RoPE-Mixed (Heo et al. 2024) and DINOv3's axial RoPE on normalised coordinates.

rope-dinov3 against transformers' DINOv3ViTRopePositionEmbedding (cos / sin bit for bit in float32 and float64,
in eval and in training with shift / jitter / rescale drawn from the same seed) and against a whole
DINOv3ViTAttention layer with its CLS and register tokens (float64). rope-mixed against the paper's formula
written out in float64 (complex rotations of the patch tokens of a ViT attention layer, the CLS token left alone,
as naver-ai/rope-vit's layer does), its initialisation, gradcheck of the learnable frequencies, 2-D translation
invariance, and a tagger that learns a 2-D task. Both: the SDPA kernel, and bad settings and positions.
"""

from __future__ import annotations

import math

import pytest
import torch

import posenc
from posenc import ConfigError, MultiHeadAttention, PositionError
from posenc.base import AttentionContext

F64 = torch.float64


# ------------------------------------------------------------------------------------------------ DINOv3
def dinov3(h: int, w: int, **kw):
    from transformers import DINOv3ViTConfig
    from transformers.models.dinov3_vit.modeling_dinov3_vit import DINOv3ViTAttention, DINOv3ViTRopePositionEmbedding

    cfg = DINOv3ViTConfig(
        hidden_size=32, num_attention_heads=2, patch_size=4, image_size=[4 * h, 4 * w], key_bias=True, **kw
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return cfg, DINOv3ViTRopePositionEmbedding(cfg), DINOv3ViTAttention(cfg)


AUG = dict(pos_embed_shift=0.1, pos_embed_jitter=1.5, pos_embed_rescale=2.0)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("h,w,aug", [(3, 5, {}), (4, 4, AUG), (2, 7, dict(pos_embed_rescale=None)), (5, 3, AUG)])
def test_dinov3_cos_sin_are_transformers_bit_for_bit(h, w, aug, dtype):
    cfg, hf, _ = dinov3(h, w, **aug)
    hf = hf.to(dtype)
    shift, jitter, rescale = cfg.pos_embed_shift, cfg.pos_embed_jitter, cfg.pos_embed_rescale
    opts = dict(grid_width=w, shift=shift, jitter=jitter, rescale=rescale)
    pixels = torch.zeros(1, 3, 4 * h, 4 * w, dtype=dtype)
    for grid_height in (h, None):  # None: the rows the positions reach, as DINOv3 reads them from the image
        enc = posenc.get("rope-dinov3", head_dim=16, grid_height=grid_height, **opts).to(dtype)
        for training in (False, True):
            hf.train(training), enc.train(training)
            torch.manual_seed(7)
            cos, sin = hf(pixels)  # [h·w, 16]: the halves repeated
            torch.manual_seed(7)
            mine_cos, mine_sin = enc.cos_sin(torch.arange(h * w)[None])
            assert mine_cos.dtype == dtype
            assert torch.equal(cos[:, 8:], cos[:, :8])
            assert torch.equal(mine_cos[0], cos[:, :8]) and torch.equal(mine_sin[0], sin[:, :8])


@pytest.mark.parametrize("training", [False, True])
def test_dinov3_attention_layer_with_cls_and_registers(training):
    h, w, prefix = 3, 4, 5  # one CLS and four registers, not rotated
    cfg, hf_rope, hf_attn = dinov3(h, w, **AUG)
    hf_rope, hf_attn = hf_rope.double().train(training), hf_attn.double().train(training)
    enc = posenc.get("rope-dinov3", head_dim=16, grid_width=w, grid_height=h, n_prefix=prefix, shift=0.1, jitter=1.5)
    attn = MultiHeadAttention(32, 2, enc).double().train(training)
    attn.load_state_dict(hf_attn.state_dict())
    x = torch.randn(2, prefix + h * w, 32, dtype=F64)
    torch.manual_seed(3)
    cos, sin = hf_rope(torch.zeros(1, 3, 4 * h, 4 * w, dtype=F64))
    want, _ = hf_attn(x, position_embeddings=(cos, sin))
    torch.manual_seed(3)
    got = attn(x)
    assert attn.last_plan is not None and attn.last_plan.kernel == "sdpa", str(attn.last_plan)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # the prefix tokens' rotation is the identity; the patches' is not
    q = torch.randn(1, 2, prefix + h * w, 16, dtype=F64)
    ctx = AttentionContext(
        q_pos=torch.arange(prefix + h * w)[None], k_pos=torch.arange(prefix + h * w)[None], n_heads=2, head_dim=16
    )
    rq, _ = enc.eval().rotate(q, q, ctx)
    assert torch.equal(rq[:, :, :prefix], q[:, :, :prefix]) and not torch.allclose(rq[:, :, prefix:], q[:, :, prefix:])


def test_dinov3_augmentation_is_one_draw_per_forward_for_every_layer():
    torch.manual_seed(0)
    model = posenc.Encoder(
        20,
        encoding="rope-dinov3",
        encoding_options=dict(grid_width=4, grid_height=4, shift=0.5),
        d_model=16,
        n_heads=2,
        n_layers=2,
        max_len=16,
    )
    enc = model.encoding
    draws = []
    real = enc.augmentation
    enc.augmentation = lambda device=None: draws.append(1) or real(device)  # type: ignore[method-assign]
    model.train()(torch.randint(0, 20, (2, 16)))
    assert draws == [1]  # one draw, for both layers and q and k
    model.eval()(torch.randint(0, 20, (2, 16)))
    assert draws == [1]  # none at evaluation
    # training: the same seed gives the same output; another seed another augmentation
    model.train()
    tokens = torch.randint(0, 20, (2, 16))
    outs = []
    for seed in (1, 1, 2):
        torch.manual_seed(seed)
        outs.append(model(tokens).hidden)
    assert torch.equal(outs[0], outs[1]) and not torch.allclose(outs[0], outs[2])


def test_dinov3_without_grid_height_is_length_dependent_and_says_so():
    enc = posenc.get("rope-dinov3", head_dim=8, grid_width=4)
    assert enc.cache_problem(4, 4) is None and enc.cache_problem(5, 8) is None  # 2 rows throughout
    assert "rows" in enc.cache_problem(4, 9)  # 1 row, then 3
    assert posenc.get("rope-dinov3", head_dim=8, grid_width=4, grid_height=3).cache_problem(1, 12) is None
    lm = posenc.LanguageModel(20, encoding=enc, d_model=16, n_heads=2, n_layers=1, max_len=32)
    assert lm.decoding_mode(3, 6)[0] == "recompute"


# ------------------------------------------------------------------------------------------------ RoPE-Mixed
def mixed_attention_by_the_formula(attn: MultiHeadAttention, x: torch.Tensor, width: int, prefix: int) -> torch.Tensor:
    """A ViT attention layer with RoPE-Mixed, from the paper's formula: patch ``p`` at ``(x, y) = (p % W, p // W)``
    multiplies its query / key pair ``j`` (``q_2j + i q_2j+1``) of head ``h`` by ``exp(i (f^x_hj x + f^y_hj y))``; the
    ``prefix`` leading tokens are left as they are. Complex float64 arithmetic, a loop over the tokens."""
    b, n, _ = x.shape
    heads, d = attn.n_heads, attn.head_dim
    fx, fy = attn.encoding.freqs.detach().to(F64)

    def split(t):
        return t.view(b, n, heads, d).transpose(1, 2)

    q, k, v = split(attn.q_proj(x)), split(attn.k_proj(x)), split(attn.v_proj(x))
    qc = torch.complex(q[..., 0::2], q[..., 1::2])
    kc = torch.complex(k[..., 0::2], k[..., 1::2])
    rot = torch.ones(heads, n, d // 2, dtype=torch.complex128)
    for t in range(prefix, n):
        p = t - prefix
        px, py = p % width, p // width
        rot[:, t] = torch.polar(torch.ones(heads, d // 2, dtype=F64), fx * px + fy * py)
    qc, kc = qc * rot, kc * rot

    def real(z):
        return torch.stack([z.real, z.imag], -1).flatten(-2)

    scores = real(qc) @ real(kc).transpose(-1, -2) / math.sqrt(d)
    out = torch.softmax(scores, -1) @ v
    return attn.o_proj(out.transpose(1, 2).reshape(b, n, heads * d))


@pytest.mark.parametrize("prefix", [0, 1])
def test_mixed_attention_equals_the_formula(prefix):
    torch.manual_seed(0)
    w, h = 4, 3
    enc = posenc.get("rope-mixed", head_dim=8, n_heads=4, grid_width=w, grid_height=h, n_prefix=prefix)
    attn = MultiHeadAttention(32, 4, enc).double()
    x = torch.randn(2, prefix + w * h, 32, dtype=F64)
    got = attn(x)
    assert attn.last_plan is not None and attn.last_plan.kernel == "sdpa", str(attn.last_plan)
    torch.testing.assert_close(got, mixed_attention_by_the_formula(attn, x, w, prefix), rtol=1e-12, atol=1e-12)
    # the same in float32 (the phases in float32, as the paper's code)
    attn32 = MultiHeadAttention(32, 4, posenc.get("rope-mixed", head_dim=8, n_heads=4, grid_width=w, n_prefix=prefix))
    attn32.load_state_dict({k: v.float() for k, v in attn.state_dict().items()})
    torch.testing.assert_close(attn32(x.float()).double(), got, rtol=1e-5, atol=1e-5)


def test_mixed_initialisation_is_the_papers():
    d, heads, base = 16, 6, 10.0
    torch.manual_seed(0)
    enc = posenc.get("rope-mixed", head_dim=d, n_heads=heads, grid_width=4)
    fx, fy = enc.freqs.detach().double()
    assert enc.freqs.shape == (2, heads, d // 2) and enc.freqs.requires_grad
    mag = base ** (-4 * torch.arange(d // 4, dtype=F64) / d)  # 1, 10^-1/4, 10^-1/2, 10^-3/4
    torch.testing.assert_close(torch.hypot(fx, fy), torch.cat([mag, mag]).expand(heads, -1), rtol=1e-6, atol=0)
    angle = torch.atan2(fy, fx)  # the direction of each pair
    first, second = angle[:, : d // 4], angle[:, d // 4 :]
    torch.testing.assert_close(first, first[:, :1].expand_as(first), rtol=0, atol=1e-6)  # one direction a_h per head
    turn = torch.remainder(second - first, 2 * math.pi)
    torch.testing.assert_close(turn, torch.full_like(turn, math.pi / 2), rtol=0, atol=1e-6)  # the others at a_h + π/2
    assert len(set(torch.round(first[:, 0], decimals=4).tolist())) == heads  # random per head
    axes = posenc.get("rope-mixed", head_dim=d, n_heads=heads, grid_width=4, rotate=False).freqs.detach()
    torch.testing.assert_close(axes[0, :, : d // 4], mag.float().expand(heads, -1))  # a_h = 0: x only, then y only
    assert axes[1, :, : d // 4].abs().max() == 0 and axes[0, :, d // 4 :].abs().max() < 1e-7
    # a model gives each layer its own draw
    model = posenc.TokenTagger(
        5, 5, encoding="rope-mixed", encoding_options=dict(grid_width=4), d_model=32, n_layers=2, n_heads=2
    )
    f = [p for n, p in model.named_parameters() if n.endswith("freqs")]
    assert len(f) == 2 and not torch.equal(f[0], f[1])


def test_mixed_frequencies_gradcheck():
    torch.manual_seed(0)
    enc = posenc.get("rope-mixed", head_dim=4, n_heads=2, grid_width=3, n_prefix=1).double()
    x = torch.randn(1, 2, 5, 4, dtype=F64, requires_grad=True)
    pos = torch.tensor([0, 1, 2, 4, 6])
    freqs = enc.freqs.detach().clone().requires_grad_()

    def f(fr, xx):
        return torch.func.functional_call(enc, {"freqs": fr}, (xx, pos))

    assert torch.autograd.gradcheck(f, (freqs, x))
    attn = MultiHeadAttention(8, 2, enc).double()
    h = torch.randn(1, 5, 8, dtype=F64)
    assert torch.autograd.gradcheck(
        lambda fr: torch.func.functional_call(attn, {"encoding.freqs": fr}, (h,), {"positions": pos}), (freqs,)
    )


def test_mixed_scores_depend_on_the_2d_offset_only():
    torch.manual_seed(0)
    enc = posenc.get("rope-mixed", head_dim=8, n_heads=2, grid_width=5).double()
    attn = MultiHeadAttention(16, 2, enc).double()
    x = torch.randn(1, 4, 16, dtype=F64)
    block = torch.tensor([0, 1, 5, 6])  # a 2 x 2 block at (0, 0)
    torch.testing.assert_close(attn(x, positions=block), attn(x, positions=block + 2 * 5 + 3), rtol=1e-12, atol=1e-12)
    assert (attn(x, positions=block) - attn(x, positions=block + 4)).abs().max() > 1e-4  # wraps a row: not a move


@pytest.mark.parametrize("name,opts", [("rope-mixed", {}), ("rope-dinov3", dict(grid_height=4))])
def test_a_tagger_learns_a_two_d_task(name, opts):
    """Tag each patch of a 4 x 4 grid with the token of the patch above it (0 in the first row)."""
    torch.manual_seed(0)
    w = 4
    model = posenc.TokenTagger(
        5, 5, encoding=name, encoding_options=dict(grid_width=w, **opts), d_model=16, n_layers=1, n_heads=2, d_ff=32
    )
    before = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith("freqs")}
    opt = torch.optim.Adam(model.parameters(), lr=2e-2)
    tokens = torch.randint(1, 5, (16, w * w))
    tags = torch.cat([torch.zeros(16, w, dtype=torch.long), tokens[:, :-w]], 1)
    losses = []
    for _ in range(40):
        loss = torch.nn.functional.cross_entropy(model(tokens).reshape(-1, 5), tags.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.75 * losses[0]
    for n, p in model.named_parameters():
        if n in before:  # RoPE-Mixed's frequencies are trained
            assert not torch.equal(p, before[n]), n


# ------------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    "name,opts,match",
    [
        ("rope-mixed", dict(head_dim=6, n_heads=2, grid_width=4), "multiple of 4, got 6; use head_dim=4 or 8"),
        ("rope-mixed", dict(head_dim=7, n_heads=2, grid_width=4), "multiple of 4, got 7; use head_dim=4 or 8"),
        ("rope-dinov3", dict(head_dim=10, grid_width=4), "multiple of 4, got 10; use head_dim=8 or 12"),
        ("rope-dinov3", dict(head_dim=2, grid_width=4), "multiple of 4, got 2; use head_dim=4"),
        ("rope-mixed", dict(head_dim=8, n_heads=0, grid_width=4), "n_heads"),
        ("rope-mixed", dict(head_dim=8, n_heads=2, grid_width=0), "grid_width must be a positive integer"),
        ("rope-dinov3", dict(head_dim=8, grid_width=4, grid_height=-2), "grid_height must be a positive integer"),
        ("rope-dinov3", dict(head_dim=8, grid_width=4, n_prefix=-1), "n_prefix must be an integer >= 0, got -1"),
        ("rope-dinov3", dict(head_dim=8, grid_width=4, shift=-0.1), "shift must be >= 0"),
        ("rope-dinov3", dict(head_dim=8, grid_width=4, jitter=0.5), r"jitter must be >= 1 .*got 0.5"),
        ("rope-dinov3", dict(head_dim=8, grid_width=4, rescale=float("nan")), "rescale must be finite"),
        ("rope-mixed", dict(head_dim=8, n_heads=2), "needs 'grid_width'"),
    ],
)
def test_bad_settings(name, opts, match):
    with pytest.raises(ConfigError, match=match):
        posenc.get(name, **opts)


@pytest.mark.parametrize("name,opts", [("rope-mixed", dict(n_heads=2)), ("rope-dinov3", {})])
def test_bad_positions(name, opts):
    enc = posenc.get(name, head_dim=8, grid_width=4, grid_height=3, n_prefix=1, **opts)
    x = torch.randn(1, 2, 2, 8)
    with pytest.raises(PositionError, match="must be integers"):
        enc(x, torch.tensor([0.0, 1.0]))
    with pytest.raises(PositionError, match=r"position 13 is patch 12, outside the 3 x 4 grid"):
        enc(x, torch.tensor([0, 13]))
    with pytest.raises(PositionError, match=">= 0"):
        enc(x, torch.tensor([-1, 2]))


def test_mixed_needs_its_heads():
    enc = posenc.get("rope-mixed", head_dim=8, n_heads=4, grid_width=4)
    ctx = AttentionContext(q_pos=torch.arange(3)[None], k_pos=torch.arange(3)[None], n_heads=4, head_dim=8)
    with pytest.raises(ConfigError, match="grouped keys"):
        enc.rotate(torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8), ctx)
    with pytest.raises(ConfigError, match="built for n_heads=4"):
        MultiHeadAttention(16, 2, enc)
