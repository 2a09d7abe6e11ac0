"""Small Transformers into which any encoding plugs.

* :class:`Transformer` -- the trunk: token embedding (optionally factorised,
  ``embedding_size -> d_model`` as the ``Embeddings`` of anon., "Positional encoding of
  the Transformer"), the encoding's ``embed`` hook, and ``n_layers`` blocks (pre-LN or
  post-LN) whose attention uses the encoding's other hooks. ``causal=False`` is a bidirectional encoder,
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

from .attention import KVCache, MultiHeadAttention, check_int, check_probability
from .base import PositionalEncoding, as_position_rows, check_positions, mark_arange
from .errors import ConfigError, PositionError
from .generation import _check_generate_arguments, _check_generate_length, _sample
from .registry import build, resolve
from .schedule import QK_NORMS, LayerSpec, Schedule, _AtLayer, as_schedule, qk_norm_kind

NORMS = ("pre", "post")


class FeedForward(nn.Module):
    def __init__(self, d_model: int, d_ff: int, dropout: float = 0.0):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.dropout(F.gelu(self.fc1(x))))


class Block(nn.Module):
    """Attention + feed-forward with residuals; ``norm="pre"`` (GPT-2) or ``"post"`` (original Transformer);
    ``qk_norm`` (``None``, ``"rms"``, ``"l2"``) normalises the attention's q and k per head
    (:class:`~posenc.attention.MultiHeadAttention`)."""

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
        span: tuple[str, int] | None = None,
        qk_norm: str | None = None,
    ):
        super().__init__()
        if norm not in NORMS:
            raise ConfigError(f"norm must be one of {NORMS}, got {norm!r}")
        self.norm = norm
        self.attn = MultiHeadAttention(
            d_model, n_heads, encoding, dropout=dropout, path=path, layer=layer, span=span, qk_norm=qk_norm
        )
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


def _per_layer(enc: PositionalEncoding, n: int) -> list[PositionalEncoding | None]:
    """The encoding of each of ``n`` layers that have ``enc`` with its options: ``None`` where it acts outside the
    attention alone (``embed`` / ``positions``), else ``enc`` itself where one instance serves every layer
    (``shared_across_layers``) and for the first layer, a fresh copy for each later one."""
    if not (enc.hooks() - {"embed", "positions"}) and enc.key_projection:
        return [None] * n
    return [enc if enc.shared_across_layers or i == 0 else enc.fresh_copy() for i in range(n)]


def _check_model_hooks(specs: tuple[LayerSpec, ...]) -> None:
    """Refuse a schedule whose layers differ while one of them acts once for the whole model: an ``embed`` hook
    (absolute codes added to the token embeddings) or a ``positions`` hook (randomized positions) runs before
    the first layer, for all of them, so it cannot be one layer's alone."""
    for i, spec in enumerate(specs):
        cls = type(spec.encoding) if isinstance(spec.encoding, PositionalEncoding) else resolve(spec.encoding)
        model_hooks = sorted(cls.hooks() & {"embed", "positions"})
        if not model_hooks:
            continue
        other = next((j for j, s in enumerate(specs) if not s.same_encoding(spec)), None)
        if other is None:
            return
        hooks = " and ".join(f"{h!r}" for h in model_hooks)
        raise ConfigError(
            f"layer {i}: {str(spec)!r} acts once for the whole model (its {hooks} hook: on the token embeddings or "
            f"the positions, before the first layer), so a schedule may use it only if every layer has it with the "
            f"same options, but layer {other} is {str(specs[other])!r}. Mix encodings that act inside attention "
            "(rope, nope, alibi, t5 ...), or give every layer this one (spans may still differ)"
        )


