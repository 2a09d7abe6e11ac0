"""Name -> encoding class. Encodings register themselves with :func:`register`.

Every module under ``posenc.absolute``, ``posenc.rotary``, ``posenc.relative``
and ``posenc.bias`` is imported on first use, so adding a method is adding a
file: nothing else needs editing.

The registry sits below the encodings: it imports only :mod:`posenc.base` and
:mod:`posenc.errors`, and the encoding packages by name (``importlib``) when it
loads them. The ``randomized-<name>`` variants are made by a function that
:mod:`posenc.bias.randomized_registry` installs with :func:`add_variant_maker`
when it is loaded.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from ._suggest import unknown_encodings
from .base import Card, NoPositionalEncoding, PositionalEncoding
from .errors import ConfigError, UnknownNameError

_REGISTRY: dict[str, type[PositionalEncoding]] = {}
_ALIASES: dict[str, str] = {}
_FAMILY_PACKAGES = ("absolute", "rotary", "relative", "bias", "temperature")
_loaded = False  # loading has started (guards against re-entry)
_ready = False  # every encoding module is imported: randomized variants are added as classes register
# called with each class that declares ``randomized_variant`` (installed by posenc.bias.randomized_registry)
_variant_makers: list[Callable[[type[PositionalEncoding]], object]] = []

E = TypeVar("E", bound=type[PositionalEncoding])


def register(cls: E) -> E:
    """Class decorator: register ``cls`` under ``cls.info.name`` and its aliases."""
    info: Card = cls.info
    for name in (info.name, *info.aliases):
        owner = _REGISTRY.get(name) or _REGISTRY.get(_ALIASES.get(name, ""))
        if owner is not None and owner is not cls:
            raise RuntimeError(f"encoding name {name!r} is registered twice ({owner.__name__}, {cls.__name__})")
    _REGISTRY[info.name] = cls
    for alias in info.aliases:
        _ALIASES[alias] = info.name
    if _ready and cls.randomized_variant:
        _add_randomized(cls)
    if _ready:
        _refresh_get_doc()
    return cls


def _add_randomized(cls: type[PositionalEncoding]) -> None:
    for make in list(_variant_makers):
        make(cls)


def add_variant_maker(make: Callable[[type[PositionalEncoding]], object]) -> None:
    """Call ``make(cls)`` for every class that declares ``randomized_variant``: for those registered so far once every
    encoding module is loaded (so that nothing depends on the order the modules load in), and for a class registered
    later when it registers. :mod:`posenc.bias.randomized_registry` installs the one that registers
    ``randomized-<name>``; the registry itself knows no encoding module."""
    if make in _variant_makers:
        return
    _variant_makers.append(make)
    if _ready:
        for cls in list(_REGISTRY.values()):
            if cls.randomized_variant:
                make(cls)


register(NoPositionalEncoding)


def _load_all() -> None:
    global _loaded, _ready
    if _loaded:
        return
    _loaded = True
    for pkg_name in _FAMILY_PACKAGES:
        pkg = importlib.import_module(f"posenc.{pkg_name}")
        for mod in pkgutil.walk_packages(pkg.__path__, prefix=f"posenc.{pkg_name}."):
            importlib.import_module(mod.name)
    # randomized-<name> for every class that declares ``randomized_variant``, once all are loaded (so that
    # nothing depends on the order the modules load in); a class registered later gets its variant at once
    _ready = True
    for cls in list(_REGISTRY.values()):
        if cls.randomized_variant:
            _add_randomized(cls)
    _refresh_get_doc()


def available() -> list[str]:
    """The registered encoding names, sorted by family then name."""
    _load_all()
    order = {f: i for i, f in enumerate(("none", "absolute", "rotary", "relative", "bias", "temperature"))}
    return sorted(_REGISTRY, key=lambda n: (order.get(_REGISTRY[n].info.family, 9), n))


def aliases() -> dict[str, str]:
    _load_all()
    return dict(_ALIASES)


def resolve(name: str) -> type[PositionalEncoding]:
    """The class registered under ``name`` (or an alias); unknown names list close matches."""
    _load_all()
    if not isinstance(name, str):
        raise ConfigError(f"an encoding name must be a string, got {type(name).__name__}")
    key = name.strip().lower().replace("_", "-")
    key = _ALIASES.get(key, key)
    try:
        return _REGISTRY[key]
    except KeyError:
        raise unknown_encoding(name) from None


def unknown_encoding(name: str) -> UnknownNameError:
    """The error for an encoding name that is not registered: the close matches, each a name ``posenc list`` shows
    (an alias close to the typo suggests the name it stands for), and where the whole list is (``posenc list``),
    not the ~90 names themselves."""
    return unknown_encodings([name], list(_REGISTRY), _ALIASES)


def check_names(names: list[str], where: str = "") -> None:
    """Raise one :class:`~posenc.errors.UnknownNameError` that names every unknown encoding of ``names`` (each with
    its close matches), instead of stopping at the first. Names only: :func:`posenc.schedule.check_names` also
    takes schedules (``"rope@w64*3+nope"``)."""
    _load_all()
    bad = [n for n in names if registered_class(n) is None]
    if bad:
        raise unknown_encodings(bad, list(_REGISTRY), _ALIASES, where)


def registered_class(name: str) -> type[PositionalEncoding] | None:
    """The class registered as ``name`` (or an alias), ``None`` if there is none (no error, no close matches)."""
    _load_all()
    key = name.strip().lower().replace("_", "-")
    return _REGISTRY.get(_ALIASES.get(key, key))


def card(name: str) -> Card:
    return resolve(name).info


def accepted_arguments(cls: type[PositionalEncoding]) -> dict[str, inspect.Parameter]:
    sig = inspect.signature(cls.__init__)
    return {k: p for k, p in sig.parameters.items() if k != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


def _get(name: str, **kwargs: Any) -> PositionalEncoding:
    """Build the encoding registered as ``name`` (or one of its aliases) with the settings ``kwargs``.

    ``kwargs`` are the arguments of the encoding's class: each encoding takes its own (``rope`` takes
    ``head_dim``, ``alibi`` takes ``n_heads``, ``none`` nothing). The list below gives every registered
    encoding's arguments; an argument without ``=`` is required. ``posenc list`` says what each encoding is;
    ``posenc.card(name)`` gives its paper. A model (``posenc.Encoder``, ``posenc.LanguageModel`` ...) passes
    the dimensions it knows (``d_model``, ``n_heads``, ``head_dim``, ``max_len`` ...) by itself.

    Raises :class:`~posenc.errors.UnknownNameError` for a name that is not registered (with the close
    matches) and :class:`~posenc.errors.ConfigError` for an argument the encoding does not take or a
    required one that is missing.

    >>> import posenc
    >>> rope = posenc.get("rope", head_dim=64)
    >>> alibi = posenc.get("alibi", n_heads=8)
    """
    cls = resolve(name)
    accepted = accepted_arguments(cls)
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise ConfigError(
            f"encoding {cls.info.name!r} does not take {', '.join(map(repr, unknown))}; "
            f"it takes: {', '.join(accepted) or 'no arguments'}"
        )
    missing = [k for k, p in accepted.items() if p.default is p.empty and k not in kwargs]
    if missing:
        raise ConfigError(f"encoding {cls.info.name!r} needs {', '.join(map(repr, missing))}")
    return cls(**kwargs)


_get.__name__ = _get.__qualname__ = "get"
_GET_DOC = _get.__doc__ or ""


def signature_text(cls: type[PositionalEncoding]) -> str:
    """``name(required, option=default, ...)``: the arguments ``posenc.get`` passes to ``cls``."""
    parts = []
    for k, p in accepted_arguments(cls).items():
        parts.append(k if p.default is p.empty else f"{k}={p.default!r}")
    return f"{cls.info.name}({', '.join(parts)})"


def _refresh_get_doc() -> None:
    """Put every registered encoding's arguments into ``get``'s docstring (``help(posenc.get)``)."""
    import textwrap

    lines = []
    for name in available():
        text = signature_text(_REGISTRY[name])
        lines += textwrap.wrap(text, 100, initial_indent="    ", subsequent_indent="        ")
    head = "\n\n    Every registered encoding and its arguments:\n\n"
    _get.__doc__ = _GET_DOC.rstrip() + head + "\n".join(lines) + "\n"


if TYPE_CHECKING:
    get = _get
else:

    def __getattr__(attr: str) -> Any:
        # ``get`` is looked up here (PEP 562) the first time: that look-up loads every encoding, so that
        # help(posenc.get) lists their arguments (_refresh_get_doc); no encoding module imports ``get`` at import
        if attr == "get":
            _load_all()
            globals()["get"] = _get
            return _get
        raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")


# the dimensions a model knows and passes to any encoding that asks for them
MODEL_DIMENSIONS = (
    "d_model",
    "n_heads",
    "head_dim",
    "max_len",
    "vocab_size",
    "n_layers",
    "causal",
    "embedding_std",  # the per-dimension scale of the token embeddings an absolute code is added to
)


def build(
    encoding: str | PositionalEncoding | None,
    *,
    dims: dict[str, Any],
    options: dict[str, Any] | None = None,
) -> PositionalEncoding:
    """Used by models: build ``encoding`` passing the model ``dims`` it accepts plus ``options``."""
    if isinstance(encoding, PositionalEncoding):
        if options:
            raise ConfigError("pass encoding options only with an encoding name, not with an instance")
        return encoding
    cls = resolve("none" if encoding is None else encoding)
    accepted = accepted_arguments(cls)
    kwargs = {k: v for k, v in dims.items() if k in accepted}
    kwargs.update(options or {})
    return _get(cls.info.name, **kwargs)


# ------------------------------------------------------------------ examples
# the sizes :func:`example` uses when given none (small: tests and quick looks)
EXAMPLE_DIMS: dict[str, Any] = dict(d_model=32, n_heads=4, head_dim=8, max_len=64, vocab_size=64, n_layers=2)


def example_options(encoding: str | type[PositionalEncoding], dims: dict[str, Any] | None = None) -> dict[str, Any]:
    """The settings ``encoding`` declares (``example_options``) to build a typical instance at the model ``dims``.

    Empty for an encoding the model dimensions build alone. A declared function of the dimensions gets ``dims``
    with the sizes it lacks taken from :data:`EXAMPLE_DIMS` (``head_dim`` from ``d_model // n_heads``).

    >>> example_options("rope-linear")
    {'factor': 4.0}
    """
    cls = resolve(encoding) if isinstance(encoding, str) else encoding
    declared = cls.example_options
    if callable(declared):
        dims = dict(dims or {})
        if dims.get("head_dim") is None and dims.get("d_model") and dims.get("n_heads"):
            dims["head_dim"] = dims["d_model"] // dims["n_heads"]
        dims = {**EXAMPLE_DIMS, **{k: v for k, v in dims.items() if v is not None}}
        return dict(declared(dims))
    return dict(declared)


def example(
    encoding: str | type[PositionalEncoding], dims: dict[str, Any] | None = None, **options: Any
) -> PositionalEncoding:
    """``encoding`` built as a model of ``dims`` (default :data:`EXAMPLE_DIMS`) builds it, with its
    ``example_options`` and then ``options`` on top.

    >>> example("rope-yarn").params["factor"]
    4.0
    """
    cls = resolve(encoding) if isinstance(encoding, str) else encoding
    dims = dict(EXAMPLE_DIMS if dims is None else dims)
    return build(cls.info.name, dims=dims, options={**example_options(cls, dims), **options} or None)


def needs_options(encoding: str | type[PositionalEncoding]) -> list[str]:
    """The settings ``encoding`` requires that no model dimension supplies (``[]``: the dimensions build it)."""
    cls = resolve(encoding) if isinstance(encoding, str) else encoding
    return [k for k, p in accepted_arguments(cls).items() if p.default is p.empty and k not in MODEL_DIMENSIONS]
