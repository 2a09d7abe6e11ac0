"""posenc.hf on Qwen2-VL / Qwen2.5-VL text models (M-RoPE on three position rows) and on DeepSeek-V3 (multi-head
latent attention: RoPE with DeepSeek's YaRN on a slice of each head, the mscale² softmax factor).

``patch(model, "rope")`` must give the model's own logits (fp32 and fp64: transformers' own code is the truth), on
text and on mixed position rows (an image's tokens), ``generate`` with a dynamic and a static cache must give the
tokens and logits of ``generate`` without a cache, other encodings go in where posenc.hf's hooks reach, and what
cannot act is refused by name. Tiny random configs (query/key weights sharpened so that position shows), no
downloads.
"""

from __future__ import annotations

import pytest
import torch

from posenc.errors import ConfigError

transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("posenc.hf")

from posenc.bias.alibi import alibi_slopes  # noqa: E402
from posenc.hf import matrix_checks  # noqa: E402
from posenc.rotary.mrope import image, mrope_positions  # noqa: E402

VOCAB = matrix_checks.VOCAB
IMAGE = matrix_checks.QWEN2_VL_TOKENS["image_token_id"]


pytestmark = pytest.mark.usefixtures("quiet_transformers")


def sharp(model, by: float = 6.0):
    with torch.no_grad():
        for m in model.modules():
            for name in ("q_proj", "k_proj", "q_b_proj", "kv_a_proj_with_mqa"):
                lin = getattr(m, name, None)
                if isinstance(lin, torch.nn.Linear):
                    lin.weight.mul_(by)
    return model.eval()


def qwen2_vl(dtype=torch.float32):
    torch.manual_seed(0)
    return sharp(matrix_checks.qwen2_vl()).to(dtype)


def qwen2_5_vl(dtype=torch.float32):
    torch.manual_seed(0)
    return sharp(matrix_checks.qwen2_5_vl()).to(dtype)


def deepseek(dtype=torch.float32, **rope):
    torch.manual_seed(0)
    return sharp(matrix_checks.deepseek_v3(**rope)).to(dtype)


def tokens(b=2, n=12, seed=1):
    return torch.randint(1, 80, (b, n), generator=torch.Generator().manual_seed(seed))


def gap(a, b) -> float:
    return float((a - b).abs().max())


TOL = {torch.float32: 1e-6, torch.float64: 1e-12}


# ------------------------------------------------------------------------------------------ Qwen2-VL, Qwen2.5-VL
def mixed_rows(batch: int = 2) -> torch.Tensor:
    """``[3, B, 12]`` M-RoPE ids: 3 text tokens, an image of 4 x 6 patches (6 tokens after the 2 x 2 merge), 3 text."""
    rows = mrope_positions([3, image(4, 6), 3], spatial_merge_size=2)
    assert rows.shape == (3, 12) and not torch.equal(rows[0], rows[1])
    return rows[:, None].expand(3, batch, 12)


