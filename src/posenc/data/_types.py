"""The containers the loaders return: plain lists and strings, one attribute per split."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..errors import ConfigError
from .vocab import Vocab

SPLITS = ("train", "valid", "test")


class _Splits:
    name: str
    train: Sequence
    valid: Sequence
    test: Sequence

    def __getitem__(self, split: str) -> Sequence:
        if split not in SPLITS:
            raise ConfigError(f"unknown split {split!r} of {self.name}; the splits are {', '.join(SPLITS)}")
        return getattr(self, split)


class _ExampleSplits(_Splits):
    """Splits of ``(tokens, target)`` examples (classification, tagging): the vocabulary is the training tokens'."""

    train: Sequence[tuple[Sequence[str], object]]

    def vocab(self, min_freq: int = 1, max_size: int | None = None) -> Vocab:
        """Vocabulary of the training split."""
        return Vocab.build((t for t, _ in self.train), min_freq=min_freq, max_size=max_size)

    def sizes(self) -> dict[str, int]:
        return {s: len(self[s]) for s in SPLITS}


@dataclass
class ClassificationData(_ExampleSplits):
    """``train``/``valid``/``test``: lists of ``(tokens: list[str], label: int)``; ``labels[i]`` names label ``i``."""

    name: str
    train: list[tuple[list[str], int]]
    valid: list[tuple[list[str], int]]
    test: list[tuple[list[str], int]]
    labels: list[str]
    citation: str
    split_note: str = ""
    source: str = ""


@dataclass
class TaggingData(_ExampleSplits):
    """Splits are lists of ``(tokens: list[str], tag ids: list[int])``; ``tags[i]`` names tag ``i``."""

    name: str
    train: list[tuple[list[str], list[int]]]
    valid: list[tuple[list[str], list[int]]]
    test: list[tuple[list[str], list[int]]]
    tags: list[str]
    citation: str
    split_note: str = ""
    source: str = ""


@dataclass
class LMData(_Splits):
    """``train``/``valid``/``test``: token sequences (a ``list[str]`` of words, or a ``str`` of characters)."""

    name: str
    train: Sequence[str]
    valid: Sequence[str]
    test: Sequence[str]
    citation: str
    split_note: str = ""
    source: str = ""
    reserved: list[str] = field(default_factory=list)

    def vocab(self, min_freq: int = 1, max_size: int | None = None) -> Vocab:
        """Vocabulary of the training split (``<pad>``, ``<unk>`` first)."""
        return Vocab.build([self.train], min_freq=min_freq, max_size=max_size, extra=self.reserved)
