"""posenc inside transformers: swap or extend the positional encoding of a Hugging Face model in one call.

>>> model = posenc.hf.patch(model, "alibi")            # doctest: +SKIP
>>> model = posenc.hf.patch(model, "rope-yarn", factor=4)  # doctest: +SKIP
>>> posenc.hf.unpatch(model)                           # doctest: +SKIP

``patch`` works through transformers' own extension points, not copies of its classes:

* **attention** -- an attention function registered with transformers' ``AttentionInterface`` under the
  name ``"posenc"`` (and the boolean mask of ``AttentionMaskInterface`` under the same name). Each attention
  layer of the model gets a :class:`posenc.attention.AttentionCore` holding the encoding; the model's own
  projections, KV cache and masks feed it, and it runs the encoding's ``rotate`` / ``logits`` / ``bias`` /
  ``values`` / ``scale`` hooks with posenc's fast kernels (the same plan as :class:`posenc.MultiHeadAttention`).
  Every keyword transformers passes is honoured (``scaling``, ``dropout``, ``is_causal``, ``sliding_window``,
  ``softcap``, sinks ``s_aux``, ``output_attentions``) or refused by name (``position_bias``, any other).
* **the rotary module** of rotary models (``model.model.rotary_emb``): a forward hook replaces its cos/sin
  with the encoding's (any RoPE scaling in HF's rotate-half layout: the attention stays transformers' own and
  the cache keeps rotated keys, exactly as the unpatched model), or with the identity where the rotation moves
  into the posenc attention (xPos, interleaved or partial RoPE, randomized positions) or there is none. Models
  whose layer types have their own ``rope_parameters`` (Gemma 3) get one encoding per layer type.
* **absolute codes**: a forward hook on the token embedding adds the encoding's ``embed``; the model's own
  learned table (GPT-2 ``wpe``, BERT ``position_embeddings``) is silenced by a hook that returns zeros (its
  weights stay in the model; :func:`unpatch` gives it back).

Positions. Without a cache the positions are the model's ``position_ids`` (or ``past + arange``), passed
through the encoding's ``positions`` hook (randomized positions) once per forward. With a KV cache the keys'
positions are the ones the cache reports for its mask (``get_mask_sizes``: a static cache's slots, a sliding
window's kept keys) and the new queries' follow the cached ones, which is what transformers' masks assume:
offsets ``j - i`` (all a relative encoding sees) are then exact, left padding included.

Supported (:data:`SUPPORTED`, one entry per family): the rotary decoders built like Llama (Llama, Mistral,
Qwen2/3, Gemma 1-3, Mixtral, Qwen2-MoE ...), the text models of Qwen2-VL and Qwen2.5-VL (M-RoPE on three position
rows), DeepSeek-V3 (multi-head latent attention, RoPE on a slice of each head), Phi-3, GPT-NeoX, Falcon (rotary and
absolute encodings only), GPT-2 and BERT, in transformers 5.x (tested against the version the project pins). The
model's parameters are untouched; the encoding's own parameters live in ``model.<base>.posenc`` and train with the
model. The patch is recorded in ``model.config.posenc``, so that ``model.save_pretrained`` and the Auto classes'
``from_pretrained`` / ``from_config`` give the patched model back (see :func:`restore`).

The package, bottom to top (each module imports only those before it):

    families     the supported families (SUPPORTED) and the readers of a model: base model, sizes, dtype
    state        PosencPatch, the module a patch adds; patched(); the encodings' dtype
    rotary       the model's RoPE settings as posenc options; the hook on its rotary module
    attention    posenc_attention, the attention function registered with transformers as "posenc"
    hooks        the forward hooks (positions, codes, silenced table) and installing / removing them
    patching     patch() and unpatch()
    checkpoints  save_pretrained, from_pretrained, restore (the Auto classes), load_pretrained
    export       export (a native transformers folder, or GGUF), native_rope_parameters (the patch as rope_parameters)
    matrix_checks, matrix   the support matrix of docs/hf.md (``python -m posenc.hf_matrix``), not imported here

Importing :mod:`posenc.hf` makes transformers' ``from_pretrained`` / ``from_config`` restore a recorded patch.
"""

from __future__ import annotations

from .attention import ATTENTION_NAME, KNOWN_KWARGS, REFUSED_KWARGS, posenc_attention
from .checkpoints import (
    SPEC_FILE,
    WEIGHTS_FILE,
    _install_auto_restore,
    from_pretrained,
    load_pretrained,
    restore,
    save_pretrained,
)
from .export import export, native_config_changes, native_rope_parameters
from .families import SUPPORTED, Family, _base_and_family, supported_models  # noqa: F401 (_base_and_family)
from .hooks import (  # noqa: F401 (what a model pickled by torch.save before posenc.hf was a package names)
    _add_codes,
    _before_forward,
    _Bound,
    _guarded_set_attn_implementation,
    _silence,
)
from .patching import CONFIG_KEY, patch, unpatch
from .rotary import HF_ROPE_FIELDS, HF_ROPE_TYPES, _rope_parameters_by_type, _rotary_output  # noqa: F401
from .state import DTYPES, PosencPatch, patched

_install_auto_restore()

__all__ = [
    "ATTENTION_NAME",
    "CONFIG_KEY",
    "DTYPES",
    "HF_ROPE_FIELDS",
    "HF_ROPE_TYPES",
    "KNOWN_KWARGS",
    "REFUSED_KWARGS",
    "SPEC_FILE",
    "SUPPORTED",
    "WEIGHTS_FILE",
    "Family",
    "PosencPatch",
    "export",
    "from_pretrained",
    "load_pretrained",
    "native_config_changes",
    "native_rope_parameters",
    "patch",
    "patched",
    "posenc_attention",
    "restore",
    "save_pretrained",
    "supported_models",
    "unpatch",
]

