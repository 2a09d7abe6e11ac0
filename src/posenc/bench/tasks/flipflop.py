"""Flip-Flop (Liu et al. 2023, "Exposing Attention Glitches with Flip-Flop Language Modeling"), as CoPE uses it.

A sequence of ``N`` instructions (``N`` = the *input length*), each followed by one bit::

    w 1 i 0 i 1 r 1 w 0 i 1 i 1 r      ->   0

``w b`` writes ``b`` to a one-bit register, ``i b`` is ignored (``b`` is noise), ``r b`` reads: its bit is the
register's value. The first instruction is a write, the last a read whose bit is the answer; the reads before it
carry their right bits, as in Liu et al.'s language. Each instruction between is drawn with probabilities
``(p_w, p_r, p_i) = ((1 - p_i) / 2, (1 - p_i) / 2, p_i)``; the bits of writes and ignores are uniform. To answer,
a model must find the *last write* and copy its bit: it must skip however many ignores lie between, which a
position encoding that counts tokens finds hard once the gap is longer than those seen in training.

The splits, as Golovneva et al. 2024 ("Contextual Position Encoding: Learning to Count What's Important", §5.1,
Table 1) define them after Liu et al.: training and the in-distribution test draw ignores with
``p_i = 0.8`` (``ignore``); the out-of-distribution test is *sparse*, ``p_i = 0.98`` (``ood_ignore``), at the
same length, so that the last write lies much further back. The run reports ``"<n>"`` (in distribution) and
``"<n>_sparse"`` (the sparse split) at every test length ``n``.

The paper reports the test *error* (%), RoPE's large out of distribution and CoPE's small, on sequences of 256
tokens (128 instructions; Liu et al.'s length, not checked against the paper's text here). Its table's numbers are
to be copied into the suite ``cope``'s ``[published]``: they were not at hand when this was written. Ours is
reduced to ``N`` = 32 instructions (63 tokens and the final read) so that a 2-core CPU trains it.

Tokens: ``w``, ``r``, ``i``, ``0``, ``1``; the answer is one bit token. Default model: a decoder.
"""

from __future__ import annotations

import random
from typing import Any

from ...errors import ConfigError
from ..seq_training import FIRST, Example, SeqTask, eval_rng
from ..types import RunConfig, register_task

W, R, I, B0 = FIRST, FIRST + 1, FIRST + 2, FIRST + 3  # B0, B0 + 1: the bits 0 and 1
#: the suffix of the out-of-distribution (sparse) split's metrics: ``"<n>_sparse"``
SPARSE = "sparse"


def flipflop_answer(tokens: list[int]) -> int:
    """The bit token a final read of ``tokens`` (instructions and bits, ending in ``r``) must give: the last write's."""
    last = None
    for k in range(0, len(tokens) - 1, 2):
        if tokens[k] == W:
            last = tokens[k + 1]
    if last is None:
        raise ValueError("a flip-flop sequence must hold a write before its final read")
    return last


def eval_split_rng(seed: int, length: int) -> random.Random:
    """The generator of the sparse split's examples at one test length (apart from the in-distribution one)."""
    return random.Random(eval_rng(seed, length).random() + 0.5)


@register_task
class FlipFlopTask(SeqTask):
    name = "flipflop"
    description = "Flip-Flop: write/ignore/read a 1-bit register; answer the final read (Liu et al. 2023; CoPE §5.1)"
    metric = "accuracy"
    default_model = "decoder"
    multi_token = False
    min_length = 2
    defaults = {"ignore": 0.8, "ood_ignore": 0.98}

    def check_options(self, cfg: RunConfig, opts: dict[str, Any]) -> None:
        for key in ("ignore", "ood_ignore"):
            if not 0.0 <= opts[key] < 1.0:
                raise ConfigError(
                    f"task 'flipflop': {key} (the probability of an ignore) must be in [0, 1), got {opts[key]}"
                )

    def vocab_size(self, opts: dict[str, Any]) -> int:
        return B0 + 2

    def max_total(self, n: int, opts: dict[str, Any]) -> int:
        return 2 * n - 1 + 1 + 1

    def draw(self, n: int, rng: random.Random, p_ignore: float) -> Example:
        """One sequence of ``n`` instructions with ignores drawn at ``p_ignore``; the answer is the final read's bit."""
        tokens = [W, B0 + rng.randrange(2)]
        register = tokens[1]
        for _ in range(n - 2):
            u = rng.random()
            if u < p_ignore:
                tokens += [I, B0 + rng.randrange(2)]
            elif u < p_ignore + (1.0 - p_ignore) / 2:
                register = B0 + rng.randrange(2)
                tokens += [W, register]
            else:
                tokens += [R, register]
        return tokens + [R], [register]

    def example(self, n: int, rng: random.Random, opts: dict[str, Any]) -> Example:
        return self.draw(n, rng, opts["ignore"])

    def eval_splits(self, cfg: RunConfig, n: int, opts: dict[str, Any]) -> dict[str, list[Example]]:
        """The in-distribution examples (``"<n>"``) and the sparse split (``"<n>_sparse"``) at length ``n``."""
        return {**super().eval_splits(cfg, n, opts), f"{n}_{SPARSE}": self.split_examples(cfg, n, opts)}

    def split_examples(self, cfg: RunConfig, n: int, opts: dict[str, Any]) -> list[Example]:
        """The sparse split's evaluation examples at length ``n``."""
        rng = eval_split_rng(cfg.seed, n)
        return [self.draw(n, rng, opts["ood_ignore"]) for _ in range(cfg.eval_samples)]

    def examples(self, cfg: RunConfig, label: str) -> int | None:
        n_text, _, kind = label.partition("_")
        return cfg.eval_samples if n_text.isdigit() and kind in ("", SPARSE) else None

    def chance(self, cfg: RunConfig, label: str) -> float | None:
        n_text, _, kind = label.partition("_")
        if kind != SPARSE or not n_text.isdigit():
            return super().chance(cfg, label)
        outs = [tuple(out) for _, out in self.split_examples(cfg, int(n_text), self.options(cfg))]
        return max(outs.count(o) for o in set(outs)) / len(outs)

