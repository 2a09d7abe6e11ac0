r"""Randomized positional encodings (Ruoss et al. 2023), as a wrapper around any encoding.

Ruoss, Delétang, Genewein, Grau-Moya, Csordás, Bennani, Legg and Veness,
"Randomized Positional Encodings Boost Length Generalization of Transformers"
(ACL 2023). A model trained on sequences of length ``N`` has only ever seen the
positions ``0 .. N-1``; tested on longer inputs it meets positions it has never
seen. The fix: during training, replace the positions ``0 .. N-1`` by an
*ordered random sample* of ``N`` distinct positions from a much larger range
``[0, L)``,

.. math::
    (p_1 < p_2 < \dots < p_N) = \operatorname{sort}\big(\text{sample without replacement of } N
    \text{ from } \{0, \dots, L-1\}\big)

and feed them to the ordinary encoding (sinusoidal, learned, RoPE, ALiBi, ...).
The model learns to use only the *order* of positions, and at test time every
position up to ``L`` has been seen in training.

The wrapper works through the core's ``positions`` hook (called once per model
forward by :class:`~posenc.models.Transformer`) and forwards every other hook
(``embed``, ``rotate``, ``logits``, ``bias``, ``values``, ``scale``) and every class
attribute (``key_projection``, ``requires_tokens``, ``shared_across_layers``) to
the inner encoding, so it works with any encoding that takes explicit positions.

Generalisation to positions that are not ``0 .. N-1`` (a KV cache, packed
documents restarting at 0, left padding): with ``n = max(positions) + 1`` we
sample an ordered ``n``-subset ``s`` of ``[0, L)`` per sequence and map each
position ``p`` to ``s[p]``. For ``positions = 0 .. N-1`` this is exactly the
paper's procedure; in general it keeps order and equality of positions.

Evaluation. ``at_eval="ordinary"`` (default) uses the given positions unchanged
when the model is not training. The reference implementation
(google-deepmind/randomized_positional_encodings) samples at evaluation too
(it has no training switch) -- ``at_eval="random"`` does that (not with a KV cache:
each decoding step would draw its own sample).

Batch. The positions hook receives ``[B, L]`` or ``[1, L]`` positions; one
sample is drawn per row. The core's Transformer passes ``[1, L]`` when the
caller gives no positions, so then one sample is shared by the batch (as the
reference code does, which draws one per call); pass ``[B, L]`` positions for
one sample per sequence.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .base import HOOKS, AttentionContext, Card, Cost, PositionalEncoding, check_positions
from .errors import ConfigError, PositionError

AT_EVAL = ("ordinary", "random")


class _InstanceHooks:
    """``hooks()`` that answers for the instance: the inner encoding's hooks plus ``positions``.

    On the class it answers from the overridden methods (``Randomized.hooks()``: all of
    them) or, for a registered ``randomized-<name>`` class, from its inner class; on an
    instance it answers what the attention really needs, so that e.g.
    ``randomized-sinusoidal`` keeps the fast path (no ``values`` hook).
    """

    def __get__(self, obj: Any, owner: type) -> Any:
        if obj is None:
            inner = getattr(owner, "inner_class", None)  # randomized-<name>: known before construction
            if inner is not None:
                return lambda: inner.hooks() | {"positions"}
            return lambda: frozenset(h for h in HOOKS if getattr(owner, h) is not getattr(PositionalEncoding, h))
        return obj._hooks


class Randomized(PositionalEncoding):
    r"""Wrap ``inner`` so that training positions are an ordered random sample from ``[0, max_len)``.

    .. math:: p_{1..N} = \operatorname{sort}(\operatorname{sample}_{N}(\{0..L-1\})), \quad L = \texttt{max\_len}

    Args:
        inner: the encoding that receives the (randomized) positions.
        max_len: ``L``, the range positions are drawn from; it must be at least the
            longest sequence (more exactly: the largest position + 1) seen in training,
            else a :class:`~posenc.PositionError` is raised.
        at_eval: ``"ordinary"`` (given positions at evaluation) or ``"random"``
            (sample at evaluation too, as the reference code).
    """

    info = Card(
        name="randomized",
        title="Randomized positions (wrapper)",
        paper="Ruoss et al., Randomized Positional Encodings Boost Length Generalization of Transformers",
        year=2023,
        family="none",
        position="absolute",
        learnable=False,
        summary="Training positions: a sorted random sample from [0, L); any inner encoding.",
        reference="distribution tests of the sample; hook forwarding; the inner encoding unchanged at eval",
    )
    hooks = _InstanceHooks()  # type: ignore[assignment]

    def __init__(self, inner: PositionalEncoding, max_len: int, at_eval: str = "ordinary"):
        super().__init__()
        if not isinstance(inner, PositionalEncoding):
            raise ConfigError(f"randomized() wraps a PositionalEncoding instance, got {type(inner).__name__}")
        if isinstance(inner, Randomized):
            raise ConfigError("randomized() of a randomized encoding: wrap the inner encoding once")
        if not isinstance(max_len, int) or isinstance(max_len, bool) or max_len < 1:
            raise ConfigError(f"randomized positions need max_len >= 1 (the range [0, max_len)), got {max_len!r}")
        if at_eval not in AT_EVAL:
            raise ConfigError(f"at_eval must be one of {AT_EVAL}, got {at_eval!r}")
        self.inner = inner
        self.max_len, self.at_eval = max_len, at_eval
        # mirror the inner encoding's class attributes on the instance
        self.shared_across_layers = inner.shared_across_layers  # type: ignore[misc]
        self.key_projection = inner.key_projection  # type: ignore[misc]
        self.requires_tokens = inner.requires_tokens  # type: ignore[misc]
        self.scale_token_embeddings = inner.scale_token_embeddings  # type: ignore[misc]
        self.key_state_channels = inner.key_state_channels  # type: ignore[misc]
        if type(self).info.name == "randomized":
            base: Card | None = getattr(type(inner), "info", None)  # an unregistered encoding may have none
            name = base.name if base is not None else type(inner).__name__.lower()
            self.info = Card(  # type: ignore[misc]
                name=f"randomized-{name}",
                title=f"Randomized {base.title if base else name}",
                paper=f"Ruoss et al. 2023 over {base.paper if base else name}",
                year=2023,
                family=base.family if base else "none",
                position=base.position if base else "absolute",
                learnable=base.learnable if base else any(p.requires_grad for p in inner.parameters()),
                summary=f"{name} with training positions sampled (sorted) from [0, {max_len}).",
                reference=Randomized.info.reference,
                shortcoming=base.shortcoming if base else "",
            )

    def _hooks(self) -> frozenset[str]:
        return self.inner.hooks() | {"positions"}

    def check_sizes(self, **sizes: int | None) -> None:
        try:
            self.inner.check_sizes(**sizes)  # the inner encoding is the one built for sizes
        except ConfigError as e:
            raise ConfigError(f"{self.info.name}: {e}") from None

    # ------------------------------------------------------------ sampling
    def sample(self, positions: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """Map ``positions`` ``[B, L]`` through an ordered random subset of ``[0, max_len)`` per row."""
        if positions.dim() != 2:
            raise PositionError(f"positions must be [B, L] (or [1, L]), got shape {tuple(positions.shape)}")
        check_positions(positions, what="positions to randomize")
        if positions.numel() == 0:
            return positions
        n = int(positions.max()) + 1
        if n > self.max_len:
            raise PositionError(
                f"randomized positions: the sequence needs {n} distinct positions (largest position {n - 1}) "
                f"but the random range is only [0, {self.max_len}); build it with max_len >= {n} "
                "(randomized-<name>: random_max_len), normally much larger than the training length"
            )
        rows = positions.shape[0]
        noise = torch.rand(rows, self.max_len, generator=generator, device=positions.device, dtype=torch.float32)
        subset = noise.argsort(dim=-1)[:, :n].sort(dim=-1).values  # uniform n-subset, ascending
        return subset.gather(1, positions.long()).to(positions.dtype)

    # --------------------------------------------------------------- hooks
    def cache_problem(self, shortest: int, longest: int) -> str | None:
        if self.at_eval == "random":
            return f"{self.info.name} draws a new random sample of positions in every forward (at_eval='random')"
        return self.inner.cache_problem(shortest, longest)

    def cost(self, head_dim: int) -> Cost:
        # the inner encoding's work; the sample (a sort of N draws per sequence, once per model forward) is not
        # per layer and has no product
        return self.inner.cost(head_dim)

    def positions(self, positions: Tensor, training: bool) -> Tensor:
        if training or self.at_eval == "random":
            positions = self.sample(positions)
        if "positions" in self.inner.hooks():
            positions = self.inner.positions(positions, training)
        return positions

    def embed(self, x: Tensor, positions: Tensor, tokens: Tensor | None = None) -> Tensor:
        return self.inner.embed(x, positions, tokens=tokens)

    def rotate(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> tuple[Tensor, Tensor]:
        return self.inner.rotate(q, k, ctx)

    def logits(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> Tensor | None:
        return self.inner.logits(q, k, ctx)

    def bias(self, ctx: AttentionContext) -> Tensor | None:
        return self.inner.bias(ctx)

    def bias_offsets(self, ctx: AttentionContext) -> Tensor | None:
        return self.inner.bias_offsets(ctx)  # None for the sampled (arbitrary) positions of training

    def bias_blocks(self, ctx: AttentionContext) -> Any:
        return self.inner.bias_blocks(ctx)

    def values(self, probs: Tensor, ctx: AttentionContext) -> Tensor | None:
        return self.inner.values(probs, ctx)

    def scale(self, head_dim: int) -> float:
        return self.inner.scale(head_dim)

    def probabilities(self, logits: Tensor, ctx: AttentionContext) -> Tensor | None:
        return self.inner.probabilities(logits, ctx)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Calling the wrapper calls the inner encoding (e.g. ``rope(x, positions)``)."""
        return self.inner(*args, **kwargs)

    def fresh_copy(self) -> PositionalEncoding:
        params = self.params
        if "inner" in params:
            params["inner"] = self.inner.fresh_copy()
        return type(self)(**params)


def randomized(
    inner: PositionalEncoding | str, max_len: int, *, at_eval: str = "ordinary", **inner_options: Any
) -> Randomized:
    """Wrap an encoding (an instance, or a registered name built with ``inner_options``) in randomized positions.

    >>> import posenc
    >>> from posenc.randomized import randomized
    >>> enc = randomized("rope", max_len=1024, head_dim=16)
    >>> sorted(enc.hooks())
    ['positions', 'rotate']
    """
    if isinstance(inner, str):
        from .registry import get

        inner = get(inner, **inner_options)
    elif inner_options:
        raise ConfigError("pass inner options only with an encoding name, not with an instance")
    return Randomized(inner, max_len, at_eval=at_eval)
