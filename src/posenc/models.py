"""Small Transformers into which any encoding plugs.

* :class:`Transformer` -- the trunk: token embedding (optionally factorised,
  ``embedding_size -> d_model`` as seed 001's ``Embeddings``), the encoding's
  ``embed`` hook, and ``n_layers`` blocks (pre-LN or post-LN) whose attention
  uses the encoding's other hooks. ``causal=False`` is a bidirectional encoder,
  ``causal=True`` a decoder.
* heads: :class:`SequenceClassifier`, :class:`TokenTagger`, :class:`LanguageModel`.

The trunk takes explicit positions, key padding, packed-document ids, segment
ids, a KV cache and Transformer-XL style memory, and passes them through to the
attention unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import KVCache, MultiHeadAttention
from .base import PositionalEncoding, as_position_rows
from .errors import ConfigError
from .registry import build, resolve

NORMS = ("pre", "post")


class FeedForward(nn.Module):
    def __init__(self, d_model: int, d_ff: int, dropout: float = 0.0):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.dropout(F.gelu(self.fc1(x))))


class Block(nn.Module):
    """Attention + feed-forward with residuals; ``norm="pre"`` (GPT-2) or ``"post"`` (original Transformer)."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int,
        encoding: PositionalEncoding | None,
        *,
        norm: str = "pre",
        dropout: float = 0.0,
        path: str = "auto",
        layer: int = 0,
    ):
        super().__init__()
        if norm not in NORMS:
            raise ConfigError(f"norm must be one of {NORMS}, got {norm!r}")
        self.norm = norm
        self.attn = MultiHeadAttention(d_model, n_heads, encoding, dropout=dropout, path=path, layer=layer)
        self.ff = FeedForward(d_model, d_ff, dropout)
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor, memory: Tensor | None = None, **attn_kwargs: Any) -> Tensor:
        if self.norm == "pre":
            h = self.ln1(x)
            mem = self.ln1(memory) if memory is not None else None
            x = x + self.drop(self.attn(h, memory=mem, **attn_kwargs))
            return x + self.drop(self.ff(self.ln2(x)))
        x = self.ln1(x + self.drop(self.attn(x, memory=memory, **attn_kwargs)))
        return self.ln2(x + self.drop(self.ff(x)))


@dataclass
class TransformerOutput:
    hidden: Tensor  # [B, L, d_model] after the final layer (and final norm for pre-LN)
    memory: list[Tensor] | None = None  # per-layer inputs to keep for the next segment (detached)


