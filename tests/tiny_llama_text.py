"""A tiny random Llama and a byte-level tokenizer (every byte one token, no merges), built in milliseconds, for the
tests of fine-tuning and of LongRoPE's search (``test_extend_finetune.py``, ``test_longrope_search.py``).

Hidden 32, 2 layers, 4 heads (2 key-value heads), head dimension 8 (4 rotary pairs), trained length 64 tokens.
"""

from __future__ import annotations

import functools
from typing import Any

TRAINED = 64


@functools.lru_cache(maxsize=1)
def tokenizer() -> Any:
    """GPT-2's byte-level pre-tokenizer over the 256 byte symbols, no merges, plus ``<|endoftext|>`` (id 0)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<|endoftext|>": 0, **{c: i + 1 for i, c in enumerate(alphabet)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>")


def model(seed: int = 0, sharpen: float = 1.0) -> Any:
    """A fresh tiny Llama (float32, eval mode) with weights drawn from ``seed``; ``sharpen`` multiplies the query
    and key projections (sharper attention than a fresh model's near-uniform one, so that positions matter)."""
    import torch
    import transformers as t

    tok = tokenizer()
    torch.manual_seed(seed)
    cfg = t.LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=TRAINED, eos_token_id=0, bos_token_id=0, pad_token_id=0,
    )
    m = t.LlamaForCausalLM(cfg)
    if sharpen != 1.0:
        with torch.no_grad():
            for mod in m.modules():
                for name in ("q_proj", "k_proj"):
                    lin = getattr(mod, name, None)
                    if isinstance(lin, torch.nn.Linear):
                        lin.weight.mul_(sharpen)
    return m.eval()
