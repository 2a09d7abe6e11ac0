"""Selective copy (Gu & Dao 2023, "Mamba"), as CoPE uses it (Golovneva et al. 2024, §5.2).

An input of ``N`` positions (``N`` = the *input length*) holds ``tokens`` data symbols at positions drawn uniformly
without replacement, in order; every other position is a blank. The answer is the data symbols in their order,
the blanks left out::

    . . 7 . . . 2 . 7 . . . 5 . .      ->   7 2 7 5

To copy the i-th symbol, a model must find the i-th *non-blank* token: a position that counts non-blanks (CoPE's
gates can learn to count only them) answers at any number of blanks, one that counts tokens must learn where the
i-th symbol lies among blanks, which moves as the blanks grow denser or sparser.

The splits: training at input length ``N`` (``train_lengths = [N, N]`` in the suite) with ``tokens`` symbols; the
in-distribution test at ``N``; the out-of-distribution tests at longer inputs with the same number of symbols, so
*more blanks* between them and positions never seen in training, the kind of shift Golovneva et al. test (the
paper's test error, %, of RoPE large out of distribution and CoPE's near zero; the table's numbers are to be
copied into the suite ``cope``'s ``[published]``). The paper's inputs are far longer (16 symbols among 256
positions, as we recall it: not checked against its text here); our default, 4 symbols among 24 (tested at 48),
is what a 2-core CPU trains in minutes.

Tokens: a blank and ``symbols`` data symbols; the answer has ``tokens`` symbol tokens. Default model: a decoder.
"""

from __future__ import annotations

import random
from typing import Any

from ...errors import ConfigError
from ..seq_training import FIRST, Example, SeqTask
from ..types import RunConfig, register_task

BLANK = FIRST
SYM0 = FIRST + 1  # data symbols SYM0 .. SYM0 + symbols - 1


@register_task
class SelectiveCopyTask(SeqTask):
    name = "selective_copy"
    description = "selective copy: copy the non-blank symbols of a mostly blank input, in order (Mamba; CoPE §5.2)"
    metric = "sequence_accuracy"
    default_model = "decoder"
    multi_token = True
    defaults = {"tokens": 4, "symbols": 8}

    def check_options(self, cfg: RunConfig, opts: dict[str, Any]) -> None:
        if opts["tokens"] < 1:
            raise ConfigError(f"task 'selective_copy': tokens (symbols to copy) must be >= 1, got {opts['tokens']}")
        if opts["symbols"] < 2:
            raise ConfigError(f"task 'selective_copy': symbols must be >= 2, got {opts['symbols']}")
        lo = cfg.train_lengths[0]
        if lo < opts["tokens"]:
            raise ConfigError(
                f"task 'selective_copy': an input of {lo} positions cannot hold {opts['tokens']} symbols; "
                f"use train_lengths starting at >= {opts['tokens']} or fewer tokens"
            )

    def vocab_size(self, opts: dict[str, Any]) -> int:
        return SYM0 + opts["symbols"]

    def max_total(self, n: int, opts: dict[str, Any]) -> int:
        return n + 1 + opts["tokens"]

    def example(self, n: int, rng: random.Random, opts: dict[str, Any]) -> Example:
        k = opts["tokens"]
        if n < k:
            raise ConfigError(f"task 'selective_copy': an input of {n} positions cannot hold {k} symbols")
        where = sorted(rng.sample(range(n), k))
        out = [SYM0 + rng.randrange(opts["symbols"]) for _ in range(k)]
        tokens = [BLANK] * n
        for pos, sym in zip(where, out):
            tokens[pos] = sym
        return tokens, out
