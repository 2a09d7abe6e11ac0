"""Multi-digit addition with index hints (Zhou et al. 2024, "What Algorithms can Transformers Learn?").

Index hints tag every digit with the token of its place, so that the digits of
the same place in both operands and in the answer can be found by an
induction-head style match rather than by counting positions. Zhou et al.
write ``54 + 37 = 91`` as ``a5b4 + a3b7 = a9b1``; we use this layout:

* input length ``N`` = the number of digits of each operand (both operands have
  exactly ``N`` digits, drawn uniformly, so leading zeros occur);
* digits are written **least significant first** in the operands and in the
  answer (Zhou et al.'s RASP-L friendly "reversed" format: each output digit
  depends on the digits of its own place and the carry from the place before);
* each digit is preceded by its index hint; the answer has ``N + 1`` digits
  (the last one is the final carry, 0 or 1), so its length is known in advance
  and the hints are part of the output the model must produce::

      h_s d_0  h_{s+1} d_1 ... +  h_s e_0 ... [SEP]  h_s c_0  h_{s+1} c_1 ... h_{s+N} c_N

* as in Zhou et al., the hints are a run of consecutive tokens from a larger
  ordered set of ``hints`` hint tokens, starting at a random offset ``s``
  (uniform in ``0 .. hints - N - 1``), so that every hint token is seen in
  training even when training numbers are short. ``hints`` defaults to the
  longest test length + 1 (the fewest that reach every test length).

Default model: a decoder (teacher forcing, greedy decoding of the answer).
"""

from __future__ import annotations

import random
from typing import Any

from ...errors import ConfigError
from ..seq_training import FIRST, Example, SeqTask, train_seq
from ..types import OnStep, RunConfig, register_task

DIGIT0 = FIRST  # digits 0..9: FIRST .. FIRST + 9
PLUS = FIRST + 10
HINT0 = FIRST + 11  # hint tokens: HINT0 .. HINT0 + hints - 1


def hints_for(cfg: RunConfig, opts: dict[str, Any]) -> int:
    """Number of hint tokens: the ``hints`` option, or (0 = automatic) the longest length + 1."""
    return opts["hints"] or max(max(cfg.test_lengths), cfg.train_lengths[1]) + 1


def decode_number(tokens: list[int]) -> int:
    """The integer written by hint/digit pairs (least significant first); hints are skipped."""
    digits = [t - DIGIT0 for t in tokens if DIGIT0 <= t < DIGIT0 + 10]
    return sum(d * 10**i for i, d in enumerate(digits))


@register_task
class AdditionTask(SeqTask):
    name = "addition"
    description = "add two N-digit numbers written with index hints, least significant digit first (Zhou et al. 2024)"
    default_model = "decoder"
    defaults = {"hints": 0, "index_hints": True}
    # decoder runs read a BOS token first since 2026-11-23 (docs/diagnosis-kazemnejad.md): runs stored before
    # have other keys and are trained again, not reused
    version = "bos"

    def check_options(self, cfg: RunConfig, opts: dict[str, Any]) -> None:
        longest = max(max(cfg.test_lengths), cfg.train_lengths[1])
        if opts["hints"] < 0:
            raise ConfigError(f"task 'addition': hints must be >= 0 (0 = automatic), got {opts['hints']}")
        if opts["hints"] and opts["hints"] < longest + 1:
            raise ConfigError(
                f"task 'addition': hints={opts['hints']} cannot tag the {longest + 1} answer digits at length "
                f"{longest}; use hints >= {longest + 1} (or 0 for automatic)"
            )

    def run(self, cfg: RunConfig, on_step: OnStep | None = None) -> dict[str, Any]:
        self.validate(cfg)
        return train_seq(self, cfg, self.eval_options(cfg), on_step)

    def eval_options(self, cfg: RunConfig) -> dict[str, Any]:
        opts = self.options(cfg)
        opts["hints"] = hints_for(cfg, opts)
        return opts

    def scored(self, output: list[int]) -> list[bool]:
        """Per-token accuracy counts the answer digits only: the hints are copied, not computed."""
        return [DIGIT0 <= t < DIGIT0 + 10 for t in output]

    def vocab_size(self, opts: dict[str, Any]) -> int:
        return HINT0 + max(opts["hints"], 1)

    def max_total(self, n: int, opts: dict[str, Any]) -> int:
        per = 2 if opts["index_hints"] else 1
        return per * n * 2 + 1 + 1 + per * (n + 1)

    def example(self, n: int, rng: random.Random, opts: dict[str, Any]) -> Example:
        a = [rng.randrange(10) for _ in range(n)]  # least significant first
        b = [rng.randrange(10) for _ in range(n)]
        c, carry = [], 0
        for x, y in zip(a, b):
            carry, d = divmod(x + y + carry, 10)
            c.append(d)
        c.append(carry)
        hinted = opts["index_hints"]
        s = rng.randrange(opts["hints"] - n) if hinted else 0

        def write(digits: list[int]) -> list[int]:
            out: list[int] = []
            for i, d in enumerate(digits):
                if hinted:
                    out.append(HINT0 + s + i)
                out.append(DIGIT0 + d)
            return out

        return write(a) + [PLUS] + write(b), write(c)
