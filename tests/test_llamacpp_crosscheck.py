"""llama.cpp itself (through llama-cpp-python, `bash scripts/setup.sh serve`) runs what posenc.hf.export(format="gguf")
writes: a tiny random Llama (tests/tiny_gguf.py, F32, trained context 64) patched with each scaling llama.cpp
expresses, exported, and its logits over 160 tokens (2.5 times the trained context, so that the scalings' long-range
behaviour and YaRN's attention factor count) compared with posenc's patched model on the same tokens.

With F32 weights and an F32 KV cache the two differ only by float32 rounding in a different order: the tolerance
is 2e-4 on logits of mean size 2.2 (measured: 1.0-1.9e-5). A wrong key (YaRN's attention factor written as
convert_hf_to_gguf.py writes it, applied twice or not at all; a linear factor read as its inverse) moves logits
by 1e-2 or more. The real model's cross-check is benchmarks/crosscheck_llamacpp.py (docs/export.md).
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

if importlib.util.find_spec("llama_cpp") is None:
    pytest.skip(
        "llama-cpp-python is not installed (it builds from source, about 4 min on 2 cores: setup.sh serve)",
        allow_module_level=True,
    )
pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("accelerate")

from tiny_gguf import load_cached, write  # noqa: E402

import posenc.hf  # noqa: E402

TOKENS, CONTEXT, TOLERANCE = 160, 64, 2e-4


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    write(path, layers=2, hidden=32, heads=4, kv_heads=2, ff=64, context=CONTEXT)
    return load_cached(path, tmp_path_factory)


def llamacpp_logits(path, ids: list[int]) -> np.ndarray:
    from llama_cpp import GGML_TYPE_F32, Llama

    llm = Llama(
        model_path=str(path),
        n_ctx=len(ids),
        n_batch=len(ids),
        logits_all=True,
        n_threads=1,
        verbose=False,
        type_k=GGML_TYPE_F32,
        type_v=GGML_TYPE_F32,
    )
    try:
        llm.eval(ids)
        return np.array(llm.scores[: len(ids)], dtype=np.float64)
    finally:
        llm.close()


@pytest.mark.parametrize(
    ("encoding", "options"),
    [
        (None, {}),
        ("rope-linear", {"factor": 2.5}),
        ("rope-ntk", {"factor": 2.5}),
        ("rope-yarn", {"factor": 2.5}),
        ("rope-yarn", {"factor": 4.0, "attention_factor": 1.3}),
        ("rope-llama3", {"factor": 4.0}),
    ],
)
@pytest.mark.parametrize("source_gguf", [None, False], ids=["copied", "converted"])
def test_llamacpp_runs_the_export_like_posenc(loaded, tmp_path, encoding, options, source_gguf):
    model, tok = loaded
    posenc.hf.unpatch(model)
    if encoding is not None:
        posenc.hf.patch(model, encoding, **options)
    try:
        ids = torch.randint(3, model.config.vocab_size, (TOKENS,), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            ours = model(input_ids=ids[None]).logits[0].double().numpy()
        out = posenc.hf.export(
            model, tmp_path / "m.gguf", format="gguf", tokenizer=tok, source_gguf=source_gguf, dtype="f32"
        )
    finally:
        posenc.hf.unpatch(model)
    theirs = llamacpp_logits(out, ids.tolist())
    assert theirs.shape == ours.shape
    diff = np.abs(theirs - ours).max()
    assert diff < TOLERANCE, f"{encoding}: llama.cpp's logits differ from posenc's by {diff:.2e}"
    # the logits move with the scaling at all: past the trained context they are not plain RoPE's
    if encoding is not None:
        with torch.no_grad():
            plain = model(input_ids=ids[None]).logits[0].double().numpy()
        assert np.abs(plain[CONTEXT:] - ours[CONTEXT:]).max() > 50 * TOLERANCE