@pytest.mark.parametrize("make", [qwen2_vl, qwen2_5_vl], ids=["qwen2-vl", "qwen2.5-vl"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_vl_own_scheme(make, dtype):
    model = make(dtype)
    x, rows = tokens(), mixed_rows()
    four = torch.cat([torch.arange(12).expand(1, 2, 12), rows])  # generate's [text; time; height; width]
    want = [model(x).logits, model(x, position_ids=rows).logits, model(x, position_ids=four).logits]
    assert gap(want[0], want[1]) > 1e-3  # the image's rows change the logits: the check below can fail
    hf.patch(model, "rope")
    state = hf.patched(model)
    assert state.family_name == "qwen2-vl" and state.encoding.info.name == "mrope"
    assert state.encoding.mrope_section == model.config.text_config.rope_parameters["mrope_section"]
    got = [model(x).logits, model(x, position_ids=rows).logits, model(x, position_ids=four).logits]
    for g, w in zip(got, want, strict=True):
        assert gap(g, w) <= TOL[dtype]
    hf.unpatch(model)
    hf.patch(model, "mrope")  # by its name: the same
    assert gap(model(x, position_ids=rows).logits, want[1]) <= TOL[dtype]


def test_vl_plain_rope_differs_on_an_image_only():
    """``rope`` (one position per token) is M-RoPE on text, and not on an image's rows (so the rows reach it)."""
    model = qwen2_vl()
    x, rows = tokens(), mixed_rows()
    own = [model(x).logits, model(x, position_ids=rows).logits]
    hf.patch(model, "rope", base=float(model.config.text_config.rope_parameters["rope_theta"]))
    assert hf.patched(model).encoding.info.name == "rope"
    assert gap(model(x).logits, own[0]) <= 1e-6
    assert gap(model(x, position_ids=rows).logits, own[1]) > 1e-3
    hf.patch(model, "mrope-interleaved", mrope_section=[4, 2, 2])
    assert gap(model(x).logits, own[0]) <= 1e-6  # text: every row the same, interleaved or not


def image_inputs(model):
    """A prompt with an image of 4 x 4 patches (4 tokens) between text, and its pixel values."""
    ids = torch.tensor([[5, 6, 92, IMAGE, IMAGE, IMAGE, IMAGE, 93, 7, 8, 9]])
    cfg = model.config.vision_config
    width = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2
    pixels = torch.randn(16, width, generator=torch.Generator().manual_seed(4)).to(model.dtype)
    grid = torch.tensor([[1, 4, 4]])
    return ids, dict(pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=(ids == IMAGE).long())


def vl_generate(model, ids, extra, **generate):
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6, do_sample=False,
        pad_token_id=0, return_dict_in_generate=True, output_logits=True, **extra, **generate,
    )
    return out.sequences, torch.stack(out.logits, dim=1)


@pytest.mark.parametrize("name", ["rope", "alibi", "t5", "xpos", "sinusoidal"])
def test_vl_generate_with_an_image(name):
    """generate with an image (transformers' four position rows and rope_deltas) and a dynamic or static cache gives
    generate without a cache; ``rope`` gives the unpatched model's tokens and logits."""
    model = qwen2_vl()
    ids, extra = image_inputs(model)
    own = vl_generate(model, ids, extra)
    hf.patch(model, name)
    plain = vl_generate(model, ids, extra, use_cache=False)
    for cache in ({}, {"cache_implementation": "static"}):
        seq, logits = vl_generate(model, ids, extra, **cache)
        assert torch.equal(seq, plain[0]) and gap(logits, plain[1]) < 1e-5, cache
    if name == "rope":
        assert torch.equal(plain[0], own[0]) and gap(plain[1], own[1]) < 1e-5


def test_vl_other_encodings_see_the_text_positions():
    """An encoding with one position per token reads generate's text row of four rows; of three rows that differ
    (an image), the sequence index, as transformers' masks take it then."""
    model = qwen2_vl()
    x, rows = tokens(), mixed_rows()
    hf.patch(model, "sinusoidal")
    plain = model(x).logits
    assert gap(model(x, position_ids=rows).logits, plain) == 0
    four = torch.cat([torch.arange(12).expand(1, 2, 12), rows])
    assert gap(model(x, position_ids=four).logits, plain) == 0
    shifted = torch.cat([torch.arange(12).expand(1, 2, 12) + 5, rows])
    assert gap(model(x, position_ids=shifted).logits, plain) > 1e-4  # the text row is read
    with pytest.raises(ConfigError, match=r"position_ids of shape \(2, 2, 12\)"):
        model(x, position_ids=rows[:2])


def test_vl_codes_added_once():
    """Absolute codes on the text model: the same hidden states whether the outer model embeds the tokens (and
    the text model gets inputs_embeds) or the text model does."""
    model = qwen2_vl()
    x = tokens()
    hf.patch(model, "sinusoidal")
    inner = model.model.language_model(input_ids=x).last_hidden_state
    outer = model.model(input_ids=x).last_hidden_state
    assert gap(inner, outer) == 0
    hf.unpatch(model)
    assert gap(model.model(input_ids=x).last_hidden_state, inner) > 1e-4  # the codes were added


def test_vl_text_model_alone_and_unpatch():
    model = qwen2_vl()
    text = model.model.language_model
    x = tokens()
    want = text(input_ids=x).last_hidden_state
    hf.patch(text, "rope")
    assert hf.patched(text).family_name == "qwen2-vl"
    assert gap(text(input_ids=x).last_hidden_state, want) <= 1e-6
    hf.unpatch(text)
    hf.patch(model, "alibi")
    assert hf.patched(model) is not None and hf.patched(model) is text.posenc
    hf.unpatch(model)
    assert hf.patched(model) is None and "posenc" not in text._modules
    assert gap(text(input_ids=x).last_hidden_state, want) == 0


def test_vl_refusals():
    model = qwen2_vl()
    with pytest.raises(ConfigError, match="mrope-interleaved: mrope_section"):
        hf.patch(model, "mrope-interleaved")  # the model's sections [2, 3, 3] do not interleave in 8 pairs
    with pytest.raises(ConfigError, match="mrope_section"):
        hf.patch(model, "mrope", mrope_section=[2, 2, 2])
    assert hf.patched(model) is None


def test_other_multimodal_ropes_are_not_taken_for_qwen2_vl():
    """Qwen3-VL interleaves its axes: its vision-language model is no supported family, and its text model (built
    like Llama) refuses ``rope`` by name rather than rotating by Qwen2-VL's sections."""
    text = {
        **matrix_checks._QWEN2_VL_TEXT, "head_dim": 16,
        "rope_parameters": {
            "rope_type": "default", "rope_theta": 1e4, "mrope_section": [4, 2, 2], "mrope_interleaved": True,
        },
    }
    vision = dict(
        depth=1, hidden_size=32, out_hidden_size=64, num_heads=2, intermediate_size=64, patch_size=2,
        temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16, deepstack_visual_indexes=[],
    )
    torch.manual_seed(0)
    config = transformers.Qwen3VLConfig(text_config=text, vision_config=vision)
    model = transformers.Qwen3VLForConditionalGeneration(config)
    with pytest.raises(ConfigError, match="supports these transformers model families"):
        hf.patch(model, "alibi")
    with pytest.raises(ConfigError, match=r"multimodal RoPE \(mrope_section \[4, 2, 2\]"):
        hf.patch(model.model.language_model, "rope")
    assert hf.patched(model.model.language_model) is None


# ------------------------------------------------------------------------------------------ DeepSeek-V3
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize(
    "rope",
    [matrix_checks.DEEPSEEK_YARN, {**matrix_checks.DEEPSEEK_YARN, "mscale": 1.0, "mscale_all_dim": 0.707},
     {"rope_type": "default", "rope_theta": 10000.0}],
    ids=["yarn-v3", "yarn-mscale-differs", "plain"],
)
def test_mla_own_scheme(dtype, rope):
    model = deepseek(dtype, rope_parameters=rope)
    x = tokens(2, 40)
    want = model(x).logits
    scaling = [layer.self_attn.scaling for layer in model.model.layers]
    hf.patch(model, "rope")
    state = hf.patched(model)
    assert state.family_name == "deepseek-v3" and state.encoding.info.name == "rope-mla"
    assert state.encoding.rope_dim == model.config.qk_rope_head_dim and state.rotary_mode == "cos-sin"
    assert [layer.self_attn.scaling for layer in model.model.layers] == scaling  # the mscale² factor, exactly
    assert gap(model(x).logits, want) <= TOL[dtype]
    hf.unpatch(model)
    hf.patch(model, "rope-mla")
    assert gap(model(x).logits, want) <= TOL[dtype]
    hf.unpatch(model)
    assert [layer.self_attn.scaling for layer in model.model.layers] == scaling


def test_mla_softmax_factor_matters():
    """rope-yarn (YaRN's phases without DeepSeek's softmax factor) is not the model's scheme; the factor is what
    differs: rope-mla with mscale_all_dim=0 (no factor) gives rope-yarn's logits."""
    model = deepseek()
    x = tokens(2, 40)
    want = model(x).logits
    hf.patch(model, "rope-yarn")
    yarn = model(x).logits
    assert gap(yarn, want) > 1e-4
    assert model.model.layers[0].self_attn.scaling == model.config.qk_head_dim**-0.5
    rp = model.config.rope_parameters
    hf.patch(model, "rope-mla", factor=rp["factor"], original_max_len=rp["original_max_position_embeddings"],
             mscale=rp["mscale"], mscale_all_dim=rp["mscale_all_dim"])
    assert gap(model(x).logits, want) <= 1e-6


@pytest.mark.parametrize("name", ["rope", "alibi", "fire", "sinusoidal"])
def test_mla_generate(name):
    model = deepseek()
    prompt = tokens(1, 7, seed=3)

    def run(**generate):
        out = model.generate(
            prompt, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0,
            return_dict_in_generate=True, output_logits=True, **generate,
        )
        return out.sequences, torch.stack(out.logits, dim=1)

    own = run()
    hf.patch(model, name)
    plain = run(use_cache=False)
    for cache in ({}, {"cache_implementation": "static"}):
        seq, logits = run(**cache)
        assert torch.equal(seq, plain[0]) and gap(logits, plain[1]) < 1e-5, cache
    if name == "rope":
        assert torch.equal(own[0], plain[0]) and gap(own[1], plain[1]) < 1e-5


def test_mla_alibi_scale_is_plain():
    """alibi in posenc's attention on MLA: the softmax scale is qk_head_dim^-1/2 (YaRN's factor belongs to the RoPE
    it replaces): the patched model equals a model without RoPE whose attention adds ALiBi, computed here."""
    model = deepseek(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    x = tokens(1, 9)
    hf.patch(model, "alibi")
    assert model.model.layers[0].self_attn.scaling == model.config.qk_head_dim**-0.5
    got = model(x).logits
    hf.unpatch(model)
    slopes = torch.tensor(alibi_slopes(model.config.num_attention_heads))
    i = torch.arange(9)
    bias = -(i[:, None] - i[None, :]).clamp(min=0).float() * slopes[:, None, None]  # [H, L, L]
    causal = i[None, :] <= i[:, None]

    def eager(module, q, k, v, mask, scaling, dropout=0.0, **kw):
        s = q @ k.transpose(-1, -2) * scaling + bias
        s = s.masked_fill(~causal, float("-inf"))
        return (s.softmax(-1) @ v).transpose(1, 2).contiguous(), None

    transformers.AttentionInterface.register("test_alibi", eager)
    model.set_attn_implementation("test_alibi")
    with torch.no_grad():  # no RoPE: the rotary module's identity
        handle = model.model.rotary_emb.register_forward_hook(
            lambda mod, args, out: (torch.ones_like(out[0]), torch.zeros_like(out[1]))
        )
        try:
            want = model(x).logits
        finally:
            handle.remove()
    assert gap(got, want) < 1e-5


def test_mla_refusals():
    model = deepseek()
    for name, why in (
        ("xpos", "qk_rope_head_dim=8"),
        ("rope-interleaved", "qk_rope_head_dim=8"),
        ("shaw", "value heads are 12 wide"),
    ):
        with pytest.raises(ConfigError, match=why):
            hf.patch(model, name)
    with pytest.raises(ConfigError, match="rotates the last 4 channels"):
        hf.patch(model, "rope-mla", rope_dim=4)
    linear = deepseek(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0})
    with pytest.raises(ConfigError, match="rope_type 'linear'"):
        hf.patch(linear, "rope")
    x = tokens(1, 20)
    want = linear(x).logits
    hf.patch(linear, "rope-linear")  # named: the model's own scaling on its slice, through its own rotation
    assert gap(linear(x).logits, want) <= 1e-6
    assert hf.patched(model) is None
    assert [layer.self_attn.scaling for layer in model.model.layers] == [
        deepseek().model.layers[0].self_attn.scaling
    ] * len(model.model.layers)


def test_mla_own_scheme_rotate_half_layout_and_latent_queries():
    """``rope_interleave=False`` (the slice in rotate-half pairs) and queries through a low-rank latent
    (``q_lora_rank``): still the model's own logits."""
    model = deepseek(rope_interleave=False, q_lora_rank=12)
    x = tokens(2, 40)
    want = model(x).logits
    hf.patch(model, "rope")
    assert hf.patched(model).encoding.interleaved is False
    assert gap(model(x).logits, want) <= 1e-6
