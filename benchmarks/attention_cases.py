"""The cases of the attention benchmark (``bench_attention.py``): what each case id builds, and the settings
that make posenc and its peers compute the same thing.

A case is one attention layer (projections included) run on ``x [B, L, D]``, or RoPE's application alone:

* ``floor``: plain SDPA with q/k/v/o projections and no position (:func:`projected_sdpa`);
* ``posenc:<name>`` / ``posenc-compiled:<name>``: :class:`posenc.attention.MultiHeadAttention` with that
  encoding (:func:`posenc_layer`; the worker compiles the second);
* ``peer:<id>``: another library's implementation of the same method (:func:`peer_layer`, :data:`PEERS`);
* ``apply:<id>``: RoPE's rotation of q and k alone (:func:`apply_fn`).

What it may import: the standard library at import time (the transformers-4.57 interpreter imports it too);
torch, posenc (its public API and ``posenc.attention`` / ``posenc.registry`` / ``posenc.base``) and the peer
libraries inside the builders, in the worker process that measures them. ``bench_models.py`` takes
:data:`ENC_OPTIONS` from here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

B, H, DH = 4, 8, 64
D = H * DH

# posenc encodings benchmarked by default: one per distinct attention cost (randomized-* add only a
# position sampler in the model, rope-* scalings only change the frequency table; run them with --all)
DEFAULT_ENCODINGS = [
    "none",
    "sinusoidal",
    "learned",
    "rope",
    "rope-interleaved",
    "rope-yarn",
    "xpos",
    "alibi",
    "t5",
    "kerple-log",
    "kerple-power",
    "fire",
    "dynamic-bias",
    "relative-bias",
    "cope",
    "shaw",
    "relative-key",
    "relative-key-query",
    "nezha",
    "transformer-xl",
    "xlnet",
    "tener",
    "deberta",
    "contextual-1",
    "contextual-2",
]

# posenc encoding -> the peers implementing the same method
PEERS: dict[str, list[str]] = {
    "rope": ["hf-llama", "xt-rotary", "ret-rotary"],
    "rope-interleaved": ["hf-roformer", "xt-rotary", "ret-rotary"],
    "xpos": ["xt-xpos", "ret-xpos"],
    "alibi": ["xt-alibi"],
    "alibi-bidirectional": ["xt-alibi"],
    "t5": ["hf-t5", "xt-t5"],
    "dynamic-bias": ["xt-dynamic"],
    "deberta": ["hf-deberta"],
    "xlnet": ["hf-xlnet"],
    "relative-key": ["hf457-bert-relative_key"],
    "relative-key-query": ["hf457-bert-relative_key_query"],
    "nezha": ["hf457-nezha"],
    "transformer-xl": ["hf457-transfo-xl"],
}
PEER_NOTES = {
    "hf-llama": "transformers 5.x LlamaAttention (sdpa, bidirectional) + LlamaRotaryEmbedding, rotate-half",
    "hf-roformer": "transformers 5.x RoFormerAttention (eager: materialises L×L scores) + sinusoidal table",
    "xt-rotary": "x-transformers Attention(flash=True) + RotaryEmbedding (interleaved pairs)",
    "ret-rotary": "rotary-embedding-torch RotaryEmbedding (interleaved) + SDPA",
    "xt-xpos": "x-transformers RotaryEmbedding(use_xpos=True)",
    "ret-xpos": "rotary-embedding-torch RotaryEmbedding(use_xpos=True) + SDPA",
    "xt-alibi": "x-transformers AlibiPositionalBias (symmetric |i-j| when not causal)",
    "hf-t5": "transformers 5.x T5Attention(has_relative_attention_bias=True), sdpa",
    "xt-t5": "x-transformers RelativePositionBias (T5 buckets)",
    "xt-dynamic": "x-transformers DynamicPositionBias (depth 2, log distance)",
    "hf-deberta": "transformers 5.x DebertaV2Attention (c2p+p2c, position_buckets 256) + rel. embeddings/LayerNorm",
    "hf-xlnet": "transformers 5.x XLNetRelativeAttention (includes post-attention residual+LayerNorm)",
    "hf457-bert-relative_key": "transformers 4.57 BertAttention(relative_key), eager",
    "hf457-bert-relative_key_query": "transformers 4.57 BertAttention(relative_key_query), eager",
    "hf457-nezha": "transformers 4.57 NezhaAttention (max_relative_position 64), eager",
    "hf457-transfo-xl": "transformers 4.57 RelPartialLearnableMultiHeadAttn (includes residual+LayerNorm)",
}
APPLY_CASES = [
    "apply:copy",
    "apply:posenc-rope",
    "apply:posenc-rope-interleaved",
    "apply:hf-llama",
    "apply:ret",
    "apply:xt",
]

# RoPE application alone takes milliseconds: at least this many timed calls (median)
APPLY_REPEATS = 50

# settings shared by posenc and its peer so that both compute the same thing
ENC_OPTIONS: dict[str, dict] = {
    "deberta": {"max_len": 512, "position_buckets": 256},
    "nezha": {"max_relative_position": 64},
    "dynamic-bias": {"log_distance": True, "depth": 2},
    "rope-yarn": {"factor": 4.0, "original_max_len": 512},
    "rope-linear": {"factor": 4.0},
    "rope-ntk": {"factor": 4.0},
    "rope-dynamic": {"factor": 4.0, "original_max_len": 512},
    "rope-llama3": {"factor": 8.0, "original_max_len": 512},
    "rope-longrope": {"short_factor": [1.0] * 32, "long_factor": [4.0] * 32, "original_max_len": 512, "factor": 4.0},
}

# peers known not to fit in memory at a length (L x L x d tensors): skipped, recorded as such
TOO_BIG = {
    "hf457-bert-relative_key": 4096,
    "hf457-bert-relative_key_query": 4096,
    "hf457-nezha": 4096,
    "hf-deberta": 4096,
}


def too_big(case: str, L: int) -> bool:
    """Whether ``case`` is known not to fit in memory at ``L``."""
    return L >= TOO_BIG.get(case.split(":", 1)[-1], 1 << 30)


# ============================================================================ the layers
def wrap(forward: Callable[..., Any], **parts: Any):
    """One module holding ``parts`` as its submodules (their parameters are the layer's), its forward
    ``forward(module, x)``: how every peer's pieces become one layer."""
    from torch import nn

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            for k, v in parts.items():
                setattr(self, k, v)

        def forward(self, x):
            return forward(self, x)

    return Layer()


def first_output(att):
    """``att`` as a layer returning the first of its outputs (HF attention modules return a tuple)."""
    return wrap(lambda m, x: m.att(x)[0], att=att)


def projected_sdpa(rotate: Callable | None = None, **parts: Any):
    """q/k/v projections, SDPA, the output projection (the floor); ``rotate(module, q, k) -> (q, k)`` between
    the projections and SDPA where given, with the modules it uses in ``parts`` (rotary-embedding-torch)."""
    import torch.nn.functional as F
    from torch import nn

    def forward(m, x):
        b, n, _ = x.shape
        q, k, v = (p(x).view(b, n, H, DH).transpose(1, 2) for p in (m.q, m.k, m.v))
        if rotate is not None:
            q, k = rotate(m, q, k)
        out = F.scaled_dot_product_attention(q, k, v)
        return m.o(out.transpose(1, 2).reshape(b, n, D))

    q, k, v, o = (nn.Linear(D, D) for _ in range(4))
    return wrap(forward, **parts, q=q, k=k, v=v, o=o)


def posenc_layer(name: str, L: int):
    """posenc's fast attention with encoding ``name``; an ``embed`` hook is applied to ``x`` first."""
    import torch

    import posenc  # noqa: F401  (registers the encodings)
    from posenc.attention import MultiHeadAttention
    from posenc.registry import build

    dims = dict(d_model=D, n_heads=H, head_dim=DH, max_len=max(L, 512), n_layers=1, causal=False, vocab_size=1000)
    opts = dict(ENC_OPTIONS.get(name, {}))
    if name in ("relative-key", "relative-key-query"):
        opts["max_len"] = L  # HF's max_position_embeddings = L (its table has 2L - 1 rows)
    enc = build(name, dims=dims, options=opts)
    uses_embed = "embed" in enc.hooks()

    def forward(m, x):
        if uses_embed:
            pos = torch.arange(x.shape[1], device=x.device)[None].expand(x.shape[0], -1)
            x = enc.embed(x, pos)
        return m.attn(x)

    return wrap(forward, attn=MultiHeadAttention(D, H, enc, path="fast"))


# the sizes and no-dropout settings of the BERT family's configs (BERT, NEZHA, DeBERTa-v2)
def _bert_sizes() -> dict[str, Any]:
    return dict(hidden_size=D, num_attention_heads=H, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def peer_layer(pid: str, L: int):
    """The layer of ``peer:<pid>`` at length ``L`` (:data:`PEER_NOTES` says what each is)."""
    import torch

    if pid == "hf-llama":
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

        sizes = dict(hidden_size=D, num_attention_heads=H, num_key_value_heads=H, head_dim=DH)
        cfg = LlamaConfig(**sizes, max_position_embeddings=L, attention_bias=True)
        cfg._attn_implementation = "sdpa"
        att, rot = LlamaAttention(cfg, layer_idx=0), LlamaRotaryEmbedding(cfg)
        att.is_causal = False

        def llama(m, x):
            pos = torch.arange(x.shape[1])[None]
            return m.att(x, position_embeddings=m.rot(x, pos), attention_mask=None)[0]

        return wrap(llama, att=att, rot=rot)
    if pid == "hf-roformer":
        from transformers import RoFormerConfig
        from transformers.models.roformer.modeling_roformer import (
            RoFormerAttention,
            RoFormerSinusoidalPositionalEmbedding,
        )

        cfg = RoFormerConfig(hidden_size=D, num_attention_heads=H, max_position_embeddings=L, embedding_size=D)
        cfg._attn_implementation = "eager"
        att, table = RoFormerAttention(cfg), RoFormerSinusoidalPositionalEmbedding(L, DH)
        return wrap(lambda m, x: m.att(x, sinusoidal_pos=m.table(x.shape[:-1])[None, None])[0], att=att, table=table)
    if pid.startswith("xt-"):
        from x_transformers.x_transformers import (
            AlibiPositionalBias,
            Attention,
            DynamicPositionBias,
            RelativePositionBias,
            RotaryEmbedding,
        )

        att = Attention(dim=D, heads=H, dim_head=DH, flash=True)
        rot = rel = None
        if pid == "xt-rotary":
            rot = RotaryEmbedding(DH)
        elif pid == "xt-xpos":
            rot = RotaryEmbedding(DH, use_xpos=True)
        elif pid == "xt-alibi":
            rel = AlibiPositionalBias(heads=H, total_heads=H)
        elif pid == "xt-t5":
            rel = RelativePositionBias(scale=DH**0.5, causal=False, num_buckets=32, max_distance=128, heads=H)
        elif pid == "xt-dynamic":
            rel = DynamicPositionBias(dim=D // 4, heads=H, depth=2, log_distance=True, norm=False)
        else:
            raise SystemExit(f"unknown peer {pid!r}")

        def xt(m, x):
            kw = {}
            if m.rot is not None:
                kw["rotary_pos_emb"] = m.rot.forward_from_seq_len(x.shape[1])
            if m.rel is not None:
                kw["rel_pos"] = m.rel
            return m.att(x, **kw)

        return wrap(xt, att=att, rot=rot, rel=rel)
    if pid in ("ret-rotary", "ret-xpos"):
        from rotary_embedding_torch import RotaryEmbedding

        xpos = pid == "ret-xpos"

        def rotate(m, q, k):
            if xpos:
                return m.rot.rotate_queries_and_keys(q, k)
            return m.rot.rotate_queries_or_keys(q), m.rot.rotate_queries_or_keys(k)

        return projected_sdpa(rotate, rot=RotaryEmbedding(dim=DH, use_xpos=xpos))
    if pid == "hf-t5":
        from transformers import T5Config
        from transformers.models.t5.modeling_t5 import T5Attention

        cfg = T5Config(d_model=D, d_kv=DH, num_heads=H, relative_attention_num_buckets=32, is_decoder=False)
        cfg._attn_implementation = "sdpa"
        return first_output(T5Attention(cfg, has_relative_attention_bias=True))
    if pid == "hf-deberta":
        from transformers import DebertaV2Config
        from transformers.models.deberta_v2.modeling_deberta_v2 import DebertaV2Attention, DebertaV2Encoder

        cfg = DebertaV2Config(
            **_bert_sizes(),
            num_hidden_layers=0,
            relative_attention=True,
            position_buckets=256,
            max_position_embeddings=512,
            pos_att_type=["p2c", "c2p"],
            share_att_key=True,
            norm_rel_ebd="layer_norm",
        )
        cfg._attn_implementation = "eager"

        def deberta(m, x):
            mask = m.enc.get_attention_mask(torch.ones(x.shape[:2], dtype=torch.long))
            rel = m.enc.get_rel_pos(x)
            return m.att(x, mask, relative_pos=rel, rel_embeddings=m.enc.get_rel_embedding())[0]

        return wrap(deberta, enc=DebertaV2Encoder(cfg), att=DebertaV2Attention(cfg))
    if pid == "hf-xlnet":
        from transformers import XLNetConfig
        from transformers.models.xlnet.modeling_xlnet import XLNetRelativeAttention

        att = XLNetRelativeAttention(XLNetConfig(d_model=D, n_head=H, d_head=DH, dropout=0.0))
        inv_freq = 1 / torch.pow(10000, torch.arange(0, D, 2.0) / D)

        def xlnet(m, x):
            n, b = x.shape[1], x.shape[0]
            pos = torch.arange(n, -n, -1.0)[:, None] * inv_freq
            r = torch.cat([pos.sin(), pos.cos()], -1)[:, None, :].expand(-1, b, -1)
            return m.att(x.transpose(0, 1), None, None, None, r, None)[0].transpose(0, 1)

        return wrap(xlnet, att=att)
    if pid.startswith("hf457-bert-"):
        from transformers import BertConfig
        from transformers.models.bert.modeling_bert import BertAttention

        kind = pid[len("hf457-bert-") :]
        cfg = BertConfig(**_bert_sizes(), max_position_embeddings=L, position_embedding_type=kind)
        cfg._attn_implementation = "eager"
        return first_output(BertAttention(cfg, position_embedding_type=kind))
    if pid == "hf457-nezha":
        from transformers.models.deprecated.nezha.configuration_nezha import NezhaConfig
        from transformers.models.deprecated.nezha.modeling_nezha import NezhaAttention

        cfg = NezhaConfig(**_bert_sizes(), max_relative_position=64, max_position_embeddings=max(L, 512))
        return first_output(NezhaAttention(cfg))
    if pid == "hf457-transfo-xl":
        from transformers.models.deprecated.transfo_xl.modeling_transfo_xl import (
            PositionalEmbedding,
            RelPartialLearnableMultiHeadAttn,
        )

        def transfo_xl(m, x):
            r = m.pe(torch.arange(x.shape[1] - 1, -1, -1.0))
            return m.att(x.transpose(0, 1), r)[0].transpose(0, 1)

        return wrap(transfo_xl, att=RelPartialLearnableMultiHeadAttn(H, D, DH, 0.0), pe=PositionalEmbedding(D))
    raise SystemExit(f"unknown peer {pid!r}")


def apply_fn(cid: str, L: int):
    """RoPE application alone: returns (fn, inputs) with fn(q, k) -> (q', k')."""
    import torch

    q = torch.randn(B, H, L, DH)
    k = torch.randn(B, H, L, DH)
    which = cid.split(":", 1)[1]
    if which == "copy":
        return (lambda q, k: (q.clone(), k.clone())), (q, k)
    if which.startswith("posenc-"):
        import posenc  # noqa: F401
        from posenc.base import AttentionContext
        from posenc.registry import get

        enc = get(which[len("posenc-") :], head_dim=DH)
        pos = torch.arange(L)[None]

        def fn(q, k):
            ctx = AttentionContext(q_pos=pos, k_pos=pos, n_heads=H, head_dim=DH)
            return enc.rotate(q, k, ctx)

        return fn, (q, k)
    if which == "hf-llama":
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

        cfg = LlamaConfig(hidden_size=D, num_attention_heads=H, head_dim=DH, max_position_embeddings=L)
        cos, sin = LlamaRotaryEmbedding(cfg)(q, torch.arange(L)[None])
        return (lambda q, k: apply_rotary_pos_emb(q, k, cos, sin)), (q, k)
    if which == "ret":
        from rotary_embedding_torch import RotaryEmbedding

        rot = RotaryEmbedding(dim=DH)
        return (lambda q, k: (rot.rotate_queries_or_keys(q), rot.rotate_queries_or_keys(k))), (q, k)
    if which == "xt":
        from x_transformers.x_transformers import RotaryEmbedding, apply_rotary_pos_emb

        freqs, _ = RotaryEmbedding(DH).forward_from_seq_len(L)
        return (lambda q, k: (apply_rotary_pos_emb(q, freqs), apply_rotary_pos_emb(k, freqs))), (q, k)
    raise SystemExit(f"unknown apply case {cid!r}")



def layer(case: str, L: int):
    """The layer of a ``floor``, ``posenc:``, ``posenc-compiled:`` (not compiled yet) or ``peer:`` case."""
    kind, _, name = case.partition(":")
    if kind == "floor":
        return projected_sdpa()
    if kind in ("posenc", "posenc-compiled"):
        return posenc_layer(name, L)
    if kind == "peer":
        return peer_layer(name, L)
    raise SystemExit(f"unknown case {case!r}")
