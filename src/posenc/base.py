"""The positional-encoding base class, its hooks, and its card.

Every encoding changes self-attention in one or more places. Writing the logit
between query position i and key position j as a sum of terms (Wu (2022),
formula (1); for DeBERTa, its formula (3); see docs/background.md):

    A_ij = (a) q_i · k_j                 content · content
         + (b) q_i · r_{i-j}             content · position   (Shaw, Transformer-XL, DeBERTa c2p ...)
         + (c) r_{j-i} · k_j             position · content   (Transformer-XL u-term, DeBERTa p2c ...)
         + (d) bias(i, j)                position · position  (T5, ALiBi, KERPLE, FIRE ...)

    z_i = Σ_j softmax(A_i · scale)_j · (v_j + a^V_ij)          (Shaw / NEZHA a^V)

an encoding is one object implementing any of these hooks:

=============  ==========================================  ==============================
hook           acts on                                     examples
=============  ==========================================  ==============================
positions      the position ids, once per model forward    randomized positions
embed          token embeddings before the first layer     sinusoidal, learned, binary ...
rotate         q and k inside attention                    RoPE, xPos
logits         terms (b), (c), (d) added before scaling     Shaw, Transformer-XL, DeBERTa
bias           position-only terms added after scaling     T5, ALiBi, KERPLE, FIRE
values         the a^V term added to the value sum         Shaw, NEZHA
scale          the softmax temperature                     TENER (1), DeBERTa (1/sqrt(3d))
probabilities  the attention weights, instead of softmax   stick-breaking attention
=============  ==========================================  ==============================

``logits`` and ``bias`` differ only in where the temperature applies:
``A = scale · (q·k + logits) + bias``. Papers disagree on this (Shaw scales its
(b) term, ALiBi and T5 do not scale their bias), and the split lets each
encoding say exactly what its paper says.

Positions are always explicit (``AttentionContext.q_pos`` / ``k_pos``), never
assumed to be ``arange(L)``: KV caches, recurrence memory, packed sequences,
left padding and randomized positions all go through the same code.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor, nn

from .errors import ConfigError, PositionError

if TYPE_CHECKING:
    from .fused import RelativeForm

HOOKS = ("positions", "embed", "rotate", "logits", "bias", "values", "scale", "probabilities")

FAMILIES = ("none", "absolute", "rotary", "relative", "bias", "temperature")


@dataclass(frozen=True)
class Card:
    """What an encoding is: shown by ``posenc list`` and used by the analysis."""

    name: str
    title: str
    paper: str
    year: int
    family: str  # one of FAMILIES: where the code lives and which hook it mostly uses
    position: str  # "absolute", "relative" or "none": what the model can see
    learnable: bool
    summary: str
    reference: str = "the paper's formula"  # what the tests compare it with
    shortcoming: str = ""  # the weakness the background articles (docs/background.md) name, if any
    aliases: tuple[str, ...] = ()
    params: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Cost:
    """An encoding's work beyond plain attention (``q·k``, softmax, ``p·v`` and the projections), in FLOPs.

    The floor the encoding's maths sets, in its cheapest exact form (a multiply-add counts 2): what the issue's
    speed targets are measured against (``benchmarks/floors.py`` turns it into a model step's ratio to ``none``).
    *Products* are matrix products (what ``torch.utils.flop_counter`` counts); the ``*_elementwise`` fields are the
    adds, multiplies, gates and lookups it does not count. Every field is per layer unless it says otherwise.

    * ``pair`` / ``pair_elementwise``: per (query, key) pair and head (``q_i·a_ij`` is ``2·d``, a bias add is 1);
    * ``token`` / ``token_elementwise``: per token and head, the token as query and as key together (rotating q
      and k is ``2 × 3·d`` elementwise); negative where the encoding removes a product (TENER has no ``W_k``);
    * ``row``: products per row of a position-only table, all heads together (``W_kR R_d`` is ``2·d_model·H·d``),
      a table that depends on parameters only, so decoding keeps it between steps; ``rows``: how many rows the
      table has where that is fixed (DeBERTa's ``2k``, a bucket table), ``None``: one row per offset ``j - i``;
    * ``embed`` / ``embed_elementwise``: per token, once per model (absolute codes added to the embeddings);
    * ``memory``: where the encoding's extra memory is inherently ``O(L²)``, the bound in words; ``None``: ``O(L)``
      memory is possible (a blocked kernel recomputes what it needs);
    * ``note``: the one-line derivation, and which form the kernels achieve.
    """

    pair: float = 0.0
    pair_elementwise: float = 0.0
    token: float = 0.0
    token_elementwise: float = 0.0
    row: float = 0.0
    rows: int | None = None
    embed: float = 0.0
    embed_elementwise: float = 0.0
    memory: str | None = None
    note: str = ""

    def table_rows(self, offsets: int) -> int:
        """Rows of the position table a call computes when its pairs take ``offsets`` distinct offsets."""
        return offsets if self.rows is None else self.rows

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class AttentionContext:
    """Everything an attention hook may need besides q and k.

    ``q_pos`` and ``k_pos`` are ``[B, Lq]`` and ``[B, Lk]`` where ``B`` is the
    batch size or 1 (the same positions for every sequence).
    """

    q_pos: Tensor
    k_pos: Tensor
    n_heads: int
    head_dim: int
    layer: int = 0
    reference: bool = False  # hooks follow the paper literally (no skewing / gathers)
    cache: dict[Any, Any] = field(default_factory=dict)  # shared by every layer of one forward
    q_segments: Tensor | None = None  # [B, Lq] segment ids (XLNet's relative segments)
    k_segments: Tensor | None = None
    attention: nn.Module | None = None  # the calling attention module (its projections)
    caching: bool = False  # keys are stored in a KV cache after the rotate hook (and reused later)
    mask: Tensor | None = None  # [B|1, 1|H, Lq, Lk] True where query i may attend key j (set before logits/bias)
    # the number of keys of this call (the cached ones and any memory included), set with ``mask`` before the rotate
    # hook, as MultiHeadAttention does (``mask`` is then this call's: ``None``, every key may be attended); ``None``
    # where both are known only after rotating (posenc.hf sets the mask then), so that rotate must not read them
    n_keys: int | None = None
    # every row of q_pos and k_pos is ``start + arange`` and ``k_start - q_start`` is one number for all rows, so
    # j - i takes the Lq + Lk - 1 values of row 0 and an offset-only term is a Toeplitz matrix (skew / fused forms);
    # decided once per forward from what the positions are (:func:`contiguous_positions`)
    contiguous: bool = False
    # the attention took the encoding's content_query as its query: logits() then leaves that content term out
    content_folded: bool = False
    # q·kᵀ [B, H, Lq, Lk] of this call (rotated q and k), where the kernel computed it before calling logits()
    scores: Tensor | None = None
    # the keys a KV cache held for this layer before this call, as the rotate hook returned them; set before the
    # rotate hook, ``None`` without a cache or before its first step
    past_keys: Tensor | None = None
    # the per-key state the KV cache holds for those keys (what the rotate hook set as ``key_state`` then), or ``None``
    past_key_state: Tensor | None = None
    # the per-key state of this call's keys, ``[B, H, Lk, key_state_channels]``: the rotate hook sets it for the new
    # keys (FoX's running sums); a KV cache stores it beside the keys and puts the cached keys' first
    key_state: Tensor | None = None

    def relative(self) -> Tensor:
        """``j - i`` for every query i and key j: ``[B, Lq, Lk]`` (cached per forward)."""
        if torch.compiler.is_compiling():  # no id() of a traced tensor (dynamo's NameError on Llama 4); the graph
            return self.k_pos[:, None, :] - self.q_pos[:, :, None]  # computes it once where it is the same
        key = ("relative", id(self.q_pos), id(self.k_pos))
        rel = self.cache.get(key)
        if rel is None:
            rel = self.k_pos[:, None, :] - self.q_pos[:, :, None]
            self.cache[key] = rel
        return rel


def _capture_params(cls: type) -> None:
    """Wrap ``cls.__init__`` so that an instance remembers the arguments it was built with."""
    init = cls.__dict__.get("__init__")
    if init is None or getattr(init, "_posenc_wrapped", False):
        return
    sig = inspect.signature(init)

    @functools.wraps(init)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> None:
        outer = "_params" not in self.__dict__
        if outer:
            bound = sig.bind(self, *args, **kwargs)
            bound.apply_defaults()
            params = {k: v for k, v in bound.arguments.items() if k != "self"}
            extra = params.pop("kwargs", None)
            if isinstance(extra, dict):
                params.update(extra)
            check_options(type(self), sig, params)
            object.__setattr__(self, "_params", params)
        init(self, *args, **kwargs)

    wrapped._posenc_wrapped = True  # type: ignore[attr-defined]
    cls.__init__ = wrapped  # type: ignore[misc]


# ------------------------------------------------------------------ options
def _positive(v: Any) -> bool:
    return v > 0


def _at_least_one(v: Any) -> bool:
    return v >= 1


def _non_negative(v: Any) -> bool:
    return v >= 0


# limits on settings by name, for every encoding that takes a setting of that name (``None`` always passes):
# name -> (test, what is right). A class adds or overrides entries with ``option_limits``.
_SIZES = "d_model n_heads head_dim vocab_size n_layers max_len num_buckets max_distance npos_max grid_width grid_height"
_COUNTS = "hidden depth length original_max_len random_max_len rotary_dim clamp_len"
_POSITIVE = "layer_norm_eps scale_base attention_factor factor beta_fast beta_slow r1 r2 short_factor long_factor"
_NON_NEGATIVE = "init_std embedding_std gamma mscale mscale_all_dim low_freq_factor high_freq_factor"
OPTION_LIMITS: dict[str, tuple[Callable[[Any], bool], str]] = {
    **{k: (_at_least_one, "a positive integer >= 1") for k in (_SIZES + " " + _COUNTS).split()},
    **{k: (_positive, "> 0") for k in _POSITIVE.split()},
    **{k: (_non_negative, ">= 0") for k in _NON_NEGATIVE.split()},
    "max_relative_position": (_non_negative, "an integer >= 0 (0: every offset shares one table row)"),
    "base": (lambda v: v > 1, "> 1"),
    "dropout": (lambda v: 0 <= v < 1, "in [0, 1)"),
}


def _annotation_kinds(annotation: Any) -> set[str]:
    """The plain types a signature's (string) annotation names: ``"int | None"`` -> ``{"int", "None"}``."""
    if not isinstance(annotation, str):
        annotation = getattr(annotation, "__name__", str(annotation))
    return {part.strip() for part in annotation.split("|")}


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_options(cls: type, sig: inspect.Signature, params: Mapping[str, Any]) -> None:
    """Raise :class:`~posenc.ConfigError` for a setting an encoding cannot take, before it is built.

    Every encoding gets these checks from its ``__init__`` signature, with nothing to write: a setting annotated
    ``int`` must be an integer, ``float`` a real number, ``bool`` a bool and ``str`` a string; no number
    (nor any number in a list of them) may be NaN or infinite; and the limits of :data:`OPTION_LIMITS` for the
    setting's name (``base > 1``, sizes ``>= 1``, ``eps > 0`` ...) plus the class's own ``option_limits`` hold.
    The error names the encoding, the setting, the value and what would be right.
    """
    info = getattr(cls, "info", None)
    name = info.name if info is not None else cls.__name__
    limits = {**OPTION_LIMITS, **getattr(cls, "option_limits", {})}

    def bad(key: str, value: Any, right: str) -> ConfigError:
        p = sig.parameters.get(key)
        default = "" if p is None or p.default is p.empty else f" (the default is {p.default!r})"
        return ConfigError(f"encoding {name!r}: {key} must be {right}, got {value!r}{default}")

    for key, value in params.items():
        if value is None:
            continue
        p = sig.parameters.get(key)
        kinds = _annotation_kinds(p.annotation) if p is not None and p.annotation is not p.empty else set()
        kinds.discard("None")
        if kinds == {"int"} and (isinstance(value, bool) or not isinstance(value, int)):
            raise bad(key, value, "an integer")
        if kinds == {"float"} and not _is_number(value):
            raise bad(key, value, "a number")
        if kinds == {"bool"} and not isinstance(value, bool):
            raise bad(key, value, "True or False")
        if kinds == {"str"} and not isinstance(value, str):
            raise bad(key, value, "a string")
        numbers = [value] if _is_number(value) else []
        if isinstance(value, (list, tuple)) and all(_is_number(v) for v in value):
            numbers = list(value)
        if any(not math.isfinite(v) for v in numbers):
            raise bad(key, value, "finite (not NaN or infinity)")
        limit = limits.get(key)
        if limit is not None and numbers and not all(limit[0](v) for v in numbers):
            raise bad(key, value, limit[1])


class PositionalEncoding(nn.Module):
    """Base class of every encoding. Override the hooks the method needs.

    Class attributes a subclass may set:

    * ``info``: the :class:`Card` (name, paper, family ...).
    * ``shared_across_layers``: ``True`` when one instance serves every layer
      (fixed encodings, T5's shared bias table); ``False`` gives each layer its
      own freshly initialised copy (Shaw's per-layer tables).
    * ``key_projection``: ``False`` makes the attention use ``K = H`` with no
      ``W_k`` (TENER).
    * ``requires_tokens``: the ``embed`` hook needs the token ids (complex-order).
    * ``scale_token_embeddings``: the models scale the token embeddings to unit RMS
      (Vaswani et al. 3.4) when this encoding adds a fixed unit-amplitude code to them
      (sinusoids, binary ...); otherwise they keep BERT/GPT's small ``N(0, 0.02²)`` tokens,
      as the papers of learned, rotary and relative encodings do.
    * ``logits_read_scores``: the ``logits`` hook computes ``q·kᵀ`` itself (CoPE's gates). A call with one query
      (a decoding step) then takes the materialised kernel, which computes ``q·kᵀ`` once and hands it to the hook
      as ``ctx.scores``, instead of SDPA reading the keys a second time.
    * ``codes_read_the_row``: the ``embed`` hook's code for a token depends on the other positions of its row
      (``normalized``: ``t / (N - 1)`` with ``N`` the row's largest position + 1). The models then give the
      padding tokens of an ``attention_mask`` position 0 for the ``embed`` hook, so that a sequence's codes do not
      depend on the longer sequences it is padded beside.
    * ``fused_min_pairs``: the attention uses :meth:`relative_form` (the row-blocked kernel of
      :mod:`posenc.fused`) only from this many query-key pairs ``Lq·Lk`` on; below it the per-block
      loop costs more than the ``[B, H, Lq, Lk]`` tensors it saves (measured in benchmarks/README.md).
    * ``decodes_itself``: the encoding's ``blocked_attention`` also runs a call of one query (a decoding step), at
      any number of keys (FoX: the row of decays from the cached state, one pass, as SDPA's mask);
      without it a one-query call takes the ``logits`` hook and SDPA.
    * ``blocks_causal_only``: the encoding's ``blocked_attention`` runs causal calls only (stick-breaking); a call
      without a causal mask (an encoder) takes its hooks as an encoding without ``blocked_attention`` would.

    What the encoding declares about itself, so that nothing outside its file lists it
    (the tests, ``posenc inspect``, ``posenc bench --encodings all`` and the registry discover it):

    * ``example_options``: the settings beyond the model dimensions (``d_model``, ``n_heads``,
      ``head_dim``, ``max_len`` ...) that build a typical instance, for the encodings that cannot be
      built from the dimensions alone (RoPE scaling's ``factor``, LongRoPE's per-frequency factors,
      2-D RoPE's ``grid_width``). A dict, or a function of the model dimensions returning one
      (``staticmethod(lambda dims: {...})``) where the settings depend on the sizes.
      :func:`posenc.registry.example` builds an encoding with them; inherited like any class attribute.
    * ``claims``: what the papers claim about the properties :mod:`posenc.analysis.properties` measures
      (``{"decay": True, "relative_only": True}``), beyond what the :class:`Card` already implies
      (``position``, ``learnable``, ``shortcoming``); ``None`` withdraws an implied claim. Inherited: a
      subclass that is another method sets its own.
    * ``randomized_variant``: ``True`` also registers ``randomized-<name>`` (randomized positions,
      Ruoss et al. 2023, over this encoding built from the model dimensions; see
      :mod:`posenc.bias.randomized_registry`). Inherited: a subclass that should not have one sets ``False``.
      Any encoding can still be wrapped by hand with :func:`posenc.randomized.randomized`.
    * the fast form: overriding :meth:`relative_form` declares one; an encoding whose form exists only
      under some settings also overrides :meth:`offers_relative_form`. A ``bias`` that depends on the offset
      ``j - i`` only overrides :meth:`bias_offsets` (its values per offset) and builds its ``bias`` from them.
    * :meth:`check_sizes`: the model sizes this instance was built for (``d_model``, ``n_heads``,
      ``head_dim``, ``vocab_size`` among its settings) are compared with the attention's and the model's
      when they are built; override it for sizes the settings do not name.
    * :meth:`cost`: its work beyond plain attention in FLOPs (:class:`Cost`: per pair, per token, per row of a
      position table), derived from its formula: the floor the speed benchmark measures it against.
    * ``key_state_channels``: the ``rotate`` hook sets ``ctx.key_state`` (``[B, H, L, key_state_channels]``) for
      the new keys (FoX's running sum of log-gates); a KV cache stores it beside the keys, in storage of its own, so
      that the keys stay contiguous for the kernels, and hands the hooks the cached keys' state first (the next
      step's ``rotate`` finds it in ``ctx.past_key_state``).
    * ``option_limits``: ``{setting: (test, what is right)}`` beyond the generic ones every encoding gets from
      :func:`check_options` (types from the ``__init__`` annotations, no NaN or infinity, the limits of
      :data:`OPTION_LIMITS` by setting name: ``base > 1``, sizes ``>= 1``, ``eps > 0`` ...), checked before
      ``__init__`` runs; a bad setting is a :class:`~posenc.ConfigError` naming it, its value and what is right.

    What every encoding is given, checked once by its callers (:class:`posenc.MultiHeadAttention` and the models),
    so that no hook needs to check it again:

    * positions are finite (integers for the encodings that index tables) and ``>= 0``;
    * **empty input is refused, the same way for every encoding**: a sequence of length 0 (or a batch of 0
      sequences) is a :class:`~posenc.ConfigError` at the attention or model call (``"... has no tokens"``), never
      an empty output. A model has nothing to compute for it (a classifier would pool nothing into logits), and
      several encodings' tables have no entry for it. ``tests/test_bad_input.py`` checks this for every
      registered encoding.
    """

    info: ClassVar[Card]
    shared_across_layers: ClassVar[bool] = True
    key_projection: ClassVar[bool] = True
    requires_tokens: ClassVar[bool] = False
    scale_token_embeddings: ClassVar[bool] = False
    fused_min_pairs: ClassVar[int] = 256 * 256
    decodes_itself: ClassVar[bool] = False
    blocks_causal_only: ClassVar[bool] = False
    logits_read_scores: ClassVar[bool] = False
    codes_read_the_row: ClassVar[bool] = False
    example_options: ClassVar[Mapping[str, Any] | Callable[[dict[str, Any]], dict[str, Any]]] = MappingProxyType({})
    claims: ClassVar[Mapping[str, bool | None]] = MappingProxyType({})
    randomized_variant: ClassVar[bool] = False
    option_limits: ClassVar[Mapping[str, tuple[Callable[[Any], bool], str]]] = MappingProxyType({})
    key_state_channels: ClassVar[int] = 0

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _capture_params(cls)

    # ------------------------------------------------------------------ hooks
    def positions(self, positions: Tensor, training: bool) -> Tensor:
        """Map the model's positions ``[B, L]`` before any other hook sees them.

        Called once per forward by the models (not by a standalone attention).
        Randomized positions (Ruoss et al. 2023) sample here during training.
        """
        return positions

    def embed(self, x: Tensor, positions: Tensor, tokens: Tensor | None = None) -> Tensor:
        """Return the token embeddings ``x`` ``[B, L, D]`` with position information added."""
        return x

    def rotate(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> tuple[Tensor, Tensor]:
        """Return q ``[B, H, Lq, Dh]`` and k ``[B, H, Lk, Dh]`` transformed by position."""
        return q, k

    def logits(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> Tensor | None:
        """Terms (b), (c), (d) added to ``q·k`` *before* the temperature: ``[B|1, H|1, Lq, Lk]``."""
        return None

    def bias(self, ctx: AttentionContext) -> Tensor | None:
        """A position-only term added *after* the temperature: ``[B|1, H|1, Lq, Lk]``."""
        return None

    def values(self, probs: Tensor, ctx: AttentionContext) -> Tensor | None:
        """``Σ_j probs_ij · a^V_ij``: ``[B, H, Lq, Dh]`` added to the attention output."""
        return None

    def probabilities(self, logits: Tensor, ctx: AttentionContext) -> Tensor | None:
        """The attention weights ``[B, H, Lq, Lk]`` from the logits, *instead of* softmax (``None``: softmax).

        ``logits`` are the scaled logits with the ``bias`` added and the mask applied (a key a query may not see is
        at the dtype's lowest value). A method whose weights are not a softmax (stick-breaking attention) overrides
        it; the attention then takes the ``materialised`` kernel, which hands the hook the logits and multiplies
        what it returns with the values (rows need not sum to one)."""
        return None

    def scale(self, head_dim: int) -> float:
        """The softmax temperature multiplying the logits (default ``1/sqrt(d_head)``)."""
        return head_dim**-0.5

    def cache_problem(self, shortest: int, longest: int) -> str | None:
        """Why decoding with a KV cache (or Transformer-XL memory) would change this encoding's outputs over
        sequences of ``shortest`` .. ``longest`` tokens, in words; ``None`` (the default) when it would not.

        A cache is exact when the keys, values and positions of earlier tokens are the same in every forward.
        An encoding whose codes depend on the current length (``normalized``, length-dependent RoPE scaling) or
        that draws positions at evaluation says so here; :meth:`posenc.LanguageModel.generate` then recomputes.
        """
        return None

    def relative_form(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> RelativeForm | None:
        """This encoding's ``logits`` (and ``values``) as offset tables, for the row-blocked kernel.

        Not a hook of the paper: an optional fast form of ``logits`` + ``values`` that
        :func:`posenc.fused.relative_attention` computes without any ``[B, H, Lq, Lk]`` tensor. Return
        ``None`` (the default) where it does not apply; the attention then uses the hooks.
        """
        return None

    def content_query(self, q: Tensor, ctx: AttentionContext) -> Tensor | None:
        """The query ``q̃`` whose product with the keys is the content part of this encoding's logits, or ``None``.

        Not a hook of the paper: an optional fast form for an encoding whose ``logits`` add a per-key term
        ``c · k_j`` with a fixed ``c`` (Transformer-XL's and XLNet's ``u · k_j``), so that ``q · k_j + c · k_j =
        (q + c) · k_j``. Where the attention's kernel takes ``q̃`` as its query (the SDPA kernel, e.g. each step of
        KV-cache decoding), it sets ``ctx.content_folded`` before calling :meth:`logits`, which must then leave
        ``c · k_j`` out: the keys are read once, by the kernel, instead of once more for the term.
        """
        return None

    def bias_offsets(self, ctx: AttentionContext) -> Tensor | None:
        """This encoding's ``bias`` as one value per offset, ``[H|1, Lq + Lk - 1]``, where it depends on ``j - i`` only.

        Not a hook of the paper: an optional fast form of :meth:`bias` for positions that are ``start + arange``
        per row (``ctx.contiguous``), where the bias is the Toeplitz matrix ``B[h, i, j] = vals[h, j - i + Lq - 1]``
        (offsets ascending from ``-(Lq - 1)``). :func:`posenc.offset_bias.offset_bias_attention` then attends
        without the ``[H, Lq, Lk]`` bias or its gradient. Return ``None`` (the default) where it does not apply
        (the reference path, arbitrary positions, a bias that depends on more than the offset); the attention
        then calls :meth:`bias`.
        """
        return None

    def flex_score(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> tuple[Tensor, Tensor, Any] | None:
        """This encoding's terms as a flex_attention ``score_mod``: ``(q̃, k̃, score_mod)``, or ``None``.

        Not a hook of the paper: an optional fast form for :mod:`posenc.attention.flex`, for an encoding whose terms
        are neither a bias per offset (:meth:`bias_offsets`) nor offset tables (:meth:`relative_form`), from which
        the flex kernel makes a score_mod itself. ``score_mod(score, b, h, q_idx, kv_idx)`` receives the scaled
        ``q̃·k̃`` of query row ``q_idx`` and key row ``kv_idx`` (row indices of this call, as ``ctx.q_pos`` /
        ``ctx.k_pos`` index them) and returns the logit with the encoding's terms added: elementwise torch ops on
        those scalars and tensors it captures (``torch.compile`` fuses them into the kernel). Return ``None`` (the
        default) where it does not apply.
        """
        return None

    def bias_blocks(self, ctx: AttentionContext) -> tuple[Any, tuple[Tensor, ...]] | None:
        """This encoding's ``bias`` evaluated one block of query rows at a time: ``(fn, params)``, or ``None``.

        Not a hook of the paper: an optional fast form of :meth:`bias` for a bias that is cheap to evaluate on any
        block of pairs but is not a function of ``j - i`` alone (FIRE). ``fn(params, r0, r1, ke)`` returns the
        ``[H|1, r1 - r0, ke]`` bias of query rows ``r0 .. r1 - 1`` against keys ``0 .. ke - 1``, differentiable in
        ``params`` (it is evaluated again under autograd in the backward). The attention then runs
        :func:`posenc.block_bias.block_bias_attention`, which never makes the ``[H, Lq, Lk]`` bias or its gradient.
        ``fn`` may instead be a :class:`posenc.block_bias.BlockFunction` (the function and the gradient of a block
        written out, registered by name): the kernel is then one custom op, which ``torch.compile`` keeps; a plain
        function is left out while compiling (the call takes the portable plan with :meth:`bias`).
        """
        return None

    def offers_relative_form(self) -> bool:
        """Whether :meth:`relative_form` can return a form with this instance's settings (where its conditions on
        the call hold: contiguous positions, the fast path). Default: whether the class overrides it."""
        return type(self).relative_form is not PositionalEncoding.relative_form

    def check_sizes(self, **sizes: int | None) -> None:
        """Raise :class:`~posenc.ConfigError` if this instance was built for other sizes than ``sizes``.

        ``sizes`` are what the caller has: ``d_model``, ``n_heads``, ``head_dim`` (the attention),
        ``vocab_size`` (a model). Each one among this instance's settings (:attr:`params`; where a setting is
        ``None``, an integer attribute of that name, e.g. a ``head_dim`` derived from ``d_model // n_heads``)
        must equal the caller's. :class:`posenc.MultiHeadAttention` and the models call it when they are
        built, so that a hand-built encoding of the wrong size fails there rather than at the first call.
        """
        built = {}
        for k in SIZE_NAMES:
            v = self.params.get(k)
            if v is None:  # a size derived from the others (head_dim = d_model // n_heads): the attribute, if any
                v = getattr(self, k, None)
            if isinstance(v, int) and not isinstance(v, bool):
                built[k] = v
        wrong = [k for k, v in built.items() if sizes.get(k) is not None and v != sizes[k]]
        if wrong:
            raise size_error(self, {k: built[k] for k in wrong}, {k: sizes[k] for k in wrong}, sizes)

    def cost(self, head_dim: int) -> Cost:
        """This encoding's work beyond plain attention at head width ``head_dim`` (:class:`Cost`): the floor its
        maths sets, which ``benchmarks/floors.py`` measures the kernels against.

        Default: nothing. Every registered encoding declares its own in its file, with the derivation in a comment
        (``tests/test_floors.py`` checks that none is left at this default and counts the reference's products).
        """
        return Cost()

    # ------------------------------------------------------------ utilities
    @classmethod
    def hooks(cls) -> frozenset[str]:
        """The hooks this class overrides."""
        return frozenset(h for h in HOOKS if getattr(cls, h) is not getattr(PositionalEncoding, h))

    @property
    def params(self) -> dict[str, Any]:
        return dict(self.__dict__.get("_params", {}))

    @property
    def card(self) -> Card:
        return dataclasses.replace(self.info, params=self.params)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.params.items())

    def reset_parameters(self) -> None:
        """Re-initialise learnable parameters (used when a model copies an encoding per layer)."""
        for m in self.modules():
            if m is not self and hasattr(m, "reset_parameters"):
                m.reset_parameters()

    def fresh_copy(self) -> PositionalEncoding:
        """A new instance with the same settings and freshly initialised parameters."""
        return type(self)(**self.params)


# the model sizes an encoding may be built for, compared by :meth:`PositionalEncoding.check_sizes`
SIZE_NAMES = ("d_model", "n_heads", "head_dim", "vocab_size")


def size_error(
    enc: PositionalEncoding, built: dict[str, Any], wanted: dict[str, Any], sizes: dict[str, Any]
) -> ConfigError:
    """The error for an encoding built for ``built`` sizes used where ``wanted`` ones are (``sizes``: all known)."""
    name = getattr(type(enc), "info", None)
    name = name.name if name is not None else type(enc).__name__
    have = ", ".join(f"{k}={v}" for k, v in built.items())
    need = ", ".join(f"{k}={v}" for k, v in wanted.items())
    known = ", ".join(f"{k}={v}" for k, v in sizes.items() if v is not None)
    return ConfigError(
        f"encoding {name!r} was built for {have} but is used with {need} (sizes here: {known}); "
        f"build it with {need} (e.g. posenc.get({name!r}, ..., {need})), or pass the name {name!r} "
        "and let the model build it"
    )


class NoPositionalEncoding(PositionalEncoding):
    """No positional information at all.

    The model is then permutation-equivariant (Xixiaoyao, "Three positional
    encoding methods"): permuting the input tokens permutes the outputs, so any
    task in which order decides the answer is at chance. In a causal decoder the causal mask still leaks order (see
    ``nope``).
    """

    info = Card(
        name="none",
        title="No positional encoding",
        paper="(baseline)",
        year=2017,
        family="none",
        position="none",
        learnable=False,
        summary="Nothing added: a bidirectional model is permutation-equivariant.",
        reference="permutation equivariance (a property test)",
        shortcoming="cannot tell word order apart in a bidirectional model",
    )

    def cost(self, head_dim: int) -> Cost:
        return Cost(note="the baseline: plain attention, nothing added")


# ---------------------------------------------------------------- positions
def check_positions(
    positions: Tensor,
    *,
    max_position: int | None = None,
    what: str = "positions",
    integer: bool = True,
) -> None:
    """Validate a positions tensor; raise :class:`PositionError` with the limit it broke."""
    if not isinstance(positions, Tensor):
        raise PositionError(f"{what} must be a torch.Tensor, got {type(positions).__name__}")
    if integer and positions.is_floating_point():
        raise PositionError(
            f"{what} must be integers (a torch.long tensor), got dtype {positions.dtype}; "
            "use positions.round().long() if they are whole numbers"
        )
    if positions.dtype == torch.bool or positions.is_complex():
        raise PositionError(f"{what} must be integers (a torch.long tensor), got dtype {positions.dtype}")
    if torch.compiler.is_compiling() or positions.numel() == 0:
        return
    if positions.is_floating_point() and not bool(torch.isfinite(positions).all()):
        bad = positions[~torch.isfinite(positions)].flatten()[0].item()
        raise PositionError(f"{what} must be finite numbers, got {bad}; pass a position >= 0 for every token")
    lo = positions.min().item()
    if lo < 0:
        raise PositionError(f"{what} must be >= 0, got a position of {lo}")
    if max_position is not None:
        hi = int(positions.max())
        if hi >= max_position:
            raise PositionError(
                f"{what} go up to {hi} but this encoding is defined only for positions "
                f"0..{max_position - 1} (max_len={max_position}); build it with a larger max_len "
                "or use an encoding that extrapolates"
            )


_ARANGE = "posenc:arange-rows"


def mark_arange(cache: dict[Any, Any], positions: Tensor) -> Tensor:
    """Record in a forward's ``cache`` that ``positions`` ``[B, L]`` were made as ``start + arange`` per row.

    The model and the attention mark the positions they make themselves, so the check costs nothing there, and
    ``torch.compile`` (which cannot branch on tensor values) still takes the skew / Toeplitz forms.
    """
    if cache is not None:
        # while torch.compile traces, id() of a tensor made inside the graph is not known (dynamo raised
        # NameError: name 'device' is not defined on Llama 4's chunked layers): a list, searched by identity (a
        # list, not the dict's items, which dynamo cannot iterate while the dict changes without a graph break)
        if torch.compiler.is_compiling():
            cache.setdefault(_ARANGE, []).append((positions, True))
        else:
            cache[(_ARANGE, id(positions))] = (positions, True)
    return positions


def _marked(positions: Tensor, cache: dict[Any, Any] | None) -> bool | None:
    """What ``cache`` knows of ``positions`` (:func:`mark_arange`, :func:`is_arange_rows`), else ``None``; while
    ``torch.compile`` traces, found by identity over the cache's entries (no ``id()`` of a traced tensor)."""
    if cache is None:
        return None
    if torch.compiler.is_compiling():
        for got in cache.get(_ARANGE, ()):
            if got[0] is positions:
                return got[1]
        return None
    got = cache.get((_ARANGE, id(positions)))
    return got[1] if got is not None and got[0] is positions else None


def is_arange_rows(positions: Tensor, cache: dict[Any, Any] | None = None) -> bool:
    """Whether every row of integer ``positions`` ``[B, L]`` is ``start + arange(L)`` (memoised in ``cache``).

    Marked tensors (:func:`mark_arange`) are known; others are checked by value once per forward (one pass over
    ``B·L`` integers), except while ``torch.compile`` traces, where an unmarked tensor counts as arbitrary.
    """
    known = _marked(positions, cache)
    if known is not None:
        return known
    if positions.is_floating_point() or positions.is_complex() or positions.dim() != 2 or positions.shape[-1] == 0:
        ok = False
    elif torch.compiler.is_compiling():
        return False
    else:
        ok = positions.shape[-1] == 1 or bool((positions[:, 1:] - positions[:, :-1] == 1).all())
    if cache is not None:
        cache[(_ARANGE, id(positions))] = (positions, ok)
    return ok


def contiguous_positions(q_pos: Tensor, k_pos: Tensor, cache: dict[Any, Any] | None = None) -> bool:
    """Whether ``j - i`` is the same ``Lq × Lk`` Toeplitz pattern in every row (see ``AttentionContext.contiguous``).

    True when both are ``start + arange`` per row and ``k_start - q_start`` is one number for all rows: what a model
    makes by default, and what KV-cache decoding, Transformer-XL memory, explicit offsets and left padding (each row
    shifted by its padding) give. Randomized positions, packed documents restarting at 0 and any other spacing are
    *arbitrary*: the encodings then use their gather forms.
    """
    if not (is_arange_rows(q_pos, cache) and is_arange_rows(k_pos, cache)):
        return False
    if q_pos.shape[0] == 1 and k_pos.shape[0] == 1:
        return True
    if torch.compiler.is_compiling():
        return False
    delta = k_pos[:, :1] - q_pos[:, :1]
    return bool((delta == delta[:1]).all())


def as_position_rows(positions: Tensor | None, length: int, device: torch.device | None = None) -> Tensor:
    """Normalise positions to ``[B, L]`` (``B`` may be 1); ``None`` means ``arange(length)``."""
    if positions is None:
        return torch.arange(length, device=device)[None, :]
    if positions.dim() == 1:
        positions = positions[None, :]
    if positions.dim() != 2:
        raise PositionError(f"positions must have shape [L] or [B, L], got {tuple(positions.shape)}")
    if positions.shape[-1] != length:
        raise PositionError(
            f"positions describe {positions.shape[-1]} tokens but the sequence has {length}; "
            "pass one position per token"
        )
    return positions
