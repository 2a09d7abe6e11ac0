r"""What the query temperatures share: an inner encoding, and a factor that multiplies each query after it.

A temperature multiplies the logits of query ``i`` by one number ``m_i`` (per head, for SSMax):

.. math::
    \mathrm{softmax}_j\big(m_i \cdot \mathrm{scale} \cdot q_i^\top k_j\big)
    = \mathrm{softmax}_j\big(\mathrm{scale} \cdot (m_i q_i)^\top k_j\big)

so multiplying the query by ``m_i`` is exact. It is done in the ``rotate`` hook, after the inner encoding's own
rotation (RoPE, YaRN ...): the attention then runs on its ordinary kernels (SDPA's fast path included), and the keys a
KV cache keeps are the inner encoding's, untouched. The factor is read from the true positions
(``ctx.q_pos``: a KV-cache step, left padding and explicit positions included), never from ``arange``.

Every other hook (``positions``, ``embed``, ``logits``, ``bias``, ``values``, ``scale``) and every fast form
(``relative_form``, ``bias_offsets``, ``bias_blocks``, ``content_query``, ``blocked_attention``) is the inner
encoding's; the class itself overrides no ``relative_form`` (an instance takes the inner one's where it offers it),
so that what the class declares is what its default inner encoding, NoPE, offers. What the inner
encoding adds through the query (a Shaw or DeBERTa ``q_i · r`` term) is multiplied with it, as in the models this
follows (Llama 4 and Mistral 3 multiply ``query_states`` and nothing else); a term that does not go through the
query (a bias such as ALiBi's or T5's, a key term ``r · k_j``, Transformer-XL's ``u · k_j``) is not: this is a
*query* temperature.

Imports :mod:`posenc.base`, :mod:`posenc.errors` and :mod:`posenc.registry`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from torch import Tensor

from ..base import AttentionContext, Cost, PositionalEncoding
from ..errors import ConfigError, PosencError, UnknownNameError
from ..registry import build, resolve

#: the inner encoding a temperature wraps when none is named
DEFAULT_INNER = "nope"


class _Hooks:
    """``hooks()`` for a temperature: on an instance, its inner encoding's hooks plus ``rotate``; on the class, those
    of the default inner encoding (``nope``: none) plus ``rotate``."""

    def __get__(self, obj: Any, owner: type) -> Any:
        if obj is None:
            return lambda: frozenset({"rotate"})
        return obj._hooks


def build_inner(
    owner: str, inner: Any, inner_options: Any, dims: dict[str, Any], shared: Mapping[str, Any] | None = None
) -> PositionalEncoding:
    """The inner encoding ``inner`` (a registered name) built from the model ``dims`` it takes and ``inner_options``.

    ``shared``: settings the temperature passes on where the inner encoding takes them and ``inner_options`` does
    not set them (Mistral 3's ``original_max_len``, which its YaRN reads too). Errors name the temperature.
    """
    if not isinstance(inner, str):
        raise ConfigError(
            f"encoding {owner!r}: inner must be the name of a registered encoding (e.g. 'nope', 'rope', "
            f"'rope-yarn'), got {type(inner).__name__} {inner!r}"
        )
    if inner_options is not None and not isinstance(inner_options, Mapping):
        raise ConfigError(
            f"encoding {owner!r}: inner_options must be a dict of the inner encoding's settings, "
            f"got {type(inner_options).__name__} {inner_options!r}"
        )
    try:
        cls = resolve(inner)
    except UnknownNameError as e:
        e.args = (f"encoding {owner!r}: inner={inner!r}: {e.args[0]}",)
        raise
    options = dict(inner_options or {})
    from ..registry import accepted_arguments

    accepted = accepted_arguments(cls)
    for k, v in (shared or {}).items():
        if k in accepted and k not in options and v is not None:
            options[k] = v
    known = {k: v for k, v in dims.items() if v is not None}
    try:
        return build(cls.info.name, dims=known, options=options or None)
    except PosencError as e:
        raise type(e)(f"encoding {owner!r}: its inner encoding {cls.info.name!r}: {e}") from None


class QueryTemperature(PositionalEncoding):
    """Base of the query temperatures: the inner encoding's hooks, then each query times :meth:`factor`.

    A subclass implements :meth:`factor` and calls :meth:`_wrap` from its ``__init__``.
    """

    hooks = _Hooks()  # type: ignore[assignment]
    inner: PositionalEncoding

    def _wrap(
        self, inner: Any, inner_options: Any, dims: dict[str, Any], shared: Mapping[str, Any] | None = None
    ) -> None:
        self._adopt(build_inner(self.info.name, inner, inner_options, dims, shared))

    def _adopt(self, enc: PositionalEncoding) -> None:
        """Make ``enc`` the inner encoding."""
        self.inner = enc
        # mirror the inner encoding's class attributes on the instance (what the attention and the models read)
        self.shared_across_layers = enc.shared_across_layers  # type: ignore[misc]
        self.key_projection = enc.key_projection  # type: ignore[misc]
        self.requires_tokens = enc.requires_tokens  # type: ignore[misc]
        self.scale_token_embeddings = enc.scale_token_embeddings  # type: ignore[misc]
        self.fused_min_pairs = enc.fused_min_pairs  # type: ignore[misc]
        self.logits_read_scores = enc.logits_read_scores  # type: ignore[misc]
        self.codes_read_the_row = enc.codes_read_the_row  # type: ignore[misc]
        self.key_state_channels = enc.key_state_channels  # type: ignore[misc]  (FoX's running sums in a KV cache)
        # the inner encoding's fast forms that are declared by their presence: CoPE's own row-blocked kernel (the plan
        # looks for the attribute) and an offset-table form (an overridden relative_form declares one; offered here
        # only where the inner encoding offers it, see offers_relative_form)
        if hasattr(enc, "blocked_attention"):
            self.blocked_attention = enc.blocked_attention
            self.decodes_itself = enc.decodes_itself  # type: ignore[misc]  (FoX's decoding step, with its own kernel)
            self.blocks_causal_only = enc.blocks_causal_only  # type: ignore[misc]  (stick-breaking: causal calls)
        if enc.offers_relative_form():
            self.relative_form = enc.relative_form  # type: ignore[method-assign]
        self._inner_rotates = "rotate" in enc.hooks()

    def _hooks(self) -> frozenset[str]:
        return self.inner.hooks() | {"rotate"}

    # ------------------------------------------------------------ the temperature
    def factor(self, q: Tensor, ctx: AttentionContext) -> Tensor:
        """The factor of each query: ``[B|1, 1|H, Lq, 1]``, broadcast against q ``[B, H, Lq, Dh]``."""
        raise NotImplementedError

    def factor_cost(self, head_dim: int) -> Cost:
        """The work of the factor itself beyond multiplying q (default: nothing per pair)."""
        return Cost()

    def rotate(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> tuple[Tensor, Tensor]:
        if self._inner_rotates:
            q, k = self.inner.rotate(q, k, ctx)
        return q * self.factor(q, ctx).to(q.dtype), k

    # ------------------------------------------------------------ the inner encoding's hooks
    def positions(self, positions: Tensor, training: bool) -> Tensor:
        return self.inner.positions(positions, training)

    def embed(self, x: Tensor, positions: Tensor, tokens: Tensor | None = None) -> Tensor:
        return self.inner.embed(x, positions, tokens=tokens)

    def logits(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> Tensor | None:
        return self.inner.logits(q, k, ctx)

    def bias(self, ctx: AttentionContext) -> Tensor | None:
        return self.inner.bias(ctx)

    def values(self, probs: Tensor, ctx: AttentionContext) -> Tensor | None:
        return self.inner.values(probs, ctx)

    def scale(self, head_dim: int) -> float:
        return self.inner.scale(head_dim)

    def probabilities(self, logits: Tensor, ctx: AttentionContext) -> Tensor | None:
        return self.inner.probabilities(logits, ctx)  # weights of the inner encoding's own (stick-breaking)

    def content_query(self, q: Tensor, ctx: AttentionContext) -> Tensor | None:
        return self.inner.content_query(q, ctx)

    def bias_offsets(self, ctx: AttentionContext) -> Tensor | None:
        return self.inner.bias_offsets(ctx)

    def bias_blocks(self, ctx: AttentionContext) -> Any:
        return self.inner.bias_blocks(ctx)

    def flex_score(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> Any:
        return self.inner.flex_score(q, k, ctx)  # q arrives scaled by the temperature: the inner adds its terms

    def offers_relative_form(self) -> bool:
        # the inner encoding's form, set on the instance by _wrap where it offers one
        return self.inner.offers_relative_form()

    def cache_problem(self, shortest: int, longest: int) -> str | None:
        return self.inner.cache_problem(shortest, longest)

    def check_sizes(self, **sizes: int | None) -> None:
        super().check_sizes(**sizes)
        try:
            self.inner.check_sizes(**sizes)
        except ConfigError as e:
            raise ConfigError(f"{self.info.name}: {e}") from None

    def cost(self, head_dim: int) -> Cost:
        # the inner encoding's work, plus q times its factor: head_dim multiplies per query token and head (the
        # keys are untouched); the factor itself is one number per query position (and head), see factor_cost
        inner, own = self.inner.cost(head_dim), self.factor_cost(head_dim)
        note = f"{self.info.name}: each query times its factor (head_dim per token and head)"
        if own.note:
            note += f"; {own.note}"
        return dataclasses.replace(
            inner,
            pair_elementwise=inner.pair_elementwise + own.pair_elementwise,
            token_elementwise=inner.token_elementwise + head_dim + own.token_elementwise,
            note=f"{note}; over {self.inner.info.name}: {inner.note}" if inner.note else note,
        )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Calling a temperature calls its inner encoding (e.g. ``rope(x, positions)``)."""
        return self.inner(*args, **kwargs)

    def fresh_copy(self) -> PositionalEncoding:
        """A new instance with the same settings; an inner encoding the layers share (T5's table) stays shared."""
        copy = type(self)(**self.params)
        if self.inner.shared_across_layers:
            shared = copy.shared_across_layers
            copy._adopt(self.inner)
            copy.shared_across_layers = shared  # type: ignore[misc]  # the temperature's own (SSMax: per layer)
        return copy
