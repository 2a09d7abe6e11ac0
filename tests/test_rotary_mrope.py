"""mrope and mrope-interleaved against transformers 5.24's Qwen2-VL / Qwen3-VL code, and their position ids.

* The rotation: float64 q and k, random three-row positions, against ``Qwen2VLRotaryEmbedding`` /
  ``Qwen3VLTextRotaryEmbedding`` (which lay the sections out, or interleave them) + ``apply_rotary_pos_emb``, values
  and gradients. Both compute float32 phases the same way: the largest difference is 0.
* The position ids: :func:`mrope_positions` against ``get_rope_index`` of Qwen2-VL, Qwen2.5-VL (seconds per grid) and
  Qwen3-VL (one grid per frame) on mixed sequences (text, image, text, video, text), a left-padded batch; and
  against the example the Qwen2.5-VL authors wrote in its docstring (``next_start="max"``).
* On text (equal rows, or no rows) both are ``rope`` bit for bit; the rows travel through ``MultiHeadAttention``'s
  per-forward cache (SDPA plan, KV cache, ``torch.compile``); bad settings and positions.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import posenc
from posenc import ConfigError, KVCache, MultiHeadAttention, PositionError
from posenc.base import AttentionContext
from posenc.rotary.mrope import image, mrope_cache, mrope_positions, video

transformers = pytest.importorskip("transformers")
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel  # noqa: E402
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLTextConfig  # noqa: E402
from transformers.models.qwen2_vl.modeling_qwen2_vl import (  # noqa: E402
    Qwen2VLModel,
    Qwen2VLRotaryEmbedding,
    apply_rotary_pos_emb,
)
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLTextConfig  # noqa: E402
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel, Qwen3VLTextRotaryEmbedding  # noqa: E402

# (name, head_dim, mrope_section, base): Qwen2-VL's and Qwen3-VL's own sections, and small ones
CASES = [
    ("mrope", 128, [16, 24, 24], 1e6),
    ("mrope", 16, [2, 3, 3], 10000.0),
    ("mrope-interleaved", 128, [24, 20, 20], 5e6),
    ("mrope-interleaved", 16, [4, 2, 2], 10000.0),
    ("mrope-interleaved", 12, [2, 2, 2], 10000.0),
]


def hf_rotary(name: str, head_dim: int, section: list[int], base: float) -> torch.nn.Module:
    params = dict(rope_type="default", rope_theta=base, mrope_section=section)
    if name == "mrope":
        return Qwen2VLRotaryEmbedding(
            Qwen2VLTextConfig(hidden_size=2 * head_dim, num_attention_heads=2, rope_parameters=params)
        )
    cfg = Qwen3VLTextConfig(
        hidden_size=2 * head_dim,
        num_attention_heads=2,
        head_dim=head_dim,
        rope_parameters={**params, "mrope_interleaved": True},
    )
    return Qwen3VLTextRotaryEmbedding(cfg)


def random_rows(batch: int, length: int, top: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, top, (3, batch, length), generator=g)


@pytest.mark.parametrize("name,head_dim,section,base", CASES)
def test_rotation_equals_transformers_float64_with_gradients(name, head_dim, section, base):
    enc = posenc.get(name, head_dim=head_dim, mrope_section=section, base=base)
    hf = hf_rotary(name, head_dim, section, base)
    b, h, lq = 2, 3, 11
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, h, lq, head_dim, dtype=torch.float64, generator=g)
    k = torch.randn(b, h, lq, head_dim, dtype=torch.float64, generator=g)
    worst = 0.0
    for top in (40, 5000, 3_000_000):  # small ids, long contexts, past the float32 table's reach (2**16)
        rows = random_rows(b, lq, top, seed=top)
        cos, sin = hf(q, rows)
        q1, k1 = q.clone().requires_grad_(), k.clone().requires_grad_()
        want_q, want_k = apply_rotary_pos_emb(q1, k1, cos, sin)
        q2, k2 = q.clone().requires_grad_(), k.clone().requires_grad_()
        ctx = AttentionContext(q_pos=rows[0], k_pos=rows[0], n_heads=h, head_dim=head_dim, cache=mrope_cache(rows))
        got_q, got_k = enc.rotate(q2, k2, ctx)
        torch.testing.assert_close(got_q, want_q, rtol=0, atol=1e-14)
        torch.testing.assert_close(got_k, want_k, rtol=0, atol=1e-14)
        w = torch.randn(b, h, lq, lq, dtype=torch.float64, generator=g)
        ((want_q @ want_k.transpose(-1, -2)) * w).sum().backward()
        ((got_q @ got_k.transpose(-1, -2)) * w).sum().backward()
        torch.testing.assert_close(q2.grad, q1.grad, rtol=0, atol=1e-12)
        torch.testing.assert_close(k2.grad, k1.grad, rtol=0, atol=1e-12)
        worst = max(worst, float((got_q - want_q).abs().max().detach()), float((got_k - want_k).abs().max().detach()))
        # the standalone call takes the same rows
        torch.testing.assert_close(enc(q, axis_positions=rows), want_q.detach(), rtol=0, atol=1e-14)
    assert worst == 0.0  # the card's "max diff 0": float32 phases computed as transformers computes them


def test_axes_of_the_pairs():
    assert (
        posenc.get("mrope", head_dim=16, mrope_section=[2, 3, 3]).axes()
        == ["temporal"] * 2 + ["height"] * 3 + ["width"] * 3
    )
    inter = posenc.get("mrope-interleaved", head_dim=128, mrope_section=[24, 20, 20]).axes()
    assert inter[:6] == ["temporal", "height", "width"] * 2 and inter[60:] == ["temporal"] * 4
    assert [inter.count(a) for a in ("temporal", "height", "width")] == [24, 20, 20]
    # the defaults scale Qwen2-VL's and Qwen3-VL's sections
    assert posenc.get("mrope", head_dim=128).mrope_section == [16, 24, 24]
    assert posenc.get("mrope-interleaved", head_dim=128).mrope_section == [24, 20, 20]


def test_each_axis_moves_only_its_pairs():
    enc = posenc.get("mrope", head_dim=16, mrope_section=[2, 3, 3])
    x = torch.randn(1, 1, 1, 16, dtype=torch.float64)
    base = enc(x, axis_positions=torch.tensor([[5], [5], [5]]))
    for axis, pairs in ((0, range(0, 2)), (1, range(2, 5)), (2, range(5, 8))):
        rows = torch.tensor([[5], [5], [5]])
        rows[axis] = 9
        moved = (enc(x, axis_positions=rows) - base).abs()[0, 0, 0]
        changed = {i for i in range(8) if moved[i] > 0 or moved[i + 8] > 0}
        assert changed == set(pairs), (axis, changed)


@pytest.mark.parametrize("name", ["mrope", "mrope-interleaved"])
def test_scores_depend_only_on_the_offsets_of_each_axis(name):
    enc = posenc.get(name, head_dim=24)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 2, 9, 24, dtype=torch.float64, generator=g)
    k = torch.randn(1, 2, 9, 24, dtype=torch.float64, generator=g)
    rows = random_rows(1, 9, 50, seed=6)

    def scores(shift: list[int]) -> torch.Tensor:
        moved = rows + torch.tensor(shift)[:, None, None]
        ctx = AttentionContext(q_pos=moved[0], k_pos=moved[0], n_heads=2, head_dim=24, cache=mrope_cache(moved))
        rq, rk = enc.rotate(q, k, ctx)
        return rq @ rk.transpose(-1, -2)

    want = scores([0, 0, 0])
    for shift in ([7, 0, 0], [0, 13, 0], [0, 0, 21], [3, 100, 41]):
        torch.testing.assert_close(scores(shift), want, rtol=1e-5, atol=1e-5)
    # other height and width ids (the time row repeated) give other scores: each row counts
    ctx = AttentionContext(q_pos=rows[0], k_pos=rows[0], n_heads=2, head_dim=24, cache=mrope_cache(rows[[0, 0, 0]]))
    rq, rk = enc.rotate(q, k, ctx)
    assert float((rq @ rk.transpose(-1, -2) - want).abs().max()) > 1e-2


@pytest.mark.parametrize("name", ["mrope", "mrope-interleaved"])
def test_text_is_rope_bit_for_bit(name):
    enc, rope = posenc.get(name, head_dim=16), posenc.get("rope", head_dim=16)
    x = torch.randn(2, 3, 10, 16)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8, 9], [3, 4, 5, 6, 7, 8, 9, 10, 70000, 70001]])
    assert torch.equal(enc(x, pos), rope(x, pos))
    assert torch.equal(enc(x, axis_positions=pos.expand(3, -1, -1)), rope(x, pos))
    torch.manual_seed(0)
    a = MultiHeadAttention(48, 3, enc)
    torch.manual_seed(0)
    r = MultiHeadAttention(48, 3, rope)
    h = torch.randn(2, 10, 48)
    want = r(h, causal=True)
    assert torch.equal(a(h, causal=True), want)  # no rows: the 1-D positions are every row
    assert torch.equal(a(h, causal=True, cache=mrope_cache(torch.arange(10).expand(3, 1, -1))), want)
    assert a.last_plan is not None and a.last_plan.kernel == "sdpa"


# ------------------------------------------------------------------ position ids
class _Holder:
    """Just what ``get_rope_index`` reads of its model: the vision config's merge size and tokens per second."""

    def __init__(self, model_cls: type, merge: int, tokens_per_second: float | None = None):
        self.config = SimpleNamespace(
            vision_config=SimpleNamespace(spatial_merge_size=merge, tokens_per_second=tokens_per_second)
        )
        self._cls = model_cls

    def get_vision_position_ids(self, *args, **kwargs):
        return self._cls.get_vision_position_ids(self, *args, **kwargs)

    def get_rope_index(self, *args, **kwargs):
        return self._cls.get_rope_index(self, *args, **kwargs)


