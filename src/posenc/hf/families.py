"""The transformers model families :mod:`posenc.hf` can patch, and how it finds its way around one model.

Holds :class:`Family` (where a family keeps its blocks, attention modules, token embedding, learned position table
and rotary module), the table :data:`SUPPORTED`, and the small readers of a model that every other part of the
patch shares: the model inside a PEFT wrapper, its base model and family, its sizes, its dtype and device.

Imports only torch and :mod:`posenc.errors`: it is the bottom of :mod:`posenc.hf`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError


def _get(obj: Any, path: str | None) -> Any:
    """``obj.a.b`` for ``path`` ``"a.b"``, or ``None`` where a part is missing."""
    if path is None:
        return None
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


@dataclass(frozen=True)
class Family:
    """Where a family of transformers models keeps what a patch needs (dotted attribute paths).

    A new family joins :data:`SUPPORTED` with one entry: where its blocks, attention modules, token embedding,
    learned position table and rotary module are, which projections its attention has, the attribute holding the
    head width, and whether its attention calls transformers' ``AttentionInterface`` (without it only encodings
    that act outside the attention can be patched in).
    """

    name: str
    examples: str
    #: from the base model to the ``nn.ModuleList`` of blocks
    layers: str
    #: from a block to its attention module
    attn: str
    #: the attention module's projections (recognising the family)
    projections: tuple[str, ...]
    #: from the base model to the token embedding (its output gets absolute codes)
    token_path: str
    #: the attention module's attribute holding the head width
    head_dim_attr: str
    #: from the base model to its own learned position table, silenced while patched (None: it has none)
    table_path: str | None = None
    #: from the base model to the rotary module whose cos/sin the attention layers apply (None: it has none)
    rotary_path: str | None = None
    #: whether the attention calls transformers' attention-function registry (where posenc's attention goes in)
    interface: bool = True
    #: why a model of this family cannot be patched at all (None: it can), given the model
    refuse: Callable[[nn.Module], str | None] | None = None
    #: a further test of the base model that tells this family from another built alike (None: none)
    match: Callable[[nn.Module], bool] | None = None
    #: whether the family's text model is also found as the ``language_model`` of a vision-language model (only
    #: families whose positions there posenc.hf follows: the other vision-language models are not recognised)
    nested: bool = False

    def attention(self, base: nn.Module) -> list[nn.Module]:
        """The attention modules, in layer order."""
        return [_get(block, self.attn) for block in _get(base, self.layers)]

    def tokens(self, base: nn.Module) -> nn.Module:
        return _get(base, self.token_path)

    def table(self, base: nn.Module) -> nn.Module | None:
        return _get(base, self.table_path)

    def rotary(self, base: nn.Module) -> nn.Module | None:
        return _get(base, self.rotary_path)

    def head_dim(self, attn: nn.Module) -> int:
        return int(getattr(attn, self.head_dim_attr))

    def recognise(self, base: nn.Module) -> bool:
        blocks = _get(base, self.layers)
        if not isinstance(blocks, nn.ModuleList) or not len(blocks):
            return False
        attn = _get(blocks[0], self.attn)
        return (
            isinstance(attn, nn.Module)
            and all(isinstance(getattr(attn, p, None), nn.Module) for p in self.projections)
            and hasattr(attn, self.head_dim_attr)
            and isinstance(_get(base, self.token_path), nn.Embedding)
            and (self.table_path is None or isinstance(_get(base, self.table_path), nn.Embedding))
            and (self.rotary_path is None or isinstance(_get(base, self.rotary_path), nn.Module))
            and (self.match is None or self.match(base))
        )


def _falcon_refuses(model: nn.Module) -> str | None:
    if getattr(model.config, "alibi", False):
        return (
            "this Falcon adds its own ALiBi bias inside its attention (config.alibi=True), which a patch cannot "
            "silence; build it with alibi=False (rotary Falcon) to patch it"
        )
    return None


#: the rotary modules whose three position rows rotate contiguous sections of the rotary pairs, time first, as
#: posenc's ``mrope`` (Qwen2-VL's M-RoPE); other models with an ``mrope_section`` lay their axes out otherwise
#: (Qwen3-VL interleaves them, GLM-4V ...)
MROPE_ROTARY = ("Qwen2VLRotaryEmbedding", "Qwen2_5_VLRotaryEmbedding")


def _three_rows(base: nn.Module) -> bool:
    """A text model whose rotary module is Qwen2-VL's or Qwen2.5-VL's M-RoPE (:data:`MROPE_ROTARY`)."""
    rotary = getattr(base, "rotary_emb", None)
    return type(rotary).__name__ in MROPE_ROTARY and isinstance(getattr(rotary, "mrope_section", None), (list, tuple))


SUPPORTED: tuple[Family, ...] = (
    Family(
        "qwen2-vl",
        "the text models of Qwen2-VL and Qwen2.5-VL (Qwen2VLForConditionalGeneration, "
        "Qwen2_5_VLForConditionalGeneration, their *Model and *TextModel): M-RoPE on three position rows (time, "
        "height, width); the vision encoder is left as it is",
        layers="layers", attn="self_attn", projections=("q_proj", "k_proj", "v_proj"), token_path="embed_tokens",
        head_dim_attr="head_dim", rotary_path="rotary_emb", match=_three_rows, nested=True,
    ),
    Family(
        "deepseek-v3",
        "DeepSeek-V3 (DeepseekV3ForCausalLM, DeepseekV3Model): multi-head latent attention, RoPE (DeepSeek's YaRN) on "
        "the last qk_rope_head_dim channels of each head, its mscale² in the softmax scale",
        layers="layers", attn="self_attn", projections=("kv_a_proj_with_mqa", "kv_b_proj"), token_path="embed_tokens",
        head_dim_attr="qk_head_dim", rotary_path="rotary_emb",
    ),
    Family(
        "llama",
        "rotary decoders built like Llama: Llama, Mistral, Qwen2/3, Gemma 1-3, Mixtral, Qwen2-MoE, OLMo 1-3, Granite, "
        "Starcoder2, SmolLM3, Cohere2 (Command A), Llama 4 text (Llama4ForCausalLM) ... (*ForCausalLM and their "
        "bases)",
        layers="layers", attn="self_attn", projections=("q_proj", "k_proj", "v_proj"), token_path="embed_tokens",
        head_dim_attr="head_dim", rotary_path="rotary_emb",
    ),
    Family(
        "phi3",
        "Phi-3 (Phi3ForCausalLM, Phi3Model): one fused qkv_proj",
        layers="layers", attn="self_attn", projections=("qkv_proj",), token_path="embed_tokens",
        head_dim_attr="head_dim", rotary_path="rotary_emb",
    ),
    Family(
        "gpt-neox",
        "GPT-NeoX and Pythia (GPTNeoXForCausalLM, GPTNeoXModel): fused query_key_value, partial rotary",
        layers="layers", attn="attention", projections=("query_key_value",), token_path="embed_in",
        head_dim_attr="head_size", rotary_path="rotary_emb",
    ),
    Family(
        "falcon",
        "Falcon (FalconForCausalLM, FalconModel) with rotary positions; its attention calls SDPA itself, so only "
        "encodings acting outside the attention (RoPE scalings, absolute codes, NoPE) go in",
        layers="h", attn="self_attention", projections=("query_key_value",), token_path="word_embeddings",
        head_dim_attr="head_dim", rotary_path="rotary_emb", interface=False, refuse=_falcon_refuses,
    ),
    Family(
        "modernbert",
        "ModernBERT (ModernBertModel, ModernBertForMaskedLM, ...): an encoder with one fused Wqkv, RoPE with its own "
        "base per layer type (global and local layers)",
        layers="layers", attn="attn", projections=("Wqkv",), token_path="embeddings.tok_embeddings",
        head_dim_attr="head_dim", rotary_path="rotary_emb",
    ),
    Family(
        "gpt2",
        "GPT-2 (GPT2LMHeadModel, GPT2Model, GPT2ForSequenceClassification, ...)",
        layers="h", attn="attn", projections=("c_attn",), token_path="wte", head_dim_attr="head_dim",
        table_path="wpe",
    ),
    Family(
        "bert",
        "BERT (BertModel, BertForMaskedLM, BertForSequenceClassification, ...)",
        layers="encoder.layer", attn="attention.self", projections=("query", "key", "value"),
        token_path="embeddings.word_embeddings", head_dim_attr="attention_head_size",
        table_path="embeddings.position_embeddings",
    ),
)


def supported_models() -> str:
    """The supported model families, one per line (what the error for another model lists)."""
    return "\n".join(f"  {f.name}: {f.examples}" for f in SUPPORTED)


def _unwrap(model: nn.Module) -> nn.Module:
    """The transformers model inside a PEFT wrapper (``PeftModel``), or ``model`` itself."""
    get = getattr(model, "get_base_model", None)
    if callable(get) and type(model).__module__.split(".")[0] == "peft":
        return get()
    return model


def _base_and_family(model: nn.Module) -> tuple[nn.Module, Family]:
    """The module holding the blocks (``model.base_model``, or ``model`` itself) and its family; a model of no
    supported family is a :class:`~posenc.errors.ConfigError` listing them."""
    base = getattr(model, "base_model", model)
    inner = model._modules.get("model") if isinstance(getattr(model, "_modules", None), dict) else None
    # Llama4ForCausalLM names its base model prefix "language_model" but keeps it at .model; a vision-language
    # model (Qwen2-VL) keeps its text model at .model.language_model
    nested = [getattr(c, "_modules", {}).get("language_model") for c in (base, model, inner) if c is not None]
    for candidate, inside in ((base, False), (model, False), (inner, False), *((c, True) for c in nested)):
        if candidate is None:
            continue
        for family in SUPPORTED:
            if (family.nested or not inside) and family.recognise(candidate):
                return candidate, family
    raise ConfigError(
        f"posenc.hf cannot patch a {type(model).__name__}: it supports these transformers model families\n"
        f"{supported_models()}"
    )


def _own_rotation(attn: nn.Module, config: Any) -> bool:
    """Whether the model itself rotates this attention layer's queries and keys by the rotary module's phases: not
    where its layer has no RoPE -- SmolLM3's and Llama 4's ``no_rope_layers`` (the module's ``use_rope``), Cohere2's
    global layers (it rotates only its sliding-window layers)."""
    if hasattr(attn, "use_rope"):
        return bool(attn.use_rope)
    if getattr(config, "model_type", None) == "cohere2":
        return getattr(attn, "sliding_window", None) is not None
    return True


#: the attribute of an attention module that switches the model's own query temperature on (Llama 4's
#: ``attn_temperature_tuning``, applied by the module itself on its layers without RoPE)
OWN_TEMPERATURE = "attn_temperature_tuning"


def _own_temperature(attn: nn.Module) -> bool:
    """Whether the model multiplies this layer's queries by a temperature of its own before the attention function
    (Llama 4's NoPE layers with ``attn_temperature_tuning``)."""
    return bool(getattr(attn, OWN_TEMPERATURE, False)) and not bool(getattr(attn, "use_rope", True))


def _latent(attn: nn.Module) -> bool:
    """Whether this attention module is multi-head latent attention (DeepSeek-V3): keys and values from a latent,
    RoPE on the last ``qk_rope_head_dim`` channels of each head, a softmax ``scaling`` of its own."""
    return hasattr(attn, "qk_rope_head_dim") and hasattr(attn, "kv_b_proj") and hasattr(attn, "scaling")


def text_config(model: nn.Module) -> Any:
    """The config of the model's text decoder: ``model.config`` itself, or its ``text_config`` in a vision-language
    model (Qwen2-VL), whose own config holds the text model's sizes and RoPE settings there."""
    cfg = model.config
    inner = getattr(cfg, "text_config", None)
    return inner if inner is not None and getattr(inner, "hidden_size", None) is not None else cfg


def _model_dims(model: nn.Module, family: Family, attn: nn.Module) -> dict[str, Any]:
    """The sizes an encoding is built for, read from the model's config and its first attention module."""
    cfg = text_config(model)
    return dict(
        d_model=int(cfg.hidden_size),
        n_heads=int(cfg.num_attention_heads),
        head_dim=family.head_dim(attn),
        max_len=int(getattr(cfg, "max_position_embeddings", 512)),
        vocab_size=int(cfg.vocab_size),
        n_layers=int(cfg.num_hidden_layers),
        causal=bool(getattr(attn, "is_causal", family.name != "bert")),
        embedding_std=float(getattr(cfg, "initializer_range", 0.02)),
    )


def _model_dtype_device(model: nn.Module) -> tuple[torch.dtype, torch.device]:
    """The dtype and device of the model's first floating parameter (float32 on the CPU without one)."""
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype, p.device
    return torch.float32, torch.device("cpu")
