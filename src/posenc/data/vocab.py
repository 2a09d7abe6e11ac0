"""Tokenizers, a vocabulary, and padded LongTensor batches.

Conventions shared with :mod:`posenc.bench.tasks` and :mod:`posenc.models`: id 0 is
padding, ``attention_mask`` is ``True`` for real tokens, and tag targets at padded
positions are ``-100`` (the default ``ignore_index`` of ``cross_entropy``).
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import Tensor

from ..errors import ConfigError

PAD, UNK = "<pad>", "<unk>"
PAD_ID, UNK_ID = 0, 1
IGNORE_INDEX = -100

_WORD = re.compile(r"\w+(?:['’]\w+)*|[^\w\s]")


def tokenize_en(text: str) -> list[str]:
    """Lower-cased English words; punctuation marks are tokens of their own.

    ``"It's a ''Conan''!"`` -> ``["it's", "a", "'", "'", "conan", "'", "'", "!"]``.
    """
    return _WORD.findall(text.lower())


def tokenize_zh(text: str) -> list[str]:
    """Chinese text as characters (whitespace dropped)."""
    return [c for c in text if not c.isspace()]


class Vocab:
    """Token <-> id map with ``<pad>`` = 0 and ``<unk>`` = 1.

    Build it from the training split only (:meth:`build`), so that held-out words map
    to ``<unk>``.
    """

    def __init__(self, tokens: Sequence[str]):
        if list(tokens[:2]) != [PAD, UNK]:
            raise ConfigError(f"a Vocab starts with {PAD!r}, {UNK!r}; got {list(tokens[:2])}")
        if len(set(tokens)) != len(tokens):
            raise ConfigError("a Vocab's tokens must be distinct")
        self.itos: list[str] = list(tokens)
        self.stoi: dict[str, int] = {t: i for i, t in enumerate(self.itos)}

    @classmethod
    def build(
        cls,
        sequences: Iterable[Sequence[str]],
        *,
        min_freq: int = 1,
        max_size: int | None = None,
        extra: Sequence[str] = (),
    ) -> Vocab:
        """Vocabulary of the tokens seen at least ``min_freq`` times.

        Tokens are ordered by falling frequency, ties broken alphabetically (so the ids
        do not depend on the order of the data). ``max_size`` counts the two specials
        and ``extra`` (further reserved tokens placed right after them).
        """
        if min_freq < 1:
            raise ConfigError(f"min_freq must be >= 1, got {min_freq}")
        reserved = [PAD, UNK, *extra]
        if max_size is not None and max_size < len(reserved):
            raise ConfigError(f"max_size must be >= {len(reserved)} (the reserved tokens), got {max_size}")
        counts: Counter[str] = Counter()
        for seq in sequences:
            counts.update(seq)
        words = sorted(
            (t for t, c in counts.items() if c >= min_freq and t not in reserved), key=lambda t: (-counts[t], t)
        )
        if max_size is not None:
            words = words[: max_size - len(reserved)]
        return cls(reserved + words)

    def __len__(self) -> int:
        return len(self.itos)

    def __contains__(self, token: str) -> bool:
        return token in self.stoi

    def encode(self, tokens: Iterable[str]) -> list[int]:
        get = self.stoi.get
        return [get(t, UNK_ID) for t in tokens]

    def decode(self, ids: Iterable[int]) -> list[str]:
        return [self.itos[i] for i in ids]


def pad_batch(
    seqs: Sequence[Sequence[int]], *, max_len: int | None = None, pad_id: int = PAD_ID
) -> tuple[Tensor, Tensor]:
    """Right-pad id sequences: ``(tokens [N, L] long, attention_mask [N, L] bool)``.

    ``L`` is the longest sequence (after cutting each to ``max_len`` if given).
    """
    if max_len is not None and max_len < 1:
        raise ConfigError(f"max_len must be >= 1, got {max_len}")
    if len(seqs) == 0:
        raise ConfigError("pad_batch needs at least one sequence")
    cut = [list(s[:max_len]) if max_len is not None else list(s) for s in seqs]
    width = max(1, max(len(s) for s in cut))
    tokens = torch.full((len(cut), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(cut), width), dtype=torch.bool)
    for i, s in enumerate(cut):
        if s:
            tokens[i, : len(s)] = torch.tensor(s, dtype=torch.long)
            mask[i, : len(s)] = True
    return tokens, mask


@dataclass
class TextBatch:
    tokens: Tensor  # [N, L] long, 0 = padding
    attention_mask: Tensor  # [N, L] bool, True = real token
    labels: Tensor  # [N] long (classification) or [N, L] long with -100 at padding (tagging)


def _order(n: int, shuffle: bool, seed: int) -> list[int]:
    if not shuffle:
        return list(range(n))
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(n, generator=g).tolist()


E = TypeVar("E")


def _chunks(examples: Sequence[E], batch_size: int, shuffle: bool, seed: int) -> Iterator[list[E]]:
    """``examples`` in chunks of ``batch_size`` (the last one shorter), in order or shuffled with ``seed``: the
    examples of each batch, whatever the task."""
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
    order = _order(len(examples), shuffle, seed)
    for start in range(0, len(order), batch_size):
        yield [examples[i] for i in order[start : start + batch_size]]


def classification_batches(
    examples: Sequence[tuple[Sequence[str], int]],
    vocab: Vocab,
    batch_size: int,
    *,
    shuffle: bool = False,
    seed: int = 0,
    max_len: int | None = None,
) -> Iterator[TextBatch]:
    """Batches of ``(tokens, label)`` examples: ``labels`` is ``[N]``."""
    for chunk in _chunks(examples, batch_size, shuffle, seed):
        tokens, mask = pad_batch([vocab.encode(t) for t, _ in chunk], max_len=max_len)
        yield TextBatch(tokens, mask, torch.tensor([y for _, y in chunk], dtype=torch.long))


def tagging_batches(
    examples: Sequence[tuple[Sequence[str], Sequence[int]]],
    vocab: Vocab,
    batch_size: int,
    *,
    shuffle: bool = False,
    seed: int = 0,
    max_len: int | None = None,
) -> Iterator[TextBatch]:
    """Batches of ``(tokens, tag ids)`` examples: ``labels`` is ``[N, L]``, ``-100`` at padding."""
    for chunk in _chunks(examples, batch_size, shuffle, seed):
        for toks, tags in chunk:
            if len(toks) != len(tags):
                raise ConfigError(f"an example has {len(toks)} tokens but {len(tags)} tags")
        tokens, mask = pad_batch([vocab.encode(t) for t, _ in chunk], max_len=max_len)
        labels, _ = pad_batch([list(tags) for _, tags in chunk], max_len=max_len, pad_id=IGNORE_INDEX)
        yield TextBatch(tokens, mask, labels[:, : tokens.shape[1]])


def lm_stream(tokens: Sequence[str], vocab: Vocab) -> Tensor:
    """A whole split as one LongTensor of ids ``[T]``."""
    return torch.tensor(vocab.encode(tokens), dtype=torch.long)


def lm_batches(stream: Tensor, batch_size: int, seq_len: int) -> Iterator[tuple[Tensor, Tensor]]:
    """Contiguous language-model batches ``(input [B, T], target [B, T])``, target = input shifted by one.

    The stream is cut into ``batch_size`` equal rows (the remainder is dropped, as in
    the usual Mikolov/Zaremba set-up) and read left to right in windows of ``seq_len``;
    the last window may be shorter.
    """
    if batch_size < 1 or seq_len < 1:
        raise ConfigError(f"batch_size and seq_len must be >= 1, got {batch_size} and {seq_len}")
    if stream.dim() != 1:
        raise ConfigError(f"lm_batches takes a 1-D id stream, got shape {tuple(stream.shape)}")
    cols = stream.numel() // batch_size
    if cols < 2:
        raise ConfigError(f"a stream of {stream.numel()} ids is too short for batch_size {batch_size}")
    rows = stream[: cols * batch_size].view(batch_size, cols)
    for start in range(0, cols - 1, seq_len):
        end = min(start + seq_len, cols - 1)
        yield rows[:, start:end], rows[:, start + 1 : end + 1]


def stable_rank(key: str, seed: int) -> str:
    """A sort key that depends only on ``seed`` and the text (not on library versions)."""
    return hashlib.sha1(f"{seed}\x00{key}".encode()).hexdigest()


def split_by_hash(
    items: Sequence,
    keys: Sequence[str],
    *,
    n_valid: int,
    n_test: int,
    seed: int = 0,
    fold: int | None = None,
    n_folds: int = 10,
) -> dict[str, list]:
    """Deterministic train/valid/test split with exact sizes.

    Items are ordered by ``sha1(seed, key)`` (stable across Python/torch versions and
    independent of the input order); the first ``n_test`` are test, the next
    ``n_valid`` valid, the rest train. With ``fold=k`` (cross-validation), test is the
    k-th of ``n_folds`` equal slices of that order, valid the ``n_valid`` items after
    it (cyclically), train the rest. Within each split items keep their input order.
    """
    n = len(items)
    if len(keys) != n:
        raise ConfigError(f"{n} items but {len(keys)} keys")
    ranked = sorted(range(n), key=lambda i: (stable_rank(keys[i], seed), i))
    if fold is not None:
        if not 0 <= fold < n_folds:
            raise ConfigError(f"fold must be in 0..{n_folds - 1}, got {fold}")
        lo, hi = fold * n // n_folds, (fold + 1) * n // n_folds
        ranked = ranked[lo:] + ranked[:lo]
        n_test = hi - lo
    if n_valid < 0 or n_test < 0 or n_valid + n_test >= n:
        raise ConfigError(f"n_valid={n_valid} and n_test={n_test} leave no training data out of {n} items")
    test = sorted(ranked[:n_test])
    valid = sorted(ranked[n_test : n_test + n_valid])
    taken = set(test) | set(valid)
    return {
        "train": [items[i] for i in range(n) if i not in taken],
        "valid": [items[i] for i in valid],
        "test": [items[i] for i in test],
    }
