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

Which encodings get one is declared in their own files (``randomized_variant = True``
on the class, inherited by subclasses unless they set it back to ``False``);
:mod:`posenc.registry` calls :func:`add_variant` (installed here with
:func:`posenc.registry.add_variant_maker`, so that the registry imports no encoding
module) once every encoding module is loaded, so registration does not depend on the
order in which encoding modules load, and a class registered later gets its variant
when it registers. Any other encoding can be wrapped
with :func:`posenc.randomized.randomized`.
"""

from __future__ import annotations

from typing import Any

from ..base import Card, PositionalEncoding
from ..errors import ConfigError
from ..randomized import Randomized
from ..registry import add_variant_maker, available, build, example_options, register


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


def _inner_example(inner: type[PositionalEncoding], dims: dict[str, Any]) -> dict[str, Any]:
    options = example_options(inner, dims)
    return {"inner_options": options} if options else {}


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
            "example_options": staticmethod(lambda dims: _inner_example(inner, dims)),
        },
    )
    return register(cls)


REGISTERED: dict[str, type[RandomizedNamed]] = {}  # randomized-<name> -> its class, filled by the registry


def add_variant(inner: type[PositionalEncoding]) -> type[RandomizedNamed]:
    """Register ``randomized-<name>`` over ``inner`` (once; called by :mod:`posenc.registry`, see
    :func:`~posenc.registry.add_variant_maker`)."""
    for cls in REGISTERED.values():
        if cls.inner_class is inner:
            return cls
    cls = _make(inner)
    REGISTERED[cls.info.name] = cls
    globals()[cls.__name__] = cls
    return cls


add_variant_maker(add_variant)


def __getattr__(name: str) -> Any:
    # the variant classes (RandomizedRoPE ...) exist once the registry has loaded every encoding
    available()
    try:
        return globals()[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
