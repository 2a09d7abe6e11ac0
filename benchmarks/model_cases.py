"""The cases of the whole-model benchmark (``bench_models.py``): the models each case id builds, and what each
case's ratios are taken against.

Case ids are ``<kind>:<source>:<name>``: kind ``lm`` / ``classifier`` (a training step), ``decode`` /
``decode-mem`` (KV-cache or segment-memory decoding); source ``posenc`` (``posenc.LanguageModel`` /
``posenc.SequenceClassifier`` with encoding ``name``), ``hf`` / ``hf457`` (the Hugging Face model of the same
size, :data:`HF_CASES`, :data:`HF_DECODE`) or ``hfpatch`` (HF's Llama patched by ``posenc.hf.patch``).
:func:`train_case` builds a training step's model and loss, :func:`decoder` a decoding loop;
:func:`floor_of` and :func:`match_of` name the cases a ratio is taken against.

What it may import: the standard library and :mod:`attention_cases` (the encodings' options, shared with the
attention benchmark and its peers) at import time (the transformers-4.57 interpreter imports it too); torch,
transformers and posenc's public API (``posenc``, ``posenc.hf``) inside the builders, in the worker process.
"""

from __future__ import annotations

from attention_cases import ENC_OPTIONS

D, H, D_FF, N_LAYERS = 512, 8, 2048, 2
DH = D // H
N_CLASSES = 2
# Llama's MLP is SwiGLU (three d x d_ff matrices): 1365 ~ 2/3 * 2048 gives it the parameters and FLOPs of the
# two-matrix 2048 GELU MLP of posenc's blocks (the report prints both models' parameter counts)
LLAMA_FF = 1365

# the default encodings: one per distinct cost (the attention benchmark's list, minus kerple-power,
# relative-bias and contextual-2, plus nope); --all runs every registered encoding
DEFAULT_ENCODINGS = [
    "none",
    "nope",
    "sinusoidal",
    "learned",
    "rope",
    "rope-interleaved",
    "xpos",
    "rope-yarn",
    "alibi",
    "t5",
    "kerple-log",
    "fire",
    "dynamic-bias",
    "cope",
    "shaw",
    "nezha",
    "relative-key",
    "relative-key-query",
    "contextual-1",
    "transformer-xl",
    "xlnet",
    "tener",
    "deberta",
]
QUICK_ENCODINGS = ["none", "rope", "alibi", "t5", "transformer-xl", "deberta"]

# HF case -> (model kind, the posenc encoding it implements, what it is)
HF_CASES: dict[str, tuple[str, str, str]] = {
    "hf:llama": (
        "lm",
        "rope",
        f"transformers 5.x LlamaForCausalLM (sdpa, tied embeddings, attention and MLP biases, SwiGLU "
        f"intermediate {LLAMA_FF} = the parameters of a 2048 GELU MLP, RMSNorm)",
    ),
    "hf:xlnet": ("lm", "xlnet", "transformers 5.x XLNetLMHeadModel (attn_type='uni', no memory, post-LN)"),
    "hf457:transfo-xl": (
        "lm",
        "transformer-xl",
        "transformers 4.57 TransfoXLLMHeadModel (no adaptive softmax: cutoffs [], div_val 1; mem_len 0; post-LN)",
    ),
    "hf:t5": ("classifier", "t5", "transformers 5.x T5EncoderModel (sdpa; GELU MLP, no biases, RMSNorm)"),
    "hf:deberta": (
        "classifier",
        "deberta",
        "transformers 5.x DebertaV2Model (c2p+p2c, 256 buckets, max_relative_positions 512, shared keys, "
        "LayerNorm'd rel. embeddings, no absolute positions)",
    ),
    "hf457:bert-relative_key": (
        "classifier",
        "relative-key",
        "transformers 4.57 BertModel(position_embedding_type='relative_key'), eager, max_position_embeddings L",
    ),
    "hf457:bert-relative_key_query": (
        "classifier",
        "relative-key-query",
        "transformers 4.57 BertModel(position_embedding_type='relative_key_query'), eager, max_position_embeddings L",
    ),
    "hf457:nezha": ("classifier", "nezha", "transformers 4.57 NezhaModel (max_relative_position 64), eager"),
}
HF_DECODE = {
    "decode:hf:llama": ("rope", "transformers 5.x LlamaForCausalLM, DynamicCache"),
    "decode-mem:hf457:transfo-xl": ("transformer-xl", "transformers 4.57 TransfoXLLMHeadModel, mems of L tokens"),
}

# cases known not to fit in this machine's memory (23 GB, shared) from this L on: skipped unless --allow-big.
# L x L x d tensors (HF relative peers), or L x L per head kept for the backward (CoPE's materialised form: 7.8 GB
# for one layer at B=4, L=2048 in the attention benchmark; the causal LM takes its blocked kernel, 1.05x none's
# memory at L=4096 (README, "CoPE blocked kernel"), so lm:posenc:cope is measured at every L)
TOO_BIG = {
    "classifier:hf457:bert-relative_key": 4096,
    "classifier:hf457:bert-relative_key_query": 4096,
    "classifier:hf457:nezha": 4096,
    "classifier:hf:deberta": 4096,
    "lm:hf:xlnet": 4096,
    "lm:hf457:transfo-xl": 4096,
    "classifier:posenc:cope": 4096,
}