def token_types(spans, merge: int) -> torch.Tensor:
    """transformers' ``mm_token_type_ids`` of the spans: 0 text, 1 image, 2 video."""
    out = []
    for s in spans:
        if isinstance(s, int):
            out += [0] * s
        else:
            out += [2 if s.video else 1] * (s.t * s.h * s.w // merge**2)
    return torch.tensor([out])


MIXED = [
    [5, image(4, 6), 3, video(3, 2, 4, seconds_per_grid=1.5), 2],  # text, image, text, video, text
    [1, image(2, 2), 2, video(8, 4, 4, seconds_per_grid=0.5), 4, image(6, 2), 1],  # a long video (t > h/m, w/m)
    [3, video(2, 8, 6, seconds_per_grid=2.0), 1, image(8, 8, t=1), 2],
]


@pytest.mark.parametrize("spans", MIXED)
@pytest.mark.parametrize("model", ["qwen2-vl", "qwen2.5-vl"])
def test_position_ids_equal_get_rope_index(spans, model):
    merge, tps = 2, (2 if model == "qwen2.5-vl" else None)
    holder = _Holder(Qwen2_5_VLModel if tps else Qwen2VLModel, merge, tps)
    types = token_types(spans, merge)
    grids = [s for s in spans if not isinstance(s, int)]
    images = torch.tensor([[g.t, g.h, g.w] for g in grids if not g.video])
    videos = torch.tensor([[g.t, g.h, g.w] for g in grids if g.video])
    kw = {"second_per_grid_ts": torch.tensor([g.seconds_per_grid for g in grids if g.video])} if tps else {}
    want, delta = holder.get_rope_index(types, types, image_grid_thw=images, video_grid_thw=videos, **kw)
    got = mrope_positions(spans, spatial_merge_size=merge, tokens_per_second=tps, next_start="spatial")
    assert torch.equal(got, want[:, 0])
    assert int(delta) == int(got.max()) + 1 - got.shape[1]
    # the paper's rule ("max") agrees up to the first video whose temporal ids reach past its spatial ones
    paper = mrope_positions(spans, spatial_merge_size=merge, tokens_per_second=tps)
    first_video = next(i for i, s in enumerate(spans) if not isinstance(s, int) and s.video)
    end = sum(s if isinstance(s, int) else s.t * s.h * s.w // merge**2 for s in spans[: first_video + 1])
    assert torch.equal(paper[:, :end], want[:, 0, :end])


def test_position_ids_qwen3_vl_one_grid_per_frame():
    # Qwen3-VL splits a video of t temporal patches into t grids of one, each after its timestamp text
    merge = 2
    frames = [video(1, 4, 6) for _ in range(3)]
    spans = [4, image(6, 4), 2, 3, frames[0], 1, 3, frames[1], 1, 3, frames[2], 1, 5]
    merged = [4, image(6, 4), 5, frames[0], 4, frames[1], 4, frames[2], 6]  # consecutive text joined
    types = token_types(merged, merge)
    holder = _Holder(Qwen3VLModel, merge)
    want, _ = holder.get_rope_index(
        types, types, image_grid_thw=torch.tensor([[1, 6, 4]]), video_grid_thw=torch.tensor([[3, 4, 6]])
    )
    for rule in ("spatial", "max"):  # one frame per grid: both rules give the same ids
        got = mrope_positions(spans, spatial_merge_size=merge, next_start=rule)
        assert torch.equal(got, want[:, 0]), rule


def test_position_ids_left_padded_batch():
    merge = 2
    seqs = [[2, image(4, 4), 3], [6, video(2, 4, 2), 1, image(2, 2), 2]]
    rows = [mrope_positions(s, spatial_merge_size=merge, next_start="spatial") for s in seqs]
    n = max(r.shape[1] for r in rows)
    types = torch.stack(
        [torch.nn.functional.pad(token_types(s, merge)[0], (n - r.shape[1], 0)) for s, r in zip(seqs, rows)]
    )
    mask = torch.stack([torch.arange(n) >= n - r.shape[1] for r in rows]).long()
    images = torch.tensor([[1, 4, 4], [1, 2, 2]])
    want, _ = _Holder(Qwen2VLModel, merge).get_rope_index(
        types, types, image_grid_thw=images, video_grid_thw=torch.tensor([[2, 4, 2]]), attention_mask=mask
    )
    for i, r in enumerate(rows):
        assert torch.equal(want[:, i, n - r.shape[1] :], r)


def test_position_ids_the_qwen25_vl_docstring_example():
    # Qwen2.5-VL's get_rope_index docstring (the authors'): 25 tokens per second, 2 frames per temporal patch at
    # 1 fps (2 s per grid): temporal ids 0, 50, 100; 2 x 2 merged tokens; the text after starts at 101
    got = mrope_positions([video(3, 4, 4, seconds_per_grid=2.0), 5], spatial_merge_size=2, tokens_per_second=25)
    assert got[0].tolist() == [0] * 4 + [50] * 4 + [100] * 4 + [101, 102, 103, 104, 105]
    assert got[1].tolist() == [0, 0, 1, 1] * 3 + [101, 102, 103, 104, 105]
    assert got[2].tolist() == [0, 1, 0, 1] * 3 + [101, 102, 103, 104, 105]
    # transformers from 5.3 on starts the text at max(h, w) / m past the video's start instead
    spatial = mrope_positions(
        [video(3, 4, 4, seconds_per_grid=2.0), 5], spatial_merge_size=2, tokens_per_second=25, next_start="spatial"
    )
    assert spatial[0, 12:].tolist() == [2, 3, 4, 5, 6]


def test_position_ids_start_and_text():
    assert torch.equal(mrope_positions([4], start=7), torch.arange(7, 11).expand(3, -1))
    assert mrope_positions([image(2, 2), 0, 1]).tolist() == [[0, 1], [0, 1], [0, 1]]


# ------------------------------------------------------------------ through the attention
def test_three_rows_through_attention_equal_transformers_rotation():
    torch.manual_seed(0)
    enc = posenc.get("mrope", head_dim=16, mrope_section=[2, 3, 3], base=1e6)
    attn = MultiHeadAttention(32, 2, enc).double()
    rows = mrope_positions([3, image(4, 4), 2, video(2, 2, 2), 1])[:, None]
    x = torch.randn(2, rows.shape[-1], 32, dtype=torch.float64)
    got = attn(x, causal=True, cache=mrope_cache(rows))
    assert attn.last_plan is not None and attn.last_plan.kernel == "sdpa"
    hf = hf_rotary("mrope", 16, [2, 3, 3], 1e6)
    q = attn._split(attn.q_proj(x))
    k = attn._split(attn.k_proj(x))
    v = attn._split(attn.v_proj(x))
    q, k = apply_rotary_pos_emb(q, k, *hf(q, rows))
    z = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    want = attn.o_proj(z.transpose(1, 2).reshape(2, -1, 32))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", ["mrope", "mrope-interleaved"])
def test_kv_cache_steps_equal_one_forward(name):
    torch.manual_seed(0)
    attn = MultiHeadAttention(32, 2, posenc.get(name, head_dim=16)).double().eval()
    rows = mrope_positions([2, image(4, 6), 3])
    n = rows.shape[1]
    rows = torch.cat([rows, mrope_positions([4], start=int(rows.max()) + 1)], dim=1)  # decoded text after
    x = torch.randn(1, rows.shape[1], 32, dtype=torch.float64)
    want = attn(x, causal=True, cache=mrope_cache(rows))
    cache = KVCache()
    outs = [attn(x[:, :n], causal=True, kv_cache=cache, cache=mrope_cache(rows[:, :n]))]
    for i in range(n, rows.shape[1]):
        outs.append(attn(x[:, i : i + 1], causal=True, kv_cache=cache, cache=mrope_cache(rows[:, i : i + 1])))
    torch.testing.assert_close(torch.cat(outs, dim=1), want, rtol=0, atol=1e-12)


def test_memory_needs_key_rows():
    torch.manual_seed(0)
    attn = MultiHeadAttention(32, 2, posenc.get("mrope", head_dim=16))
    x, mem = torch.randn(1, 4, 32), torch.randn(1, 3, 32)
    q_rows = mrope_positions([4], start=3)
    with pytest.raises(PositionError, match="4 queries but 7 new keys"):
        attn(x, memory=mem, cache=mrope_cache(q_rows))
    out = attn(x, memory=mem, cache=mrope_cache(q_rows, mrope_positions([7])))
    assert torch.equal(out, attn(x, memory=mem))  # text rows: the 1-D positions' RoPE


@pytest.mark.parametrize("name", ["mrope", "mrope-interleaved"])
def test_compile_fullgraph_with_three_rows(name):
    torch._dynamo.reset()
    torch.manual_seed(0)
    attn = MultiHeadAttention(32, 2, posenc.get(name, head_dim=16)).eval()
    rows = mrope_positions([2, image(4, 4), 1])[:, None]
    x = torch.randn(2, rows.shape[-1], 32)

    def run(x, rows):
        return attn(x, causal=True, cache=mrope_cache(rows))

    want = run(x, rows)
    got = torch.compile(run, fullgraph=True, backend="aot_eager")(x, rows)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["mrope", "mrope-interleaved"])
def test_language_model_generates_the_same_with_and_without_cache(name):
    torch.manual_seed(0)
    model = posenc.LanguageModel(vocab_size=40, d_model=32, n_heads=2, n_layers=2, encoding=name, max_len=64).eval()
    prompt = torch.randint(0, 40, (2, 5))
    a = model.generate(prompt, max_new_tokens=6, use_cache=True)
    b = model.generate(prompt, max_new_tokens=6, use_cache=False)
    assert torch.equal(a, b)


# ------------------------------------------------------------------ bad input
def test_section_that_does_not_sum_names_both_numbers():
    with pytest.raises(ConfigError, match=r"sums to 10 but head_dim=16 has 8 rotary pairs"):
        posenc.get("mrope", head_dim=16, mrope_section=[2, 4, 4])
    with pytest.raises(ConfigError, match=r"sums to 7 .* has 8"):
        posenc.get("mrope-interleaved", head_dim=16, mrope_section=[3, 2, 2])
    with pytest.raises(ConfigError, match="three integers"):
        posenc.get("mrope", head_dim=16, mrope_section=[4, 4])
    with pytest.raises(ConfigError, match="three integers"):
        posenc.get("mrope", head_dim=16, mrope_section=[8, -1, 1])
    with pytest.raises(ConfigError, match="does not fit 8 interleaved pairs"):
        posenc.get("mrope-interleaved", head_dim=16, mrope_section=[0, 4, 4])


@pytest.mark.parametrize("name", ["mrope", "mrope-interleaved"])
def test_odd_head_dim(name):
    with pytest.raises(ConfigError, match="head_dim must be an even integer >= 2, got 15; use head_dim=14 or 16"):
        posenc.get(name, head_dim=15)


def test_bad_rows():
    enc = posenc.get("mrope", head_dim=16)
    x = torch.randn(2, 1, 5, 16)
    with pytest.raises(PositionError, match=r"\[3, L\] or \[3, B, L\]"):
        enc(x, axis_positions=torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(PositionError, match="describe 4 tokens but this call has 5"):
        enc(x, axis_positions=torch.zeros(3, 4, dtype=torch.long))
    with pytest.raises(PositionError, match="batch size 3"):
        enc(x, axis_positions=torch.zeros(3, 3, 5, dtype=torch.long))
    with pytest.raises(PositionError, match=">= 0"):
        enc(x, axis_positions=torch.full((3, 5), -1))
    with pytest.raises(ConfigError, match="not both"):
        enc(x, torch.arange(5), axis_positions=torch.zeros(3, 5, dtype=torch.long))
    attn = MultiHeadAttention(32, 2, enc)
    with pytest.raises(PositionError, match="describe 6 tokens but this call has 5"):
        attn(torch.randn(1, 5, 32), cache=mrope_cache(mrope_positions([6])))


def test_bad_spans():
    with pytest.raises(ConfigError, match="spatial_merge_size=2 does not divide"):
        mrope_positions([2, image(3, 4)])
    with pytest.raises(ConfigError, match="span 1 must be a number of text tokens"):
        mrope_positions([2, ("image", 1, 4, 4)])
    with pytest.raises(ConfigError, match="span 0's t must be an integer >= 1"):
        mrope_positions([video(0, 2, 2)])
    with pytest.raises(ConfigError, match="next_start must be 'max' or 'spatial'"):
        mrope_positions([2], next_start="min")
    with pytest.raises(ConfigError, match="hold no tokens"):
        mrope_positions([0])
    with pytest.raises(ConfigError, match="spans must be a list"):
        mrope_positions(5)  # type: ignore[arg-type]