class Transformer(nn.Module):
    """An encoder (``causal=False``) or decoder (``causal=True``) trunk.

    Args:
        vocab_size: number of token ids.
        encoding: a registered name (``"rope"``, ``"t5"`` ...) or an encoding instance.
        encoding_options: settings for the encoding (e.g. ``{"base": 500000}``); the
            model passes ``d_model``, ``n_heads``, ``head_dim``, ``max_len``, ``vocab_size``,
            ``n_layers``, ``causal`` and ``embedding_std`` to encodings that take them.
        d_model, n_layers, n_heads, d_ff: sizes (``d_ff`` defaults to ``4 * d_model``).
        causal: decoder (causal mask) instead of a bidirectional encoder.
        norm: ``"pre"`` or ``"post"`` layer norm.
        embedding_size: factorised embedding (``vocab -> embedding_size -> d_model``).
        embedding_scale: ``True``: token embeddings drawn from ``N(0, 1/size)`` and multiplied by
            ``sqrt(size)`` (Vaswani et al. 2017, section 3.4), unit RMS like the fixed absolute
            codes (sinusoids, binary) added to them; ``False``: BERT/GPT style ``N(0, 0.02²)``, no
            scale. ``None`` (default): as the encoding's paper does
            (``encoding.scale_token_embeddings``: fixed additive codes scale, the others do not).
        max_len: the longest position the model is built for (tables of learned encodings).
        path: attention path, ``"auto"``, ``"fast"`` or ``"reference"``.
    """

    def __init__(
        self,
        vocab_size: int,
        *,
        encoding: str | PositionalEncoding | None = "sinusoidal",
        encoding_options: dict[str, Any] | None = None,
        d_model: int = 128,
        n_layers: int = 2,
        n_heads: int = 4,
        d_ff: int | None = None,
        causal: bool = False,
        norm: str = "pre",
        dropout: float = 0.0,
        embedding_size: int | None = None,
        embedding_scale: bool | None = None,
        max_len: int = 512,
        path: str = "auto",
    ):
        super().__init__()
        if vocab_size < 1 or n_layers < 1:
            raise ConfigError(f"vocab_size and n_layers must be positive, got {vocab_size} and {n_layers}")
        if d_model % n_heads:
            raise ConfigError(f"d_model={d_model} must be divisible by n_heads={n_heads}")
        self.vocab_size, self.d_model, self.n_layers, self.n_heads = vocab_size, d_model, n_layers, n_heads
        self.causal, self.norm_kind, self.max_len = causal, norm, max_len
        if embedding_scale is None:
            if isinstance(encoding, PositionalEncoding):
                embedding_scale = encoding.scale_token_embeddings
            else:
                embedding_scale = resolve("none" if encoding is None else encoding).scale_token_embeddings
        dims = dict(
            d_model=d_model,
            n_heads=n_heads,
            head_dim=d_model // n_heads,
            max_len=max_len,
            vocab_size=vocab_size,
            n_layers=n_layers,
            causal=causal,
            embedding_std=1.0 if embedding_scale else 0.02,
        )
        self.encoding = build(encoding, dims=dims, options=encoding_options)
        if embedding_size is None or embedding_size == d_model:
            self.tok = nn.Embedding(vocab_size, d_model)
            self.factor: nn.Module = nn.Identity()
        else:
            self.tok = nn.Embedding(vocab_size, embedding_size)
            self.factor = nn.Linear(embedding_size, d_model)
        size = self.tok.embedding_dim
        # Vaswani et al. 3.4: weights N(0, 1/size) times sqrt(size) = unit RMS per dimension, the scale of a
        # sinusoid (RMS 1/sqrt(2)); a 0.02 embedding under a unit sinusoid is drowned by position
        self.embed_scale = size**0.5 if embedding_scale else 1.0
        nn.init.normal_(self.tok.weight, std=size**-0.5 if embedding_scale else 0.02)
        self.drop = nn.Dropout(dropout)
        enc = self.encoding
        uses_attention = bool(enc.hooks() - {"embed", "positions"}) or not enc.key_projection
        layer_encodings: list[PositionalEncoding | None] = []
        for i in range(n_layers):
            if not uses_attention:
                layer_encodings.append(None)
            elif enc.shared_across_layers or i == 0:
                layer_encodings.append(enc)
            else:
                layer_encodings.append(enc.fresh_copy())
        self.blocks = nn.ModuleList(
            Block(d_model, n_heads, d_ff or 4 * d_model, e, norm=norm, dropout=dropout, path=path, layer=i)
            for i, e in enumerate(layer_encodings)
        )
        self.final_norm: nn.Module = nn.LayerNorm(d_model) if norm == "pre" else nn.Identity()

    def embed_tokens(self, tokens: Tensor, positions: Tensor) -> Tensor:
        x = self.factor(self.tok(tokens) * self.embed_scale)
        if "embed" in self.encoding.hooks():
            x = self.encoding.embed(x, positions, tokens=tokens)
        return self.drop(x)

    def forward(
        self,
        tokens: Tensor,
        *,
        positions: Tensor | None = None,
        attention_mask: Tensor | None = None,
        document_ids: Tensor | None = None,
        segment_ids: Tensor | None = None,
        memory: list[Tensor] | None = None,
        memory_positions: Tensor | None = None,
        kv_cache: KVCache | None = None,
        return_memory: bool = False,
    ) -> TransformerOutput:
        """Run the trunk.

        Args:
            tokens: ``[B, L]`` token ids.
            positions: ``[L]`` or ``[B, L]`` position of every token; default ``arange`` after
                any memory or cache.
            attention_mask: ``[B, M + L]`` key padding (``True``/1 for real tokens), covering
                memory / cached keys too.
            document_ids: ``[B, M + L]`` packed-document ids (attention stays within a document).
            segment_ids: ``[B, L]`` segment ids for encodings that use them.
            memory: per-layer hidden states of the previous segment (Transformer-XL); the
                gradient is stopped.
            memory_positions: positions of the memory tokens (default ``0 .. M-1``).
            kv_cache: a :class:`~posenc.attention.KVCache` for incremental decoding.
            return_memory: also return each layer's input, detached, to use as the next memory.
        """
        if tokens.dim() != 2:
            raise ConfigError(f"tokens must be [batch, length], got shape {tuple(tokens.shape)}")
        b, n = tokens.shape
        if memory is not None and len(memory) != self.n_layers:
            raise ConfigError(f"memory must hold one tensor per layer ({self.n_layers}), got {len(memory)}")
        m = memory[0].shape[1] if memory is not None else 0
        past = kv_cache.length() if kv_cache is not None else 0
        if positions is None:
            q_pos = torch.arange(past + m, past + m + n, device=tokens.device)[None, :]
        else:
            q_pos = as_position_rows(positions, n)
        key_positions = None
        if memory is not None:
            mem_pos = (
                torch.arange(past, past + m, device=tokens.device)[None, :]
                if memory_positions is None
                else as_position_rows(memory_positions, m)
            )
            if mem_pos.shape[0] != q_pos.shape[0]:
                nb = max(mem_pos.shape[0], q_pos.shape[0])
                mem_pos, q_pos = mem_pos.expand(nb, -1), q_pos.expand(nb, -1)
            key_positions = torch.cat([mem_pos, q_pos], dim=1)
        if "positions" in self.encoding.hooks():
            # in training, one draw per sequence (randomized positions): give the hook the whole batch
            q_pos = self.encoding.positions(q_pos.expand(b, -1) if self.training else q_pos, self.training)
            if key_positions is not None:
                key_positions = torch.cat([key_positions[:, :m].expand(q_pos.shape[0], -1), q_pos], dim=1)
        x = self.embed_tokens(tokens, q_pos)
        cache: dict = {}
        new_memory: list[Tensor] = []
        for i, block in enumerate(self.blocks):
            if return_memory:
                new_memory.append(x.detach())
            mem = memory[i].detach() if memory is not None else None
            if mem is not None and (mem.shape[0] != b or mem.shape[-1] != self.d_model):
                raise ConfigError(
                    f"memory[{i}] has shape {tuple(mem.shape)} but this model needs [batch={b}, M, {self.d_model}]"
                )
            x = block(
                x,
                memory=mem,
                positions=q_pos,
                key_positions=key_positions,
                causal=self.causal,
                attention_mask=attention_mask,
                document_ids=document_ids,
                segment_ids=segment_ids,
                kv_cache=kv_cache,
                cache=cache,
            )
        x = self.final_norm(x)
        return TransformerOutput(hidden=x, memory=new_memory if return_memory else None)


