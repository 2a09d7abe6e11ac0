"""Write a patched model as a GGUF file for llama.cpp: :func:`posenc.hf.export` with ``format="gguf"`` calls
:func:`write_gguf` with the patch described in transformers' ``rope_parameters`` terms
(:func:`posenc.hf.export.native_rope_parameters`).

The RoPE is written in llama.cpp's own keys (``gguf-py/gguf/constants.py``, ``Keys.Rope``), as llama.cpp 0.3.36's
vendored source reads them (``src/llama-model.cpp``, ``src/llama-context.cpp``, ``ggml-cpu/ops.cpp``):

* ``{arch}.context_length``: the exported context (the stretched length);
* ``{arch}.rope.freq_base``: θ (posenc's NTK-by-base ``rope-ntk`` is RoPE with θ' = θ·s^(d/(d-2)): ``none`` with θ');
* ``{arch}.rope.scaling.type``: ``none`` / ``linear`` / ``yarn``, with ``.factor`` and
  ``.original_context_length``;
* YaRN's attention factor. llama.cpp scales cos and sin by ``rope.scaling.attn_factor × (1 + 0.1 ln s)`` (the
  second factor is ggml's own, applied whenever YaRN's ramp is on; ``llama-context.cpp`` cancels the
  ``yarn_attn_factor`` it computes, so a ``yarn_attn_factor`` key, which ``convert_hf_to_gguf.py`` writes, has no
  effect on a Llama). The factor is therefore written as ``rope.scaling.attn_factor = A / (1 + 0.1 ln s)``: 1.0 for
  YaRN's own ``A = 1 + 0.1 ln s``;
* Llama 3's per-frequency scaling as llama.cpp's ``rope_freqs.weight`` tensor (θ_i is divided by its factor), with
  scaling type ``none``.

What llama.cpp cannot express is refused by name: dynamic NTK (llama.cpp's rotation is fixed when a context is
created), LongRoPE (llama.cpp's Llama reads no long/short factor tensors), YaRN with other β than 32 / 1, without
truncation or with DeepSeek's ``mscale_all_dim`` (the Llama loader reads no such keys), partial rotation (the
Llama loader requires ``n_rot`` = head size), RoPE switched per layer, and every encoding that is not RoPE
(:func:`posenc.hf.export.native_rope_parameters` refuses those first).

Weights: a model that came from a GGUF file (:func:`posenc.hf.load_pretrained` records it as ``model.posenc_gguf``)
keeps that file's tensors and every key that is not a RoPE or context key, byte for byte (no requantisation; its
weights are first checked to be still the file's). Any other model is converted from its state dict (Llama only:
q/k rows permuted into llama.cpp's layout as ``convert_hf_to_gguf.py`` does) to F16 (1-D tensors F32) or F32, with
the tokenizer's vocabulary.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

from ..errors import ConfigError
from .families import _unwrap, text_config

#: the dtypes a model not from a GGUF is written in
DTYPES = ("f16", "f32")
#: llama.cpp's defaults for YaRN's ramp, which its Llama loader does not read from the file
YARN_BETAS = (32.0, 1.0)
#: the architectures whose tensors :func:`write_gguf` converts (and checks, for a model from a GGUF)
ARCHITECTURES = ("llama",)


def _refuse(what: str, why: str) -> ConfigError:
    return ConfigError(
        f"posenc.hf.export(format='gguf'): {what} cannot be written for llama.cpp: {why}; export it with "
        "format='transformers' instead, or keep posenc's own format (posenc.hf.save_pretrained)"
    )


def rope_keys(arch: str, rope: dict[str, Any], context_length: int, original: int) -> dict[str, Any]:
    """llama.cpp's RoPE and context keys for one flat ``rope_parameters`` set, as ``{key: value}`` (floats are
    written as float32, ints as uint32, the type as a string); ``rope_freqs`` (Llama 3's per-frequency factors)
    comes back under the key ``"rope_freqs.weight"`` as a float32 array. Refuses what llama.cpp cannot express."""
    if not isinstance(rope, dict) or any(isinstance(v, dict) for v in rope.values()):
        raise _refuse(
            "rope_parameters given per layer type",
            "llama.cpp's GGUF keys hold one RoPE for every layer (its sliding-window keys are not written here)",
        )
    kind = rope.get("rope_type", "default")
    theta = float(rope.get("rope_theta", 10000.0))
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise _refuse(
            f"partial_rotary_factor={rope['partial_rotary_factor']}",
            "llama.cpp's Llama loader requires the rotated dimensions to equal the head size",
        )
    out: dict[str, Any] = {
        f"{arch}.context_length": int(context_length),
        f"{arch}.rope.freq_base": theta,
    }
    if kind == "default":
        out[f"{arch}.rope.scaling.type"] = "none"
        return out
    if kind == "dynamic":
        raise _refuse(
            "dynamic NTK (rope-dynamic)",
            "llama.cpp fixes the rotation when a context is created and has no scaling that grows θ with the "
            "sequence length (its scaling types are none, linear, yarn and longrope)",
        )
    if kind == "longrope":
        raise _refuse(
            "LongRoPE (rope-longrope)",
            "llama.cpp's Llama reads no long/short factor tensors (rope_factors_long/short are Phi-3's)",
        )
    factor = float(rope["factor"])
    orig = int(rope.get("original_max_position_embeddings") or original)
    if kind == "linear":
        out[f"{arch}.rope.scaling.type"] = "linear"
        out[f"{arch}.rope.scaling.factor"] = factor
        out[f"{arch}.rope.scaling.original_context_length"] = orig
        return out
    if kind == "yarn":
        betas = (float(rope.get("beta_fast", 32.0)), float(rope.get("beta_slow", 1.0)))
        if betas != YARN_BETAS:
            raise _refuse(
                f"YaRN with beta_fast={betas[0]:g}, beta_slow={betas[1]:g}",
                "llama.cpp's Llama loader does not read yarn_beta_fast / yarn_beta_slow from the file and ramps "
                "between 32 and 1 (a context can be given others: Llama(..., yarn_beta_fast=, yarn_beta_slow=))",
            )
        if rope.get("truncate", True) is False:
            raise _refuse("YaRN with truncate=False", "llama.cpp always rounds the ramp's ends (floor / ceil)")
        if rope.get("mscale_all_dim") is not None or rope.get("mscale") is not None:
            raise _refuse(
                "YaRN with DeepSeek's mscale / mscale_all_dim",
                "llama.cpp reads yarn_log_multiplier only for DeepSeek-2/3, GLM-DSA and Mistral 3, not for Llama",
            )
        if factor <= 1.0:
            raise _refuse(f"YaRN with factor={factor:g}", "llama.cpp switches YaRN's ramp off for factors <= 1")
        own = 1.0 + 0.1 * math.log(factor)  # what ggml multiplies cos and sin by when the ramp is on
        attention = float(rope.get("attention_factor") or own)
        out[f"{arch}.rope.scaling.type"] = "yarn"
        out[f"{arch}.rope.scaling.factor"] = factor
        out[f"{arch}.rope.scaling.original_context_length"] = orig
        out[f"{arch}.rope.scaling.attn_factor"] = 1.0 if math.isclose(attention, own, rel_tol=1e-6) else attention / own
        return out
    if kind == "llama3":
        out[f"{arch}.rope.scaling.type"] = "none"
        out["rope_freqs.weight"] = llama3_factors(rope, theta, int(rope["_head_dim"]), orig)
        return out
    raise _refuse(f"rope_type {kind!r}", "it is not one of the scalings llama.cpp computes (none, linear, yarn)")


def llama3_factors(rope: dict[str, Any], theta: float, head_dim: int, original: int) -> np.ndarray:
    """Llama 3's factor per frequency pair (1 for the fast ones, ``factor`` for the slow, a smooth step between):
    llama.cpp's ``rope_freqs.weight``, by which it divides each θ_i (as ``convert_hf_to_gguf.py`` computes it)."""
    factor = float(rope["factor"])
    low, high = float(rope.get("low_freq_factor", 1.0)), float(rope.get("high_freq_factor", 4.0))
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    wavelen = 2 * math.pi / freqs
    smooth = (original / wavelen - low) / (high - low)
    mid = 1.0 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, mid))
    return out.astype(np.float32)


