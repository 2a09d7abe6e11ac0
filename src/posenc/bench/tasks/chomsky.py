"""String tasks of Delétang et al. (2023), "Neural Networks and the Chomsky Hierarchy", plus copy.

Every task reads a random string ``w`` of ``N`` symbols (``N`` = the *input
length*, drawn from ``cfg.train_lengths`` in training) and answers with tokens:

* ``copy`` (Kazemnejad et al. 2023): output ``w``; 10 symbols by default;
* ``reverse`` (deterministic context-free): output ``w`` reversed; 2 symbols;
* ``duplicate`` (context-sensitive): output ``w w``; 2 symbols;
* ``bucket-sort`` (context-sensitive): output the symbols of ``w`` in sorted order; 5 symbols;
* ``parity`` (regular): one token, is the number of b's in ``w`` odd? (``w`` over {a, b});
* ``even-pairs`` (regular): one token, is the number of ``ab`` and ``ba`` pairs even?
  (equivalently: is the first symbol the last?) -- ``N >= 2``;
* ``missing-duplicate`` (context-sensitive): one token, the masked symbol of ``w w``.

The alphabet size of the first four is the option ``symbols``
(``task_options={"symbols": k}``); the last three are binary.

``missing-duplicate`` reads ``w w`` (``2N`` tokens) with one random position
replaced by a mask token. Symbols are drawn uniformly and independently, so
parity, even pairs and missing duplicate are balanced (50% each answer).
Outputs are predicted at output slots by an encoder (the paper's setting, the
default) or decoded greedily by a decoder (``cfg.model="decoder"``); see
:mod:`posenc.bench.seq_training`.
"""

from __future__ import annotations

import random
from typing import Any, ClassVar

from ...errors import ConfigError
from ..seq_training import FIRST, Example, SeqTask
from ..types import RunConfig, register_task


class StringTask(SeqTask):
    """A task on a random string of ``symbols`` symbols (token ids ``FIRST .. FIRST + symbols - 1``)."""

    default_model = "encoder"
    default_symbols: ClassVar[int] = 2
    # decoder runs read a BOS token first since 2026-11-23 (docs/diagnosis-kazemnejad.md): runs stored before
    # have other keys and are trained again, not reused
    version = "bos"
    max_symbols: ClassVar[int] = 64
    #: extra tokens after the symbols (answer or mask tokens)
    extra_tokens: ClassVar[int] = 0
    #: whether the alphabet size is an option (``task_options={"symbols": k}``)
    symbols_option: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.defaults = {"symbols": cls.default_symbols} if cls.symbols_option else {}

    def check_options(self, cfg: RunConfig, opts: dict[str, Any]) -> None:
        k = opts["symbols"]
        if not 2 <= k <= self.max_symbols:
            raise ConfigError(f"task {self.name!r}: symbols must be in 2..{self.max_symbols}, got {k}")

    def vocab_size(self, opts: dict[str, Any]) -> int:
        return FIRST + opts["symbols"] + self.extra_tokens

    def word(self, n: int, rng: random.Random, opts: dict[str, Any]) -> list[int]:
        k = opts["symbols"]
        return [FIRST + rng.randrange(k) for _ in range(n)]

    def max_total(self, n: int, opts: dict[str, Any]) -> int:
        return n + 1 + n


@register_task
class CopyTask(StringTask):
    name = "copy"
    description = "copy a random string (Kazemnejad et al. 2023); output the input unchanged"
    # 10 symbols rather than 2: a decoder copies by matching content (induction), which a binary
    # alphabet makes ambiguous; with 10, a 2-layer decoder learns length-20 copies in ~1000 steps
    default_symbols = 10

    def example(self, n: int, rng: random.Random, opts: dict[str, Any]) -> Example:
        w = self.word(n, rng, opts)
        return w, list(w)


@register_task
class ReverseTask(StringTask):
    name = "reverse"
    description = "reverse a random string (Delétang et al. 2023, deterministic context-free)"

    def example(self, n: int, rng: random.Random, opts: dict[str, Any]) -> Example:
        w = self.word(n, rng, opts)
        return w, w[::-1]


@register_task
class DuplicateTask(StringTask):
    name = "duplicate"
    description = "duplicate a random string: w -> w w (Delétang et al. 2023, context-sensitive)"

    def max_total(self, n: int, opts: dict[str, Any]) -> int:
        return n + 1 + 2 * n

    def example(self, n: int, rng: random.Random, opts: dict[str, Any]) -> Example:
        w = self.word(n, rng, opts)
        return w, w + w


@register_task
class BucketSortTask(StringTask):
    name = "bucket-sort"
    description = "sort the symbols of a random string (Delétang et al. 2023, context-sensitive; 5 symbols)"
    default_symbols = 5

    def example(self, n: int, rng: random.Random, opts: dict[str, Any]) -> Example:
        w = self.word(n, rng, opts)
        return w, sorted(w)


class BinaryLabelTask(StringTask):
    """A binary string ``a``/``b`` (tokens ``FIRST``, ``FIRST + 1``) and a one-token answer."""

    metric = "accuracy"
    multi_token = False
    symbols_option = False
    extra_tokens = 2  # NO = FIRST + 2, YES = FIRST + 3

    def vocab_size(self, opts: dict[str, Any]) -> int:
        return FIRST + 2 + self.extra_tokens

    def check_options(self, cfg: RunConfig, opts: dict[str, Any]) -> None:
        pass

    def word(self, n: int, rng: random.Random, opts: dict[str, Any]) -> list[int]:
        return [FIRST + rng.randrange(2) for _ in range(n)]

    def max_total(self, n: int, opts: dict[str, Any]) -> int:
        return n + 2

    def chance(self, cfg: RunConfig, label: str) -> float | None:
        return 0.5  # both answers are equally likely


A_TOK, B_TOK, NO, YES = FIRST, FIRST + 1, FIRST + 2, FIRST + 3
MASK = FIRST + 2


@register_task
class ParityTask(BinaryLabelTask):
    name = "parity"
    description = "is the number of b's in a binary string odd? (Delétang et al. 2023, regular)"

    def example(self, n: int, rng: random.Random, opts: dict[str, Any]) -> Example:
        w = self.word(n, rng, opts)
        odd = w.count(B_TOK) % 2 == 1
        return w, [YES if odd else NO]


@register_task
class EvenPairsTask(BinaryLabelTask):
    name = "even-pairs"
    description = "is the number of ab and ba pairs even, i.e. first == last symbol? (Delétang et al. 2023, regular)"
    min_length = 2

    def example(self, n: int, rng: random.Random, opts: dict[str, Any]) -> Example:
        w = self.word(n, rng, opts)
        return w, [YES if w[0] == w[-1] else NO]


@register_task
class MissingDuplicateTask(BinaryLabelTask):
    name = "missing-duplicate"
    description = "w w with one symbol masked: which symbol is missing? (Delétang et al. 2023, context-sensitive)"
    extra_tokens = 1  # the mask token; the answer is a or b

    def max_total(self, n: int, opts: dict[str, Any]) -> int:
        return 2 * n + 2

    def example(self, n: int, rng: random.Random, opts: dict[str, Any]) -> Example:
        w = self.word(n, rng, opts)
        s = w + w
        i = rng.randrange(2 * n)
        answer = s[i]
        s[i] = MASK
        return s, [answer]