def Encoder(vocab_size: int, **kwargs: Any) -> Transformer:
    """A bidirectional encoder trunk (``Transformer(causal=False)``)."""
    return Transformer(vocab_size, causal=False, **kwargs)


def Decoder(vocab_size: int, **kwargs: Any) -> Transformer:
    """A causal decoder trunk (``Transformer(causal=True)``)."""
    return Transformer(vocab_size, causal=True, **kwargs)


POOLINGS = ("mean", "first", "last", "max")


class SequenceClassifier(nn.Module):
    """A trunk plus pooling and a linear classifier: ``logits [B, n_classes]``."""

    def __init__(self, vocab_size: int, n_classes: int, *, pooling: str = "mean", **trunk: Any):
        super().__init__()
        if pooling not in POOLINGS:
            raise ConfigError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        self.trunk = Transformer(vocab_size, **trunk)
        self.pooling = pooling
        self.head = nn.Linear(self.trunk.d_model, n_classes)

    def forward(self, tokens: Tensor, attention_mask: Tensor | None = None, **kwargs: Any) -> Tensor:
        h = self.trunk(tokens, attention_mask=attention_mask, **kwargs).hidden
        keep = (
            torch.ones(h.shape[:2], dtype=torch.bool, device=h.device)
            if attention_mask is None
            else attention_mask[:, -h.shape[1] :].bool()
        )
        if self.pooling == "mean":
            w = keep.to(h.dtype)[..., None]
            pooled = (h * w).sum(1) / w.sum(1).clamp(min=1)
        elif self.pooling == "max":
            pooled = h.masked_fill(~keep[..., None], torch.finfo(h.dtype).min).amax(1)
        elif self.pooling == "first":
            pooled = h[:, 0]
        else:  # last real token
            idx = (keep.long().cumsum(1).argmax(1)).clamp(min=0)
            pooled = h[torch.arange(h.shape[0], device=h.device), idx]
        return self.head(pooled)


class TokenTagger(nn.Module):
    """A trunk plus a per-token linear layer: ``logits [B, L, n_tags]`` (NER, POS tagging)."""

    def __init__(self, vocab_size: int, n_tags: int, **trunk: Any):
        super().__init__()
        self.trunk = Transformer(vocab_size, **trunk)
        self.head = nn.Linear(self.trunk.d_model, n_tags)

    def forward(self, tokens: Tensor, **kwargs: Any) -> Tensor:
        return self.head(self.trunk(tokens, **kwargs).hidden)


class LanguageModel(nn.Module):
    """A causal decoder with a language-modelling head tied to the token embedding.

    ``forward`` returns logits ``[B, L, vocab]``; with ``return_memory=True`` it
    returns ``(logits, memory)`` for segment-level recurrence.
    """

    def __init__(self, vocab_size: int, *, tie_weights: bool = True, causal: bool = True, **trunk: Any):
        super().__init__()
        self.trunk = Transformer(vocab_size, causal=causal, **trunk)
        self.head = nn.Linear(self.trunk.d_model, vocab_size, bias=False)
        if tie_weights and isinstance(self.trunk.factor, nn.Identity):
            self.head.weight = self.trunk.tok.weight

    def forward(self, tokens: Tensor, *, return_memory: bool = False, **kwargs: Any) -> Any:
        out = self.trunk(tokens, return_memory=return_memory, **kwargs)
        logits = self.head(out.hidden)
        return (logits, out.memory) if return_memory else logits

    def loss(self, tokens: Tensor, **kwargs: Any) -> Tensor:
        """Next-token cross-entropy over ``tokens`` (predict ``tokens[:, 1:]``)."""
        logits = self(tokens[:, :-1], **kwargs)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