# ------------------------------------------------------------------------------------------ the tensors
def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """transformers' q/k rows (rotate_half: pair i is rows i and i + d/2 of a head) in llama.cpp's order (pair i is
    rows 2i and 2i + 1): ``convert_hf_to_gguf.py``'s ``LlamaModel.permute``."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama_names(cfg: Any, n_layers: int) -> dict[str, tuple[str, int | None]]:
    """GGUF name -> (transformers state-dict name, heads to permute by or ``None``)."""
    heads, kv = int(cfg.num_attention_heads), int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    out: dict[str, tuple[str, int | None]] = {
        "token_embd.weight": ("model.embed_tokens.weight", None),
        "output_norm.weight": ("model.norm.weight", None),
    }
    if not getattr(cfg, "tie_word_embeddings", False):
        out["output.weight"] = ("lm_head.weight", None)
    for i in range(n_layers):
        p = f"model.layers.{i}."
        out.update(
            {
                f"blk.{i}.attn_norm.weight": (p + "input_layernorm.weight", None),
                f"blk.{i}.attn_q.weight": (p + "self_attn.q_proj.weight", heads),
                f"blk.{i}.attn_k.weight": (p + "self_attn.k_proj.weight", kv),
                f"blk.{i}.attn_v.weight": (p + "self_attn.v_proj.weight", None),
                f"blk.{i}.attn_output.weight": (p + "self_attn.o_proj.weight", None),
                f"blk.{i}.ffn_norm.weight": (p + "post_attention_layernorm.weight", None),
                f"blk.{i}.ffn_gate.weight": (p + "mlp.gate_proj.weight", None),
                f"blk.{i}.ffn_up.weight": (p + "mlp.up_proj.weight", None),
                f"blk.{i}.ffn_down.weight": (p + "mlp.down_proj.weight", None),
            }
        )
    return out


def _check_llama(model: nn.Module) -> Any:
    hf = _unwrap(model)
    cfg = text_config(hf)
    kind = getattr(cfg, "model_type", None)
    if kind not in ARCHITECTURES:
        raise _refuse(
            f"a {type(hf).__name__} (model_type {kind!r})",
            f"posenc writes llama.cpp's tensors for {', '.join(ARCHITECTURES)} only so far (SmolLM2 is a llama); "
            "a model loaded from a GGUF file of another architecture is not converted either",
        )
    for flag in ("attention_bias", "mlp_bias"):
        if getattr(cfg, flag, False):
            raise _refuse(f"a Llama with {flag}=True", "posenc's GGUF writer does not write bias tensors")
    return cfg


def _state(model: nn.Module) -> dict[str, np.ndarray]:
    hf = _unwrap(model)
    return {k: v.detach().float().cpu().numpy() for k, v in hf.state_dict().items() if ".posenc." not in f".{k}"}


def _check_same_weights(model: nn.Module, reader: Any, cfg: Any, source: Path, rows: int = 32) -> None:
    """The model's weights are still the GGUF file's (de-quantised, q/k back in transformers' order), else a
    :class:`ConfigError`: copying the file's tensors would silently drop a change (a fine-tune, a merge).

    Every tensor is compared on ``rows`` rows spread over it (de-quantising all of SmolLM2 takes 20-70 s; a
    fine-tune or a merged adapter changes every row of what it touches), exactly where the model is float32 (what
    :func:`posenc.hf.load_pretrained` de-quantises to, with the same gguf code), else to the model's precision."""
    import torch
    from gguf.quants import dequantize

    names = _llama_names(cfg, int(cfg.num_hidden_layers))
    params = dict(_unwrap(model).state_dict())
    for t in reader.tensors:
        if t.name not in names:
            continue
        hf_name, heads = names[t.name]
        ours_t = params.get(hf_name)
        shape = [int(n) for n in reversed(t.shape.tolist())]
        if ours_t is None or list(ours_t.shape) != shape:
            got = None if ours_t is None else list(ours_t.shape)
            raise ConfigError(
                f"posenc.hf.export(format='gguf'): the model's {hf_name} ({got}) is not the tensor {t.name} {shape} "
                f"of {source} it was loaded from; pass source_gguf=False to convert the model's own weights"
            )
        if len(shape) == 1:
            theirs = dequantize(t.data, t.tensor_type).reshape(shape)
            ours = ours_t.detach().float().cpu().numpy()
        else:
            pick = np.unique(np.linspace(0, shape[0] - 1, min(rows, shape[0])).round().astype(np.int64))
            data = np.asarray(t.data).reshape(shape[0], -1)
            theirs = dequantize(data[pick], t.tensor_type).reshape(len(pick), shape[1])
            # GGUF row r of q/k is transformers' row order[r]
            order = np.arange(shape[0]) if heads is None else _permute(np.arange(shape[0])[:, None], heads)[:, 0]
            ours = ours_t.detach()[torch.as_tensor(order[pick])].float().cpu().numpy()
        exact = ours_t.dtype == torch.float32
        same = np.array_equal(ours, theirs) if exact else np.allclose(ours, theirs, rtol=1e-2, atol=1e-3)
        if not same:
            raise ConfigError(
                f"posenc.hf.export(format='gguf'): the model's {hf_name} is not the tensor {t.name} of {source} it "
                f"was loaded from (largest difference {float(np.abs(ours - theirs).max()):.3g}): its weights were "
                "changed after loading, and copying the file's tensors would drop that change. Pass "
                "source_gguf=False to convert the model's own weights (f16 or f32)"
            )


# ------------------------------------------------------------------------------------------ the writers
def _add(writer: Any, key: str, value: Any) -> None:
    import gguf

    if isinstance(value, str):
        writer.add_key_value(key, value, gguf.GGUFValueType.STRING)
    elif isinstance(value, bool):
        writer.add_key_value(key, value, gguf.GGUFValueType.BOOL)
    elif isinstance(value, int):
        writer.add_key_value(key, value, gguf.GGUFValueType.UINT32)
    else:
        writer.add_key_value(key, float(value), gguf.GGUFValueType.FLOAT32)


def _is_rope_key(arch: str, key: str) -> bool:
    return key == f"{arch}.context_length" or key == f"{arch}.rope.freq_base" or key.startswith(f"{arch}.rope.scaling.")


def _copy_gguf(source: Path, out: Path, keys: dict[str, Any], freqs: np.ndarray | None, model: nn.Module) -> None:
    """``source``'s tensors and non-RoPE keys byte for byte, with ``keys`` (and ``rope_freqs.weight``) new."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    arch_field = reader.get_field(gguf.Keys.General.ARCHITECTURE)
    arch = str(arch_field.contents()) if arch_field is not None else "?"
    if arch not in ARCHITECTURES:
        raise _refuse(f"{source.name} (architecture {arch!r})", f"posenc copies GGUF files of {ARCHITECTURES} only")
    _check_same_weights(model, reader, _check_llama(model), source)
    writer = gguf.GGUFWriter(str(out), arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        if _is_rope_key(arch, field.name):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for k, v in keys.items():
        _add(writer, k, v)
    tensors = [t for t in reader.tensors if not (freqs is not None and t.name == "rope_freqs.weight")]
    for t in tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    if freqs is not None:
        writer.add_tensor_info("rope_freqs.weight", freqs.shape, freqs.dtype, freqs.nbytes)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in tensors:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    if freqs is not None:
        writer.write_tensor_data(freqs)
    writer.close()


def _vocab(writer: Any, tokenizer: Any, cfg: Any) -> None:
    """A byte-level BPE tokenizer (GPT-2 style, what SmolLM2 and Llama 3 use) as llama.cpp's ``gpt2`` vocabulary:
    tokens by id, their types, the merges and the special ids. The pre-tokenizer is written ``default``."""
    import json

    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    model = json.loads(backend.to_str())["model"] if backend is not None else {}
    if model.get("type") != "BPE":
        raise _refuse(
            f"the tokenizer {type(tokenizer).__name__} (model {model.get('type')!r})",
            "posenc writes byte-level BPE vocabularies only (llama.cpp's gpt2 tokenizer)",
        )
    vocab = tokenizer.get_vocab()
    n = max(int(getattr(cfg, "vocab_size", 0) or 0), max(vocab.values()) + 1)
    tokens = [f"[PAD{i}]" for i in range(n)]
    types = [5] * n  # unused
    for tok, i in vocab.items():
        tokens[i] = tok
        types[i] = 1
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    for added_id in getattr(tokenizer, "added_tokens_decoder", {}) or {}:
        special.add(int(added_id))
    for i in special:
        if 0 <= i < n:
            types[i] = 3
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for name, attr in (
        ("bos", "bos_token_id"),
        ("eos", "eos_token_id"),
        ("unk", "unk_token_id"),
        ("pad", "pad_token_id"),
    ):
        value = getattr(tokenizer, attr, None)
        if value is not None:
            getattr(writer, f"add_{name}_token_id")(int(value))
    writer.add_add_bos_token(False)


def _convert(model: nn.Module, out: Path, keys: dict[str, Any], freqs: np.ndarray | None, tokenizer: Any, dtype: str):
    """A Llama's state dict in llama.cpp's names and layout (``dtype``; 1-D tensors F32) with ``keys``."""
    import gguf

    cfg = _check_llama(model)
    if tokenizer is None:
        raise ConfigError(
            "posenc.hf.export(format='gguf'): tokenizer is needed for a model that did not come from a GGUF file "
            "(llama.cpp needs the vocabulary in the file): pass tokenizer=<the model's tokenizer>"
        )
    n_layers = int(cfg.num_hidden_layers)
    heads = int(cfg.num_attention_heads)
    kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name(str(getattr(cfg, "_name_or_path", "") or "posenc-export").rsplit("/", 1)[-1] or "posenc-export")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if dtype == "f16" else gguf.LlamaFileType.ALL_F32)
    writer.add_block_count(n_layers)
    writer.add_embedding_length(int(cfg.hidden_size))
    writer.add_feed_forward_length(int(cfg.intermediate_size))
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    writer.add_rope_dimension_count(head_dim)
    if head_dim != int(cfg.hidden_size) // heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_vocab_size(int(cfg.vocab_size))
    for k, v in keys.items():
        _add(writer, k, v)
    _vocab(writer, tokenizer, cfg)
    state = _state(model)
    for name, (hf_name, permute_heads) in _llama_names(cfg, n_layers).items():
        if hf_name not in state:
            raise ConfigError(f"posenc.hf.export(format='gguf'): the model has no {hf_name} (for {name})")
        w = state[hf_name]
        if permute_heads is not None:
            w = _permute(w, permute_heads)
        w = np.ascontiguousarray(w.astype(np.float16 if dtype == "f16" and w.ndim > 1 else np.float32))
        writer.add_tensor(name, w)
    if freqs is not None:
        writer.add_tensor("rope_freqs.weight", freqs)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _source_of(model: nn.Module, source_gguf: Any) -> Path | None:
    if source_gguf is False:
        return None
    if source_gguf is None or source_gguf is True:
        got = getattr(model, "posenc_gguf", None) or getattr(_unwrap(model), "posenc_gguf", None)
        if got is None:
            if source_gguf is True:
                raise ConfigError(
                    "source_gguf=True, but this model records no GGUF file it came from (posenc.hf.load_pretrained "
                    "records it): pass the file's path, or source_gguf=None to convert its weights"
                )
            return None
        source_gguf = got
    if not isinstance(source_gguf, (str, os.PathLike)):
        raise ConfigError(f"source_gguf must be a .gguf path, None (automatic) or False (convert), got {source_gguf!r}")
    path = Path(source_gguf)
    if not path.is_file():
        raise ConfigError(f"source_gguf={str(source_gguf)!r}: no such file (the GGUF file the model was loaded from)")
    return path


def write_gguf(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    tokenizer: Any = None,
    rope: dict[str, Any],
    source_gguf: str | os.PathLike | bool | None = None,
    dtype: str = "f16",
    max_position_embeddings: int | None = None,
    original_max_position_embeddings: int | None = None,
    **extra: Any,
) -> Path:
    """Write ``model`` with the RoPE ``rope`` (transformers' ``rope_parameters``) as a llama.cpp GGUF file.

    Args:
        model: a transformers Llama (patched or not).
        path: the ``.gguf`` file, or a folder (then ``<folder>/model.gguf``).
        tokenizer: the model's tokenizer (needed when its weights are converted; a GGUF source keeps its own).
        rope: the flat ``rope_parameters`` the file is to express.
        source_gguf: the GGUF file whose tensors and other keys are copied byte for byte; ``None``: the one
            :func:`posenc.hf.load_pretrained` recorded (``model.posenc_gguf``), if any; ``False``: convert the
            model's own weights.
        dtype: ``"f16"`` or ``"f32"`` for converted weights (1-D tensors are F32 either way).
        max_position_embeddings: ``{arch}.context_length`` (default the model config's).
        original_max_position_embeddings: the trained length, where the config keeps it outside ``rope``.

    Returns the file written. See the module's text for the keys and what is refused.
    """
    if extra.get("no_rope_layers") is not None:
        raise _refuse("RoPE switched per layer (no_rope_layers)", "llama.cpp's Llama rotates every layer")
    unknown = sorted(k for k in extra if k != "no_rope_layers")
    if unknown:
        raise ConfigError(
            f"posenc.hf.export(format='gguf') takes tokenizer, max_length, source_gguf and dtype; got {unknown}"
        )
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(map(repr, DTYPES))} (converted weights), got {dtype!r}")
    cfg = text_config(_unwrap(model))
    out = Path(path)
    if out.is_dir() or (not out.suffix and not out.exists()):
        out.mkdir(parents=True, exist_ok=True)
        out = out / "model.gguf"
    out.parent.mkdir(parents=True, exist_ok=True)
    own = getattr(cfg, "rope_parameters", None) or {}
    trained = int(
        original_max_position_embeddings
        or own.get("original_max_position_embeddings")
        or getattr(cfg, "original_max_position_embeddings", None)
        or cfg.max_position_embeddings
    )
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    rope = {**rope, "_head_dim": head_dim}
    keys = rope_keys("llama", rope, int(max_position_embeddings or cfg.max_position_embeddings), trained)
    freqs = keys.pop("rope_freqs.weight", None)
    source = _source_of(model, source_gguf)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        if source is not None:
            if source.resolve() == out.resolve():
                raise ConfigError(f"the export would overwrite its source {source}: give another path")
            _copy_gguf(source, tmp, keys, freqs, model)
        else:
            _convert(model, tmp, keys, freqs, tokenizer, dtype)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()
    return out
