"""Registered ``randomized-<name>`` encodings: randomized positions (Ruoss et al. 2023) over common encodings.

Each ``randomized-<name>`` class takes the model dimensions a model passes
(``d_model``, ``n_heads``, ``head_dim``, ``max_len``, ``vocab_size``), builds the inner
encoding ``<name>`` from the ones it accepts, and wraps it in
:class:`posenc.randomized.Randomized`. The random range is ``random_max_len``,
which defaults to the model's ``max_len``: the model is built for positions
``0 .. max_len-1``, training draws its (shorter) sequences' positions from that
whole range, and at evaluation every position up to ``max_len`` has been seen.
The inner encoding is built with ``max_len = random_max_len`` (a ``learned``
table then has a row for every position that can be drawn). Set
``random_max_len`` larger than ``max_len`` for a wider range (the paper uses a
range much longer than the training length, e.g. ``L = 2048`` for ``N <= 40``).

The list is explicit (not every registered name): the inner encodings here are
the ones whose module this file imports, so registration does not depend on the
order in which encoding modules load. Any other encoding can be wrapped with
:func:`posenc.randomized.randomized`.
"""

from __future__ import annotations

from typing import Any

from ..absolute.learned import LearnedAbsolute
from ..absolute.sinusoidal import Sinusoidal, SinusoidalConcat
from ..base import Card, PositionalEncoding
from ..errors import ConfigError
from ..randomized import Randomized
from ..registry import build, register
from ..rotary.rope import RoPE, RoPEInterleaved
from .alibi import ALiBi, ALiBiBidirectional
from .dynamic import DynamicPositionBias
from .fire import FIRE
from .kerple import KerpleLog, KerplePower


class RandomizedNamed(Randomized):
    """A :class:`Randomized` whose inner encoding is built by name from the model's dimensions."""

    inner_class: type[PositionalEncoding]

    def __init__(
        self,
        d_model: int | None = None,
        n_heads: int | None = None,
        head_dim: int | None = None,
        max_len: int = 512,
        vocab_size: int | None = None,
        n_layers: int | None = None,
        causal: bool | None = None,
        embedding_std: float | None = None,
        random_max_len: int | None = None,
        at_eval: str = "ordinary",
        inner_options: dict[str, Any] | None = None,
    ):
        span = max_len if random_max_len is None else random_max_len
        if not isinstance(span, int) or isinstance(span, bool) or span < 1:
            raise ConfigError(f"{self.info.name}: random_max_len must be a positive integer, got {span!r}")
        dims = dict(
            d_model=d_model,
            n_heads=n_heads,
            head_dim=head_dim,
            max_len=span,
            vocab_size=vocab_size,
            n_layers=n_layers,
            causal=causal,
            embedding_std=embedding_std,
        )
        dims = {k: v for k, v in dims.items() if v is not None}
        inner = build(self.inner_class.info.name, dims=dims, options=inner_options)
        super().__init__(inner, span, at_eval=at_eval)


INNER: tuple[type[PositionalEncoding], ...] = (
    Sinusoidal,
    SinusoidalConcat,
    LearnedAbsolute,
    RoPE,
    RoPEInterleaved,
    ALiBi,
    ALiBiBidirectional,
    KerpleLog,
    KerplePower,
    FIRE,
    DynamicPositionBias,
)


def _make(inner: type[PositionalEncoding]) -> type[RandomizedNamed]:
    base = inner.info
    name = f"randomized-{base.name}"
    card = Card(
        name=name,
        title=f"Randomized positions over {base.title}",
        paper=f"Ruoss et al., Randomized Positional Encodings Boost Length Generalization of Transformers "
        f"(over {base.name})",
        year=2023,
        family=base.family,
        position=base.position,
        learnable=base.learnable,
        summary=f"{base.name} fed a sorted random sample of positions from [0, random_max_len) in training.",
        reference=Randomized.info.reference,
        shortcoming=base.shortcoming,
    )
    doc = (
        f"Randomized positions (Ruoss et al. 2023) over ``{base.name}``: in training the positions "
        f"``0..N-1`` become a sorted sample of N distinct positions from ``[0, random_max_len)``; "
        f"see :mod:`posenc.randomized`."
    )
    cls_name = "Randomized" + inner.__name__
    cls = type(
        cls_name,
        (RandomizedNamed,),
        {
            "inner_class": inner,
            "info": card,
            "__doc__": doc,
            "__module__": __name__,
            "scale_token_embeddings": inner.scale_token_embeddings,
        },
    )
    return register(cls)


REGISTERED: dict[str, type[RandomizedNamed]] = {}
for _inner in INNER:
    _cls = _make(_inner)
    REGISTERED[_cls.info.name] = _cls
    globals()[_cls.__name__] = _cls
