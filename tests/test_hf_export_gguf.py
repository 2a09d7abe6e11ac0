"""posenc.hf.export(format="gguf"): llama.cpp's RoPE keys for every scaling it can express, read back with the gguf
package from a tiny GGUF the test writes (tests/tiny_gguf.py); a model loaded from a GGUF keeps its tensors and its
other keys byte for byte; a converted model's tensors are the source's (F32) or their float16 (F16); what llama.cpp
cannot express is refused by name.

The expected values are computed here from the formulas (NTK's θ·s^(d/(d-2)); ggml's YaRN magnitude 1 + 0.1 ln s)
and from transformers (Llama 3's frequencies), not from posenc.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")

from tiny_gguf import load_cached, write  # noqa: E402

import posenc.hf  # noqa: E402
from posenc.errors import ConfigError  # noqa: E402

THETA, CONTEXT, HEAD_DIM = 10000.0, 64, 8


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    write(path, layers=2, hidden=32, heads=4, kv_heads=2, ff=64, context=CONTEXT, rope_base=THETA)
    return path


@pytest.fixture(scope="module")
def loaded(source, tmp_path_factory):
    return load_cached(source, tmp_path_factory)


@pytest.fixture()
def model(loaded):
    m, _ = loaded
    posenc.hf.unpatch(m)
    yield m
    posenc.hf.unpatch(m)


def fields(path) -> dict:
    r = gguf.GGUFReader(str(path))
    return {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}


def rope_of(path) -> dict:
    return {k: v for k, v in fields(path).items() if ".rope." in k or k.endswith(".context_length")}


def test_the_model_records_its_gguf(loaded, source):
    assert loaded[0].posenc_gguf == str(source.resolve())


@pytest.mark.parametrize(
    ("encoding", "options", "expected"),
    [
        (None, {}, {"type": "none", "freq_base": THETA, "context_length": CONTEXT}),
        ("rope-linear", {"factor": 2.0}, {"type": "linear", "factor": 2.0, "orig": CONTEXT, "context_length": 128}),
        ("rope-ntk", {"factor": 4.0}, {"type": "none", "freq_base": THETA * 4.0 ** (HEAD_DIM / (HEAD_DIM - 2))}),
        ("rope-yarn", {"factor": 2.0}, {"type": "yarn", "factor": 2.0, "orig": CONTEXT, "attn": 1.0}),
        (
            "rope-yarn",
            {"factor": 4.0},
            {"type": "yarn", "factor": 4.0, "orig": CONTEXT, "attn": 1.0, "context_length": 256},
        ),
        # an attention factor of its own: llama.cpp multiplies rope.scaling.attn_factor by 1 + 0.1 ln s
        (
            "rope-yarn",
            {"factor": 2.0, "attention_factor": 1.25},
            {"type": "yarn", "factor": 2.0, "orig": CONTEXT, "attn": 1.25 / (1 + 0.1 * math.log(2))},
        ),
    ],
)
def test_rope_keys_per_scaling(model, tmp_path, encoding, options, expected):
    if encoding is not None:
        posenc.hf.patch(model, encoding, **options)
    out = posenc.hf.export(model, tmp_path / "m.gguf", format="gguf")
    got = rope_of(out)
    assert got["llama.rope.scaling.type"] == expected["type"]
    assert got["llama.rope.freq_base"] == pytest.approx(expected.get("freq_base", THETA), rel=1e-6)
    if "context_length" in expected:
        assert got["llama.context_length"] == expected["context_length"]
    if "factor" in expected:
        assert got["llama.rope.scaling.factor"] == pytest.approx(expected["factor"])
        assert got["llama.rope.scaling.original_context_length"] == expected["orig"]
    else:
        assert "llama.rope.scaling.factor" not in got
    if "attn" in expected:
        assert got["llama.rope.scaling.attn_factor"] == pytest.approx(expected["attn"], rel=1e-6)
    else:
        assert "llama.rope.scaling.attn_factor" not in got


def test_a_gguf_source_keeps_its_tensors_and_other_keys_byte_for_byte(model, source, tmp_path):
    posenc.hf.patch(model, "rope-yarn", factor=2.0)
    out = posenc.hf.export(model, tmp_path, format="gguf")
    assert out == tmp_path / "model.gguf"
    a, b = gguf.GGUFReader(str(source)), gguf.GGUFReader(str(out))
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    for x, y in zip(a.tensors, b.tensors):
        assert x.tensor_type == y.tensor_type and x.shape.tolist() == y.shape.tolist()
        assert x.data.tobytes() == y.data.tobytes(), x.name

    def raw(reader):
        rope = (".rope.freq_base", ".rope.scaling.", ".context_length")
        return {
            k: b"".join(p.tobytes() for p in f.parts)
            for k, f in reader.fields.items()
            if not k.startswith("GGUF.") and not any(s in k for s in rope)
        }

    assert raw(a) == raw(b)
    assert fields(source)["llama.rope.dimension_count"] == fields(out)["llama.rope.dimension_count"] == HEAD_DIM


def test_llama3_is_written_as_rope_freqs(model, tmp_path):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    posenc.hf.patch(model, "rope-llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0)
    out = posenc.hf.export(model, tmp_path / "m.gguf", format="gguf")
    assert rope_of(out)["llama.rope.scaling.type"] == "none"
    freqs = {t.name: t for t in gguf.GGUFReader(str(out)).tensors}["rope_freqs.weight"]
    # llama.cpp divides θ_i by rope_freqs[i]: transformers' Llama 3 frequencies from the same settings
    cfg = model.config.__class__.from_dict(model.config.to_dict())
    cfg.rope_parameters = {
        "rope_type": "llama3",
        "rope_theta": THETA,
        "factor": 4.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": CONTEXT,
    }
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    plain = 1.0 / THETA ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)
    np.testing.assert_allclose(np.asarray(freqs.data), (plain / theirs).numpy(), rtol=1e-5)
    assert len(set(np.round(np.asarray(freqs.data), 4).tolist())) > 2  # fast, slow and a smooth one in between


def test_conversion_gives_the_source_tensors(model, loaded, source, tmp_path):
    """A model converted from its weights (source_gguf=False): llama.cpp's names and q/k layout, so the F32
    file's tensors are the F32 source's, byte for byte, and the F16 file's their float16 (1-D ones F32)."""
    tok = loaded[1]
    src = {t.name: t for t in gguf.GGUFReader(str(source)).tensors}
    f32 = posenc.hf.export(model, tmp_path / "f32.gguf", format="gguf", source_gguf=False, dtype="f32", tokenizer=tok)
    f16 = posenc.hf.export(model, tmp_path / "f16.gguf", format="gguf", source_gguf=False, tokenizer=tok)
    for t in gguf.GGUFReader(str(f32)).tensors:
        assert t.data.tobytes() == src[t.name].data.tobytes(), t.name
    got16 = {t.name: t for t in gguf.GGUFReader(str(f16)).tensors}
    assert set(got16) == set(src)
    for name, t in got16.items():
        want = np.asarray(src[name].data)
        if want.ndim > 1:
            assert t.tensor_type == gguf.GGMLQuantizationType.F16
            assert np.asarray(t.data).tobytes() == want.astype(np.float16).tobytes(), name
        else:
            assert t.tensor_type == gguf.GGMLQuantizationType.F32
    meta, want = fields(f32), fields(source)
    for k in (
        "tokenizer.ggml.model",
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.merges",
        "llama.block_count",
        "llama.attention.head_count_kv",
        "llama.embedding_length",
        "tokenizer.ggml.eos_token_id",
    ):
        assert meta[k] == want[k], k
    assert meta["general.file_type"] == 0 and fields(f16)["general.file_type"] == 1