def posenc_model(kind: str, enc: str, max_len: int, vocab: int):
    """posenc's model of ``kind`` (``lm`` or ``classifier``) with encoding ``enc`` at this benchmark's size."""
    import posenc

    opts = dict(ENC_OPTIONS.get(enc, {}))
    kw = dict(encoding=enc, encoding_options=opts or None, d_model=D, n_heads=H, d_ff=D_FF, n_layers=N_LAYERS)
    if kind == "classifier":
        return posenc.SequenceClassifier(vocab, N_CLASSES, max_len=max_len, **kw)
    return posenc.LanguageModel(vocab, max_len=max_len, **kw)


def _patch_type_as() -> None:
    """transformers 4.57.6's TransfoXLModel.forward calls ``tensor.type_as(dtype=...)``, which torch has never
    accepted (TypeError); accept that one spelling (``.to(dtype)``) and leave every other call alone."""
    import torch

    orig = torch.Tensor.type_as

    def type_as(self, other=None, dtype=None):
        return self.to(dtype) if other is None else orig(self, other)

    torch.Tensor.type_as = type_as


def hf_model(pid: str, max_len: int, vocab: int, mem_len: int = 0):
    """The HF model of case ``pid`` (``hf:llama`` ...): (module, returns) with returns 'logits', 'logprobs' or
    'hidden' (the last hidden state, pooled and classified by the caller)."""
    import warnings

    warnings.filterwarnings("ignore")
    import transformers as tf

    tf.logging.set_verbosity_error()
    # the sizes and no-dropout settings of the BERT family's configs (DeBERTa-v2, BERT, NEZHA)
    bert = dict(
        vocab_size=vocab, hidden_size=D, num_hidden_layers=N_LAYERS, num_attention_heads=H, intermediate_size=D_FF,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    if pid.startswith("hfpatch:"):  # the Llama below, its encoding replaced by posenc.hf
        import posenc.hf

        enc = pid.split(":", 1)[1]
        model, returns = hf_model("hf:llama", max_len, vocab)
        posenc.hf.patch(model, enc, **ENC_OPTIONS.get(enc, {}))
        return model, returns
    if pid == "hf:llama":
        cfg = tf.LlamaConfig(
            vocab_size=vocab, hidden_size=D, intermediate_size=LLAMA_FF, num_hidden_layers=N_LAYERS,
            num_attention_heads=H, num_key_value_heads=H, head_dim=DH, max_position_embeddings=max_len,
            tie_word_embeddings=True, attention_bias=True, mlp_bias=True, attention_dropout=0.0,
            attn_implementation="sdpa",
        )  # fmt: skip
        return tf.LlamaForCausalLM(cfg), "logits"
    if pid == "hf:xlnet":
        cfg = tf.XLNetConfig(
            vocab_size=vocab, d_model=D, n_layer=N_LAYERS, n_head=H, d_inner=D_FF, ff_activation="gelu",
            attn_type="uni", dropout=0.0, mem_len=None,
        )  # fmt: skip
        return tf.XLNetLMHeadModel(cfg), "logits"
    if pid == "hf457:transfo-xl":
        _patch_type_as()
        from transformers.models.deprecated.transfo_xl.configuration_transfo_xl import TransfoXLConfig
        from transformers.models.deprecated.transfo_xl.modeling_transfo_xl import TransfoXLLMHeadModel

        cfg = TransfoXLConfig(
            vocab_size=vocab, cutoffs=[], adaptive=False, div_val=1, d_model=D, d_embed=D, n_head=H, d_head=DH,
            d_inner=D_FF, n_layer=N_LAYERS, mem_len=mem_len, clamp_len=-1, same_length=False, dropout=0.0,
            dropatt=0.0,
        )  # fmt: skip
        return TransfoXLLMHeadModel(cfg), "logprobs"
    if pid == "hf:t5":
        cfg = tf.T5Config(
            vocab_size=vocab, d_model=D, d_kv=DH, num_heads=H, d_ff=D_FF, num_layers=N_LAYERS,
            feed_forward_proj="gelu", dropout_rate=0.0, relative_attention_num_buckets=32,
            relative_attention_max_distance=128, attn_implementation="sdpa",
        )  # fmt: skip
        return tf.T5EncoderModel(cfg), "hidden"
    if pid == "hf:deberta":
        cfg = tf.DebertaV2Config(
            **bert, relative_attention=True, position_buckets=256, max_position_embeddings=512,
            pos_att_type=["p2c", "c2p"], share_att_key=True, norm_rel_ebd="layer_norm", position_biased_input=False,
            type_vocab_size=0,
        )  # fmt: skip
        return tf.DebertaV2Model(cfg), "hidden"
    if pid.startswith("hf457:bert-"):
        kind = pid[len("hf457:bert-") :]
        cfg = tf.BertConfig(
            **bert,
            max_position_embeddings=max_len,
            position_embedding_type=kind,
            attn_implementation="eager",  # sdpa falls back to eager for relative positions anyway
        )
        return tf.BertModel(cfg, add_pooling_layer=False), "hidden"
    if pid == "hf457:nezha":
        from transformers.models.deprecated.nezha.configuration_nezha import NezhaConfig
        from transformers.models.deprecated.nezha.modeling_nezha import NezhaModel

        cfg = NezhaConfig(**bert, max_relative_position=64, max_position_embeddings=max(max_len, 512))
        return NezhaModel(cfg, add_pooling_layer=False), "hidden"
    raise SystemExit(f"unknown HF case {pid!r}")


def train_case(case: str, L: int, vocab: int, batch: int):
    """(module, loss_fn): ``loss_fn()`` runs the model on one batch and returns the scalar loss."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    kind, _, rest = case.partition(":")
    tokens = torch.randint(0, vocab, (batch, L))
    targets = torch.randint(0, vocab, (batch, L))
    labels = torch.randint(0, N_CLASSES, (batch,))
    if rest.startswith("posenc:"):
        model = posenc_model(kind, rest.split(":", 1)[1], L, vocab)
        if kind == "lm":
            return model, lambda: F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        return model, lambda: F.cross_entropy(model(tokens), labels)
    base, returns = hf_model(rest, L, vocab)
    if kind == "lm":
        extra = {"use_cache": False} if rest == "hf:llama" or rest.startswith("hfpatch:") else {}
        if returns == "logprobs":  # TransfoXL's head returns log-softmax (its ProjectedAdaptiveLogSoftmax)
            return base, lambda: F.nll_loss(base(tokens).prediction_scores.flatten(0, 1), targets.flatten())
        return base, lambda: F.cross_entropy(base(tokens, **extra).logits.flatten(0, 1), targets.flatten())

    class Pooled(nn.Module):  # what posenc.SequenceClassifier does: mean pooling, a linear head
        def __init__(self) -> None:
            super().__init__()
            self.base, self.head = base, nn.Linear(D, N_CLASSES)

        def forward(self, x):
            return self.head(self.base(input_ids=x).last_hidden_state.mean(1))

    model = Pooled()
    return model, lambda: F.cross_entropy(model(tokens), labels)


def decoder(case: str, C: int, n_tokens: int, vocab: int):
    """(module, prefill(ctx), step(tok)): the decoding loop of one case; state lives in the closures."""
    import torch

    kind, _, rest = case.partition(":")
    max_len = C + n_tokens
    if rest.startswith("posenc:"):
        import posenc

        model = posenc_model("lm", rest.split(":", 1)[1], max_len, vocab)
        state: dict = {}
        if kind == "decode":

            def prefill(ctx):
                state["cache"] = posenc.KVCache()
                return model(ctx, kv_cache=state["cache"])

            def step(tok):
                return model(tok, kv_cache=state["cache"])

        else:  # Transformer-XL segment memory: each layer's inputs of the last C tokens, no cache

            def prefill(ctx):
                logits, state["mem"] = model(ctx, return_memory=True)
                return logits

            def step(tok):
                logits, new = model(tok, memory=state["mem"], return_memory=True)
                state["mem"] = [torch.cat([m, n], 1)[:, -C:] for m, n in zip(state["mem"], new)]
                return logits

        return model, prefill, step
    # an HF model returns the state its next call takes: Llama its cache, Transformer-XL its memory ("mems")
    if rest == "hf:llama" or rest.startswith("hfpatch:"):
        carried, logits, kw = "past_key_values", "logits", {"use_cache": True}
    elif rest == "hf457:transfo-xl":
        carried, logits, kw = "mems", "prediction_scores", {}
    else:
        raise SystemExit(f"no decoding loop for {case!r}")
    model, _ = hf_model(rest, max_len, vocab, mem_len=C)
    state = {}

    def prefill(ctx):
        out = model(ctx, **kw)
        state[carried] = getattr(out, carried)
        return getattr(out, logits)

    def step(tok):
        out = model(tok, **{carried: state[carried]}, **kw)
        state[carried] = getattr(out, carried)
        return getattr(out, logits)

    return model, prefill, step


def floor_of(case: str) -> str:
    """The ``none`` case every ratio of ``case`` is taken against (a patched HF model: the unpatched one)."""
    kind = case.split(":", 1)[0]
    if ":hfpatch:" in case:
        return f"{kind}:hf:llama"
    return "decode:posenc:none" if kind.startswith("decode") else f"{kind}:posenc:none"


def match_of(case: str) -> str | None:
    """The posenc case an HF case is compared with."""
    kind, _, rest = case.partition(":")
    if kind.startswith("decode"):
        enc = HF_DECODE.get(case, (None,))[0]
        return f"{kind}:posenc:{enc}" if enc else None
    if rest in HF_CASES:
        return f"{kind}:posenc:{HF_CASES[rest][1]}"
    return None