class Transformer(nn.Module):
    """An encoder (``causal=False``) or decoder (``causal=True``) trunk.

    Args:
        vocab_size: number of token ids.
        encoding: a registered name (``"rope"``, ``"t5"`` ...) or an encoding instance; or a schedule of encodings
            per layer (:mod:`posenc.schedule`): a :class:`~posenc.schedule.Schedule`, a list of layers or a string
            such as ``"rope@w64*3+nope"`` (three RoPE layers with a sliding window of 64 keys, then a NoPE layer,
            repeated over ``n_layers``). Each layer then builds its own encoding with its own options and span;
            an encoding that acts once for the whole model (an ``embed`` or ``positions`` hook: absolute codes,
            randomized positions) must then be the same on every layer.
        encoding_options: settings for the encoding (e.g. ``{"base": 500000}``; not with a schedule, whose layers
            carry their own options); the
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
        qk_norm: a QK-norm on every layer: ``"rms"`` (RMSNorm of each head's q and k with a learnable weight,
            Qwen3 / Gemma 3) or ``"l2"`` (weightless, Llama 4), applied after the projections and before the
            encoding. ``None`` (default): none, or what each layer of a schedule says (``"rope#qk*3+nope"``;
            :mod:`posenc.schedule`); a schedule that gives norms of its own refuses this argument.
    """

    def __init__(
        self,
        vocab_size: int,
        *,
        encoding: str | PositionalEncoding | Schedule | list[Any] | None = "sinusoidal",
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
        qk_norm: str | None = None,
    ):
        super().__init__()
        qk_norm = qk_norm_kind(qk_norm)
        for name, value in dict(vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, n_heads=n_heads).items():
            check_int(name, value)
        check_int("d_ff", d_ff, optional=True)
        check_int("embedding_size", embedding_size, optional=True)
        check_int("max_len", max_len)
        check_probability("dropout", dropout)
        if not isinstance(causal, bool):
            raise ConfigError(f"causal must be True or False, got {causal!r}")
        if norm not in NORMS:
            raise ConfigError(f"norm must be one of {NORMS}, got {norm!r}")
        if d_model % n_heads:
            raise ConfigError(f"d_model={d_model} must be divisible by n_heads={n_heads}")
        self.vocab_size, self.d_model, self.n_layers, self.n_heads = vocab_size, d_model, n_layers, n_heads
        self.causal, self.norm_kind, self.max_len = causal, norm, max_len
        #: the QK-norm given for every layer (``qk_norm=``); a schedule's own are in ``schedule``
        self.qk_norm = qk_norm
        sched = as_schedule(encoding)
        #: the encodings per layer (:mod:`posenc.schedule`), ``n_layers`` long; ``None`` for one encoding throughout
        self.schedule: Schedule | None = None
        specs: tuple[LayerSpec, ...] | None = None
        if sched is not None:
            if encoding_options:
                raise ConfigError(
                    f"encoding_options={encoding_options!r} go with one encoding name; in a schedule each layer "
                    "carries its own options: 'rope(base=500000.0)*3+nope', or ('rope', {'base': 500000.0}) "
                    "in posenc.schedule(...)"
                )
            specs = sched.for_layers(n_layers)
            if qk_norm is not None:
                own = next((i for i, s in enumerate(specs) if s.qk_norm is not None), None)
                if own is not None:
                    raise ConfigError(
                        f"qk_norm={qk_norm!r} puts a QK-norm on every layer, but the schedule {str(sched)!r} gives "
                        f"layer {own} one of its own; give the norms in the schedule ('rope#qk*3+nope#qk') or "
                        "with qk_norm=, not both"
                    )
                specs = tuple(LayerSpec(s.encoding, dict(s.options), s.span, qk_norm) for s in specs)
            self.schedule = Schedule(specs)
            _check_model_hooks(specs)
        if embedding_scale is None:
            first = specs[0].encoding if specs is not None else encoding
            if isinstance(first, PositionalEncoding):
                embedding_scale = first.scale_token_embeddings
            else:
                embedding_scale = resolve("none" if first is None else first).scale_token_embeddings
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
        sizes = dict(d_model=d_model, n_heads=n_heads, head_dim=d_model // n_heads, vocab_size=vocab_size)
        # each encoding built and the layers it serves (copied per layer, below, after the token embedding)
        groups: list[tuple[PositionalEncoding, list[int]]] = []
        if specs is None:
            self.encoding = build(encoding, dims=dims, options=encoding_options)
            # a hand-built encoding (or options naming a size) of other sizes than the model's fails here
            self.encoding.check_sizes(**sizes)
            groups.append((self.encoding, list(range(n_layers))))
        else:
            firsts: list[int] = []  # the first layer of each group of layers with one encoding and options
            for i, spec in enumerate(specs):
                if any(specs[f].same_encoding(spec) for f in firsts):
                    continue
                firsts.append(i)
                group = [j for j in range(n_layers) if specs[j].same_encoding(spec)]
                with _AtLayer(i):
                    enc = build(spec.encoding, dims=dims, options=spec.built_options() or None)
                    enc.check_sizes(**sizes)
                if i == 0:
                    self.encoding = enc
                groups.append((enc, group))
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
        layer_encodings: list[PositionalEncoding | None] = [None] * n_layers
        for enc, group in groups:
            for j, e in zip(group, _per_layer(enc, len(group))):
                layer_encodings[j] = e
        ff = d_ff or 4 * d_model
        blocks = []
        for i, e in enumerate(layer_encodings):
            span = specs[i].span.as_tuple() if specs is not None else None
            layer_norm = specs[i].qk_norm if specs is not None else qk_norm
            blocks.append(
                Block(
                    d_model,
                    n_heads,
                    ff,
                    e,
                    norm=norm,
                    dropout=dropout,
                    path=path,
                    layer=i,
                    span=span,
                    qk_norm=layer_norm,
                )
            )
        self.blocks = nn.ModuleList(blocks)
        self.final_norm: nn.Module = nn.LayerNorm(d_model) if norm == "pre" else nn.Identity()

    @property
    def encoding_name(self) -> str:
        """The encoding's registered name, or the schedule's string (``"rope@w64*3+nope"``); with ``qk_norm=`` and
        one encoding, its name with the norm's suffix (``"rope#qk"``)."""
        if self.schedule is not None:
            return str(self.schedule)
        name = self.encoding.info.name
        return f"{name}#{QK_NORMS[self.qk_norm]}" if self.qk_norm is not None else name

    def distinct_encodings(self) -> list[PositionalEncoding]:
        """Every encoding instance of the model once: the model's own (``encoding``), then each layer's."""
        out: list[PositionalEncoding] = [self.encoding]
        for block in self.blocks:
            enc = block.attn.encoding
            if enc is not None and all(enc is not e for e in out):
                out.append(enc)
        return out

    def embed_tokens(self, tokens: Tensor, positions: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Token embeddings plus the encoding's ``embed`` hook; ``attention_mask`` ``[B, M + L]`` is the key padding.

        An encoding whose codes read the whole row (``codes_read_the_row``: ``normalized`` divides by the row's
        length) sees the padding tokens at position 0, so a sequence padded beside a longer one keeps its codes."""
        x = self.factor(self.tok(tokens) * self.embed_scale)
        if "embed" in self.encoding.hooks():
            b, n = tokens.shape
            if (
                self.encoding.codes_read_the_row
                and isinstance(attention_mask, Tensor)
                and attention_mask.dim() == 2
                and attention_mask.shape[0] == b
                and attention_mask.shape[1] >= n
            ):  # (a mask of another shape is refused by the attention, naming it)
                real = attention_mask[:, attention_mask.shape[1] - n :].bool()
                positions = positions.expand(b, n).masked_fill(~real, 0)
            x = self.encoding.embed(x, positions, tokens=tokens)
        return self.drop(x)

    def _check_tokens(self, tokens: Any) -> None:
        """Token ids: a ``[batch, length]`` integer tensor, not empty, in ``[0, vocab_size)``, on the model's device."""
        vocab = self.vocab_size
        if not isinstance(tokens, Tensor):
            raise ConfigError(f"tokens must be a tensor of token ids [batch, length], got {type(tokens).__name__}")
        if tokens.dim() != 2:
            raise ConfigError(
                f"tokens must be [batch, length], got shape {tuple(tokens.shape)}; a single sequence is tokens[None, :]"
            )
        if tokens.dtype == torch.bool or tokens.is_floating_point() or tokens.is_complex():
            raise ConfigError(
                f"tokens must hold integer token ids (torch.long), got dtype {tokens.dtype}; "
                "pass tokens.long() if they are whole numbers"
            )
        if tokens.shape[0] == 0 or tokens.shape[1] == 0:
            raise ConfigError(
                f"tokens has no tokens (shape {tuple(tokens.shape)}): posenc refuses empty input for every encoding; "
                "pass at least one sequence of at least one token"
            )
        if tokens.device != self.tok.weight.device:
            raise ConfigError(
                f"tokens are on {tokens.device} but the model is on {self.tok.weight.device}; move one of them"
            )
        if not torch.compiler.is_compiling():
            low, high = int(tokens.min()), int(tokens.max())
            if low < 0 or high >= vocab:
                bad = low if low < 0 else high
                raise ConfigError(
                    f"token id {bad} is out of range: ids must be in [0, vocab_size={vocab}) (ids here go from "
                    f"{low} to {high}); build the model with a larger vocab_size or map the ids"
                )

    def _check_positions(self, positions: Any, n: int, b: int, what: str) -> Tensor:
        """Explicit positions ``[n]`` or ``[1|b, n]``: finite and ``>= 0`` (the encoding checks its own limits)."""
        if not isinstance(positions, Tensor):
            raise PositionError(f"{what} must be a tensor [length] or [batch, length], got {type(positions).__name__}")
        rows = as_position_rows(positions, n)
        if rows.shape[0] not in (1, b):
            raise PositionError(f"{what} must have batch size 1 or {b}, got shape {tuple(positions.shape)}")
        if rows.device != self.tok.weight.device:
            raise PositionError(f"{what} are on {rows.device} but the model is on {self.tok.weight.device}")
        check_positions(rows, what=what, integer=False)
        return rows

    def _check_cache(self, kv_cache: Any) -> int:
        """The number of cached positions of a :class:`KVCache` this model filled (0 if empty or ``None``)."""
        if kv_cache is None:
            return 0
        if not isinstance(kv_cache, KVCache):
            raise ConfigError(f"kv_cache must be a posenc.KVCache, got {type(kv_cache).__name__}")
        if not kv_cache.layers:
            return 0
        layers = sorted(kv_cache.layers)
        if layers != list(range(self.n_layers)) and set(layers) < set(range(self.n_layers)):
            raise ConfigError(
                f"the KVCache holds only layers {layers} of this model's {self.n_layers}: a forward failed part way "
                "through it (or another model filled it); start a new posenc.KVCache()"
            )
        if layers != list(range(self.n_layers)):
            raise ConfigError(
                f"the KVCache holds layers {layers} but this model has {self.n_layers} layers "
                f"(0..{self.n_layers - 1}); it was filled by another model: start a new posenc.KVCache()"
            )
        lengths = {kv_cache.seen(i) for i in layers}  # a local layer holds fewer keys than it has taken in
        if len(lengths) != 1:
            raise ConfigError(
                f"the KVCache's layers hold different numbers of positions ({sorted(lengths)}): a forward failed "
                "part way through it; start a new posenc.KVCache()"
            )
        return lengths.pop()

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
        self._check_tokens(tokens)
        b, n = tokens.shape
        if memory is not None:
            if not isinstance(memory, (list, tuple)) or not all(isinstance(t, Tensor) for t in memory):
                raise ConfigError(f"memory must be a list of tensors, one per layer ({self.n_layers}), got {memory!r}")
            if len(memory) != self.n_layers:
                raise ConfigError(f"memory must hold one tensor per layer ({self.n_layers}), got {len(memory)}")
            lengths = {t.shape[1] if t.dim() == 3 else None for t in memory}
            if len(lengths) != 1 or None in lengths:
                raise ConfigError(
                    f"memory must be {self.n_layers} tensors [batch={b}, M, {self.d_model}] of one length M, got "
                    f"shapes {[tuple(t.shape) for t in memory]}"
                )
        m = memory[0].shape[1] if memory is not None else 0
        past = self._check_cache(kv_cache)
        # shared by every layer of this forward: per-forward tables, and what the positions are (the attention
        # decides once whether they are start + arange per row, which the skew / Toeplitz / blocked forms need;
        # positions made here are marked so, and need no check)
        cache: dict = {}
        if positions is None:
            q_pos = mark_arange(cache, torch.arange(past + m, past + m + n, device=tokens.device)[None, :])
        else:
            q_pos = self._check_positions(positions, n, b, "positions")
        key_positions = None
        if memory is None and memory_positions is not None:
            raise ConfigError("memory_positions were given without memory; pass memory= too, or leave them out")
        if memory is not None:
            mem_pos = (
                torch.arange(past, past + m, device=tokens.device)[None, :]
                if memory_positions is None
                else self._check_positions(memory_positions, m, b, "memory_positions")
            )
            if mem_pos.shape[0] != q_pos.shape[0]:
                nb = max(mem_pos.shape[0], q_pos.shape[0])
                mem_pos, q_pos = mem_pos.expand(nb, -1), q_pos.expand(nb, -1)
            key_positions = torch.cat([mem_pos, q_pos], dim=1)
            if positions is None and memory_positions is None:
                mark_arange(cache, key_positions)
        if (
            positions is None
            and memory is None
            and past == 0
            and isinstance(attention_mask, Tensor)
            and attention_mask.dim() == 2
            and attention_mask.shape[0] == b
            and attention_mask.shape[1] == n
            and any(getattr(e, "length_dependent", False) for e in self.distinct_encodings())
        ):  # an encoding that reads the length (dynamic NTK) sees the padding at position 0, not its padded length
            q_pos = q_pos.expand(b, n).masked_fill(~attention_mask.bool(), 0)
        if "positions" in self.encoding.hooks():
            # in training, one draw per sequence (randomized positions): give the hook the whole batch
            q_pos = self.encoding.positions(q_pos.expand(b, -1) if self.training else q_pos, self.training)
            if key_positions is not None:
                key_positions = torch.cat([key_positions[:, :m].expand(q_pos.shape[0], -1), q_pos], dim=1)
        x = self.embed_tokens(tokens, q_pos, attention_mask)
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
    """A bidirectional encoder trunk: ``Transformer(vocab_size, causal=False, ...)``."""
    if "causal" in kwargs:
        raise ConfigError(
            "Encoder is bidirectional and takes no causal=; for a causal trunk use posenc.Decoder(...) "
            "or posenc.Transformer(..., causal=True)"
        )
    return Transformer(vocab_size, causal=False, **kwargs)


def Decoder(vocab_size: int, **kwargs: Any) -> Transformer:
    """A causal decoder trunk: ``Transformer(vocab_size, causal=True, ...)``."""
    if "causal" in kwargs:
        raise ConfigError(
            "Decoder is causal and takes no causal=; for a bidirectional trunk use posenc.Encoder(...) "
            "or posenc.Transformer(..., causal=False)"
        )
    return Transformer(vocab_size, causal=True, **kwargs)


def _takes_transformer_arguments(fn: Any) -> None:
    """Show ``Transformer``'s keyword arguments, less ``causal``, as ``fn``'s signature and docs.

    ``fn`` forwards ``**kwargs`` to :class:`Transformer`; without this, ``help(posenc.Encoder)`` and
    ``inspect.signature`` would show only ``(vocab_size, **kwargs)``.
    """
    import inspect

    sig = inspect.signature(Transformer.__init__)
    params = [p for name, p in sig.parameters.items() if name not in ("self", "causal")]
    fn.__signature__ = sig.replace(parameters=params, return_annotation="Transformer")
    lines = inspect.cleandoc(Transformer.__doc__ or "").splitlines()
    args = lines[lines.index("Args:") :] if "Args:" in lines else []
    kept: list[str] = []
    skipping = False
    for line in args:
        entry = line.startswith(" " * 4) and not line.startswith(" " * 5)  # an argument's first line
        if entry:
            skipping = line.strip().startswith("causal:")
        if not skipping:
            kept.append(line)
    fn.__doc__ = "\n\n".join([fn.__doc__ or "", "\n".join(kept)]).rstrip() + "\n"


_takes_transformer_arguments(Encoder)
_takes_transformer_arguments(Decoder)


POOLINGS = ("mean", "first", "last", "max")


class SequenceClassifier(nn.Module):
    """A trunk plus pooling and a linear classifier: ``logits [B, n_classes]``."""

    def __init__(self, vocab_size: int, n_classes: int, *, pooling: str = "mean", **trunk: Any):
        super().__init__()
        if pooling not in POOLINGS:
            raise ConfigError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        check_int("n_classes", n_classes)
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
        check_int("n_tags", n_tags)
        self.trunk = Transformer(vocab_size, **trunk)
        self.head = nn.Linear(self.trunk.d_model, n_tags)

    def forward(self, tokens: Tensor, **kwargs: Any) -> Tensor:
        return self.head(self.trunk(tokens, **kwargs).hidden)


# ------------------------------------------------------------ generation helpers (LanguageModel.generate)


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

    def decoding_mode(self, prompt_length: int, max_new_tokens: int, *, use_cache: bool = True) -> tuple[str, str]:
        """How :meth:`generate` decodes a prompt of ``prompt_length`` tokens: ``(mode, why)``.

        ``mode`` is one of :data:`DECODING_MODES`:

        * ``"cache"``: the prompt fills a :class:`~posenc.attention.KVCache`, then one token per forward;
        * ``"memory"``: the same with Transformer-XL's segment memory (each layer's inputs so far, kept
          whole, never truncated), for ``transformer-xl`` and ``xlnet`` (which keeps its recurrence);
        * ``"recompute"``: the whole sequence every step, where a cache would change the numbers
          (``use_cache=False``, a bidirectional model, or an encoding that depends on the whole
          sequence -- see :meth:`~posenc.base.PositionalEncoding.cache_problem`).
        """
        if isinstance(prompt_length, bool) or not isinstance(prompt_length, int) or prompt_length < 1:
            raise ConfigError(f"prompt_length must be an integer >= 1, got {prompt_length!r}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ConfigError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
        from .randomized import Randomized
        from .relative.transformer_xl import TransformerXL

        if not use_cache:
            return "recompute", "use_cache=False"
        if not self.trunk.causal:
            return "recompute", "causal=False: earlier tokens attend to the tokens generated after them"
        encodings = self.trunk.distinct_encodings()
        for encoding in encodings:
            why = encoding.cache_problem(prompt_length, prompt_length + max(max_new_tokens, 1) - 1)
            if why is not None:
                return "recompute", why
        for encoding in encodings:
            inner = encoding.inner if isinstance(encoding, Randomized) else encoding
            if isinstance(inner, TransformerXL):
                return "memory", (
                    f"{inner.info.name}: Transformer-XL's segment memory holds every layer's inputs so far"
                )
        return "cache", "the keys, values and positions of earlier tokens do not change as the sequence grows"

    @torch.no_grad()
    def generate(
        self,
        tokens: Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        do_sample: bool = False,
        use_cache: bool = True,
        generator: torch.Generator | None = None,
        eos_token_id: int | None = None,
    ) -> Tensor:
        """Continue the prompts ``tokens`` ``[B, L]`` by up to ``max_new_tokens`` tokens: ``[B, L + new]``.

        Runs in eval mode (no dropout, randomized positions unchanged) and puts every submodule back in
        the mode it was in. Each step picks the next token from the last position's logits:

        * greedy (``do_sample=False``, or ``temperature=0``): the argmax (the lowest id among ties);
        * sampling: from ``softmax(logits / temperature)`` restricted to the ``top_k`` largest logits
          (``top_k=None``: all; ties with the k-th logit are kept), drawn with ``generator`` (a seeded
          ``torch.Generator`` on the tokens' device makes it reproducible); ``top_k=1`` is greedy.

        ``use_cache=True`` decodes incrementally (a KV cache, or Transformer-XL's memory for
        ``transformer-xl`` and ``xlnet``) wherever that gives the same numbers as recomputing the whole sequence,
        and recomputes otherwise (``normalized``, ``rope-dynamic`` and ``rope-longrope`` past
        ``original_max_len``, randomized positions with ``at_eval="random"``, ``causal=False``);
        :meth:`decoding_mode` says which and why.

        ``eos_token_id``: a row that generates it is finished, and the rest of that row is filled with
        ``eos_token_id``; generation stops early when every row is finished, so ``new`` may be less than
        ``max_new_tokens``. An ``eos_token_id`` inside the prompt does not count.

        Raises :class:`~posenc.ConfigError` for tokens that are not ``[B, L]`` integer ids in
        ``[0, vocab_size)``, ``max_new_tokens < 0``, ``temperature < 0``, ``top_k < 1``, and for a
        generation longer than the encoding takes (e.g. ``learned`` beyond ``max_len``: the model reads
        ``L + max_new_tokens - 1`` tokens). The result is ``torch.long``.
        """
        _check_generate_arguments(self, tokens, max_new_tokens, temperature, top_k, generator, eos_token_id)
        tokens = tokens.long()
        if max_new_tokens == 0:
            return tokens.clone()
        b, prompt = tokens.shape
        modes = [(m, m.training) for m in self.modules()]
        self.eval()
        try:
            _check_generate_length(self, prompt, prompt + max_new_tokens - 1, tokens.device)
            mode, _ = self.decoding_mode(prompt, max_new_tokens, use_cache=use_cache)
            greedy = not do_sample or temperature == 0
            finished = torch.zeros(b, dtype=torch.bool, device=tokens.device)
            out = tokens
            cache = KVCache() if mode == "cache" else None
            memory: list[Tensor] | None = None
            for step in range(max_new_tokens):
                fed = out if step == 0 or mode == "recompute" else out[:, -1:]
                if mode == "memory":
                    logits, new = self(fed, memory=memory, return_memory=True)
                    memory = new if memory is None else [torch.cat([m, n], 1) for m, n in zip(memory, new)]
                else:
                    logits = self(fed, kv_cache=cache)
                last = logits[:, -1]
                if greedy:
                    nxt = last.argmax(-1)
                else:
                    nxt = _sample(last, temperature, top_k, generator)
                if eos_token_id is not None:
                    nxt = nxt.masked_fill(finished, eos_token_id)
                    finished |= nxt == eos_token_id
                out = torch.cat([out, nxt[:, None]], 1)
                if eos_token_id is not None and bool(finished.all()):
                    break
            return out
        finally:
            for m, training in modes:
                m.training = training
