"""A tiny random Llama written as a GGUF file with the ``gguf`` package's own writer (the loader's tests use it
instead of the 98 MB packaged model).

The tokenizer is GPT-2's byte-level BPE over the 256 byte symbols plus three merges, so any text tokenizes.
:func:`write` returns the float32 arrays it wrote, by GGUF tensor name, so that a test can compare the loaded
weights with them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def byte_symbols() -> list[str]:
    """GPT-2's printable stand-in for each byte 0..255 (the byte-level BPE alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he"]
TOKENS = [*SPECIAL, *byte_symbols(), "Ġt", "he", "Ġthe"]


def write(
    path: str | Path,
    *,
    seed: int = 0,
    layers: int = 2,
    hidden: int = 32,
    heads: int = 4,
    kv_heads: int = 2,
    ff: int = 64,
    context: int = 64,
    rope_base: float = 10000.0,
) -> dict[str, np.ndarray]:
    """Write a random Llama of these sizes to ``path`` (float32 tensors); returns the tensors written."""
    import gguf

    rng = np.random.default_rng(seed)
    vocab = len(TOKENS)
    head_dim = hidden // heads
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_block_count(layers)
    w.add_context_length(context)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(rope_base)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(TOKENS)
    w.add_token_types([3] * len(SPECIAL) + [1] * (vocab - len(SPECIAL)))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    written: dict[str, np.ndarray] = {}

    def tensor(name: str, shape: tuple[int, ...], scale: float = 0.2) -> None:
        a = (rng.standard_normal(shape) * scale).astype(np.float32) if scale else np.ones(shape, np.float32)
        w.add_tensor(name, a)
        written[name] = a

    tensor("token_embd.weight", (vocab, hidden), 0.5)
    for i in range(layers):
        tensor(f"blk.{i}.attn_norm.weight", (hidden,), 0)
        tensor(f"blk.{i}.ffn_norm.weight", (hidden,), 0)
        tensor(f"blk.{i}.attn_q.weight", (hidden, hidden))
        tensor(f"blk.{i}.attn_k.weight", (kv_heads * head_dim, hidden))
        tensor(f"blk.{i}.attn_v.weight", (kv_heads * head_dim, hidden))
        tensor(f"blk.{i}.attn_output.weight", (hidden, hidden))
        tensor(f"blk.{i}.ffn_gate.weight", (ff, hidden))
        tensor(f"blk.{i}.ffn_up.weight", (ff, hidden))
        tensor(f"blk.{i}.ffn_down.weight", (hidden, ff))
    tensor("output_norm.weight", (hidden,), 0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written


def load_cached(path, tmp_path_factory):
    """``posenc.hf.load_pretrained(path)`` with its model cache in a fresh temporary folder (``POSENC_DATA``), so
    that a test's conversion never touches the user's cache: ``(model, tokenizer)``."""
    import pytest

    import posenc.hf

    mp = pytest.MonkeyPatch()
    mp.setenv("POSENC_DATA", str(tmp_path_factory.mktemp("cache")))
    try:
        return posenc.hf.load_pretrained(path, quiet=True)
    finally:
        mp.undo()