@pytest.mark.parametrize(
    ("encoding", "options", "words"),
    [
        ("rope-dynamic", {"factor": 2.0}, ["dynamic NTK", "llama.cpp"]),
        ("rope-longrope", {"factor": 2.0, "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}, ["LongRoPE"]),
        ("rope-yarn", {"factor": 2.0, "beta_fast": 16.0}, ["beta_fast=16", "yarn_beta_fast"]),
        ("alibi", {}, ["alibi", "ALiBi"]),
    ],
)
def test_what_llamacpp_cannot_express_is_refused_by_name(model, tmp_path, encoding, options, words):
    posenc.hf.patch(model, encoding, **options)
    with pytest.raises(ConfigError) as err:
        posenc.hf.export(model, tmp_path / "m.gguf", format="gguf")
    for w in words:
        assert w in str(err.value)
    assert not (tmp_path / "m.gguf").exists()


def test_bad_arguments(model, loaded, tmp_path):
    with pytest.raises(ConfigError, match="dtype must be one of 'f16', 'f32'"):
        posenc.hf.export(model, tmp_path / "m.gguf", format="gguf", source_gguf=False, dtype="bf16")
    with pytest.raises(ConfigError, match="tokenizer is needed"):
        posenc.hf.export(model, tmp_path / "m.gguf", format="gguf", source_gguf=False)
    with pytest.raises(ConfigError, match="source_gguf=.*no such file"):
        posenc.hf.export(model, tmp_path / "m.gguf", format="gguf", source_gguf=tmp_path / "missing.gguf")
    assert not list(tmp_path.iterdir())


def test_changed_weights_are_not_overwritten_by_the_source(model, tmp_path):
    w = model.model.layers[0].mlp.up_proj.weight
    before = w.detach().clone()
    try:
        with torch.no_grad():
            w.add_(0.5)
        with pytest.raises(ConfigError, match="changed after loading.*source_gguf=False"):
            posenc.hf.export(model, tmp_path / "m.gguf", format="gguf")
    finally:
        with torch.no_grad():
            w.copy_(before)
